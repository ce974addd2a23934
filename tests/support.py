"""What several test modules share, so that no test module imports another
(shared fixtures are in ``shared_fixtures.py``): the repository's configs and
tools, the environment of a training process on N host CPU devices, the
outputs of processes run together, a small array_record shard of solid red
images (a second data source that no digit resembles), a run's metrics, the
train step alone, the command line in-process, two processes of one run, the
tiny model saved as a workdir, the package's import graph and a workdir
lock taken over while its holder was paused."""

import ast
import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags
import jax
import ml_collections
import numpy as np

import prolip_jax
from prolip_jax import demos
from prolip_jax import main
from prolip_jax import sharding as shd
from prolip_jax.config import presets
from prolip_jax.data import record_format
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.models import TextConfig
from prolip_jax.models import VisionConfig
from prolip_jax.models.prolip import init_params
from prolip_jax.storage import checkpoint
from prolip_jax.storage import paths
from prolip_jax.training import optimizer
from prolip_jax.training import train

RED = (250, 0, 0)


def xla_flags(devices: int) -> str:
  """This process's ``XLA_FLAGS`` for a child process on ``devices`` host
  CPU devices: the device count replaced, every other flag kept (CI's
  tiers compile at -O0 without XLA:CPU's fusion emitters, and the training
  processes their tests start compile the same way: a micro run's step
  compiles 5x faster)."""
  kept = [flag for flag in os.environ.get('XLA_FLAGS', '').split()
          if not flag.startswith('--xla_force_host_platform_device_count')]
  return ' '.join(kept + [f'--xla_force_host_platform_device_count={devices}'])


def cpu_env(devices: int) -> dict[str, str]:
  """``os.environ`` for a process of ``prolip_jax.main`` on ``devices``
  host CPU devices. A hung process's log holds everything it printed, and
  SIGABRT makes it print where every thread is."""
  env = dict(os.environ)
  env['XLA_FLAGS'] = xla_flags(devices)
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONUNBUFFERED'] = '1'
  env['PYTHONFAULTHANDLER'] = '1'
  return env


def red_shard(directory, n: int = 40) -> str:
  """One array_record shard of ``n`` solid red JPEGs (digits are grey) in
  ``directory``; returns its glob."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  writer = record_format.ShardWriter(os.path.join(directory,
                                                  'red.array_record'))
  for i in range(n):
    buf = io.BytesIO()
    Image.new('RGB', (40, 40), RED).save(buf, 'JPEG')
    writer.write(record_format.serialize_example(
        buf.getvalue(), f'a red square number {i}', f'red{i}'))
  writer.close()
  return os.path.join(directory, '*.array_record')


def outputs_of(procs: list[subprocess.Popen], timeout: float) -> list[str]:
  """The output of each process (started with ``stdout=PIPE``, text),
  once every one has exited 0; all are killed if one outlives
  ``timeout``."""
  outputs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    outputs.append(out)
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return outputs


# ----------------------------------------------------------------------------
# Configs and tools of the repository

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, 'configs')
MICRO = os.path.join(CONFIG_DIR, 'prolip_micro.py')


def load_config(name: str):
  """``get_config()`` of ``configs/NAME.py``."""
  return presets.load_config_file(os.path.join(CONFIG_DIR, name + '.py'))


def micro_config(total_steps: int = 6, **overrides):
  """``configs/prolip_micro.py`` on one device (whatever the host has) for
  ``total_steps``, with ``overrides`` ``{'dotted.key': value}``."""
  c = presets.load_config_file(MICRO)
  c.total_steps = total_steps
  c.mesh.num_devices = 1
  for key, value in overrides.items():
    node = c
    *path, last = key.split('.')
    for p in path:
      node = node[p]
    node[last] = value
  return c


def objective_micro_config(objective: str, total_steps: int,
                           num_devices: int = 1, batch_size: int = 16):
  """``prolip_micro`` towers with ``objective``'s tiny-demo settings, data
  parallel over ``num_devices``, a loss row every step."""
  c = load_config('prolip_micro')
  demo = demos.tiny_demo_config(objective)
  c.objective = objective
  c.model.use_unc = demo.model.use_unc
  c.model.init_logit_scale = demo.model.init_logit_scale
  c.model.init_logit_bias = demo.model.init_logit_bias
  c.loss = demo.loss
  c.optim.ema_decay = demo.optim.ema_decay  # OTTER's teacher
  c.total_steps = total_steps
  c.batch_size = batch_size
  c.optim.lr = 1e-3
  c.mesh.num_devices = num_devices
  c.mesh.data = num_devices
  c.mesh.fsdp = 1
  c.checkpoint_every_steps = 1000
  c.log_every_steps = 1
  return c


def tiny_random_model(context_length: int, tokenizer_path: str):
  """``(ModelConfig, params)`` of a randomly initialised tiny [UNC] model
  (32 wide, one layer per tower, 16-dim embedding), with a 256-piece
  tokenizer trained on the digits' captions written to
  ``tokenizer_path``: what evaluation and application tests score."""
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  m = presets.model_preset('tiny')
  m.vision.width = m.text.width = 32
  m.vision.layers = m.text.layers = 1
  m.vision.heads = m.text.heads = 2
  m.text.context_length = context_length
  m.embed_dim = 16
  m.init_unc_bias = -3.0
  cfg = ModelConfig.from_config(m)
  params = jax.device_get(jax.jit(functools.partial(init_params, cfg))(
      jax.random.key(0)))
  corpus = digits.tokenizer_corpus()
  tok_lib.train_tokenizer(corpus[:800] + corpus[-40:], tokenizer_path, 256)
  return cfg, params


def load_module(relpath: str, name: str):
  """The Python file ``REPO/relpath`` imported as module ``name``."""
  spec = importlib.util.spec_from_file_location(name,
                                                os.path.join(REPO, relpath))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def tool(name: str):
  """``tools/NAME.py`` as a module."""
  return load_module(os.path.join('tools', name + '.py'), name)


# ----------------------------------------------------------------------------
# A run's outputs


def metric_rows(workdir) -> list[dict]:
  """Every row of ``workdir``'s metrics.jsonl."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def metric_values(workdir, key: str = 'loss') -> list:
  """``key`` of every metrics.jsonl row that has it, in order."""
  return [r[key] for r in metric_rows(workdir) if key in r]


def trained_params(workdir):
  """The newest checkpoint's parameters, as numpy arrays."""
  params, _ = checkpoint.load_params(workdir)
  return jax.tree.map(np.asarray, params)


# ----------------------------------------------------------------------------
# The train step alone

MASK_ID = 3  # [MASK] of micro_step's tokenizer


class _MicroTokenizer:
  """What ``train.model_config_for`` reads of a tokenizer."""
  vocab_size = 64
  pad_id = 0


def micro_step(c):
  """``(model, tx, init, step, batch)`` for config ``c`` on one device: the
  jitted initializer and train step of the run's state (an EMA with
  ``optim.ema_decay``) and a random batch."""
  model = ProLIP(train.model_config_for(c, _MicroTokenizer()))
  mesh = shd.make_mesh({'data': 1, 'fsdp': 1, 'num_devices': 1})
  tx, schedule = optimizer.make_optimizer(c.optim, c.total_steps)
  init, shardings = train.run_state_initializer(c, model, tx, mesh)
  step = jax.jit(
      train.make_train_step(model, c, tx, schedule, mesh, MASK_ID),
      in_shardings=(shardings, shd.batch_sharding(mesh),
                    shd.replicated(mesh)),
      out_shardings=(shardings, shd.replicated(mesh)))
  rng = np.random.default_rng(0)
  b, s = c.batch_size, model.config.vision.image_size
  batch = shd.host_to_global(mesh, {
      'image': rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8),
      'aug': np.tile(transforms.identity_aug_vector(), (b, 1)),
      'tokens': rng.integers(4, 60, (b, model.config.text.context_length),
                             dtype=np.int32)})
  return model, tx, init, step, batch


# ----------------------------------------------------------------------------
# The command line


def run_main(*args) -> tuple[int, str, str]:
  """``main.run(['prog', *args])`` in this process -> (status, stdout,
  stderr).

  absl flags are global to the process and ``main`` defines them (and the
  ``--config.KEY`` overrides it was given) once; the flags a call defined are
  removed afterwards, so every call parses its own command line as a fresh
  process would.
  """
  before = set(flags.FLAGS)
  out, err = io.StringIO(), io.StringIO()
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      code = main.run(['prog', *args])
  finally:
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)
  return code, out.getvalue(), err.getvalue()


def main_env() -> dict[str, str]:
  """``os.environ`` for a ``python -m prolip_jax.main`` of this checkout on
  one host CPU device."""
  env = dict(os.environ)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env['XLA_FLAGS'] = xla_flags(1)
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def damage_file(path, damage: str) -> None:
  """'garble': flip 16 bytes mid-file (same size: only the checksum can
  tell); 'truncate': keep the first third."""
  data = bytearray(open(path, 'rb').read())
  if damage == 'garble':
    for i in range(len(data) // 2, len(data) // 2 + 16):
      data[i] ^= 0xFF
  else:
    data = data[:len(data) // 3]
  open(path, 'wb').write(bytes(data))


# ----------------------------------------------------------------------------
# Two processes of one run (127.0.0.1, 2 CPU devices each)

TWO_PROCESS_STEPS = 30  # steps of the interrupted runs: room for two stops
# No periodic checkpoint: the checkpoints are the stops' and the last step's.
_NO_PERIODIC = ('--config.checkpoint_every_steps=1000',)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def main_command(workdir, extra=(), config=MICRO, steps=4) -> list[str]:
  """``python -m prolip_jax.main`` of ``config`` for ``steps`` at batch 32,
  data parallel over every device."""
  return [sys.executable, '-m', 'prolip_jax.main', f'--config={config}',
          f'--workdir={workdir}', f'--config.total_steps={steps}',
          '--config.batch_size=32', '--config.mesh.data=-1', *extra]


class TwoProcesses:
  """``prolip_jax.main`` as processes 0 and 1 of one run, each writing its
  output to ``LOG_DIR/NAME<i>.log``; ``env``: variables added to theirs
  (an object-store server's)."""

  def __init__(self, workdir, log_dir, name, extra=(),
               steps=TWO_PROCESS_STEPS, env=None):
    port = free_port()
    self.logs = [str(log_dir / f'{name}{i}.log') for i in range(2)]
    self.procs = []
    for i, log in enumerate(self.logs):
      with open(log, 'w') as out:
        self.procs.append(subprocess.Popen(
            main_command(workdir, [f'--coordinator_address=127.0.0.1:{port}',
                                   '--num_processes=2', f'--process_id={i}',
                                   *_NO_PERIODIC, *extra], steps=steps),
            env=dict(cpu_env(2), **(env or {})), cwd=REPO, stdout=out,
            stderr=subprocess.STDOUT))

  def output(self, i) -> str:
    with open(self.logs[i]) as f:
      return f.read()

  def wait_until(self, done, timeout=300):
    """Polls ``done()`` until true; fails if a process ends first."""
    deadline = time.time() + timeout
    while not done():
      assert all(p.poll() is None for p in self.procs), self.output(0)[-3000:]
      assert time.time() < deadline, 'timed out'
      time.sleep(0.05)

  def wait(self, timeout=300) -> list[int]:
    """Both exit statuses; kills both and fails past ``timeout``."""
    deadline = time.time() + timeout
    try:
      for p in self.procs:
        p.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
      for p in self.procs:
        if p.poll() is None:
          p.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack
      time.sleep(5)
      for p in self.procs:
        p.kill()
        p.wait()
      # Both logs: which host waited for which, and where.
      raise AssertionError(f'not ended after {timeout} s\n' + '\n'.join(
          f'--- process {i}, last lines:\n{self.output(i)[-2500:]}'
          for i in range(2))) from None
    return [p.returncode for p in self.procs]


def stop_steps(run: TwoProcesses) -> list[int]:
  """The step each process said every host stops after (one per process)."""
  found = [re.findall(r'every host stops after step (\d+)', run.output(i))
           for i in range(2)]
  assert all(len(f) == 1 for f in found), found
  return [int(f[0]) for f in found]


# ----------------------------------------------------------------------------
# The tiny model, saved as an imported workdir

# Pad 0, eos 1, unk 2, [MASK] 3: the ids of tokenizers trained here.
TINY = ModelConfig(
    embed_dim=16,
    vision=VisionConfig(image_size=16, patch_size=8, width=32, layers=1,
                        heads=2),
    text=TextConfig(vocab_size=128, context_length=12, width=32, layers=1,
                    heads=2, pad_id=0))


@functools.lru_cache(maxsize=None)
def tiny_params(seed: int = 0):
  """Random parameters of TINY (numpy; no eager init: fast on CPU; shared,
  not to be changed)."""
  abstract = jax.eval_shape(lambda r: init_params(TINY, r),
                            jax.random.PRNGKey(0))
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype),
      abstract)


def tiny_run_config():
  """The base config with TINY as its model."""
  c = presets.base_config()
  c.model = ml_collections.ConfigDict(TINY.to_dict())
  return c


def imported_workdir(path, tokenizer, params=None, record_hash=True) -> str:
  """A workdir with step 0 = ``params`` (default ``tiny_params()``, as
  tools/import_pytorch.py writes) and ``tokenizer`` copied in;
  ``record_hash=False`` writes the meta of a checkpoint from before
  tokenizer hashes."""
  params = tiny_params() if params is None else params
  tok = checkpoint.tokenizer_meta(Tokenizer(tokenizer, 12)) if (
      record_hash) else None
  checkpoint.write_imported(str(path), params,
                            json.loads(tiny_run_config().to_json_best_effort()),
                            TINY.to_dict(), 'test', tokenizer=tok)
  shutil.copyfile(tokenizer, os.path.join(path, checkpoint.TOKENIZER_FILE))
  return str(path)


def assert_same_model(got, want) -> None:
  """Same parameters bit for bit, same token ids."""
  flat = lambda m: jax.tree_util.tree_flatten_with_path(m.params)[0]
  for (pa, a), (pb, b) in zip(flat(got), flat(want), strict=True):
    assert pa == pb
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  text = ['two blue birds', 'a photo of the digit seven']
  np.testing.assert_array_equal(got.tokenizer(text), want.tokenizer(text))


# ----------------------------------------------------------------------------
# The package's import graph (test_imports.py, test_import_layers.py)

PACKAGE_DIR = os.path.dirname(prolip_jax.__file__)


def _modules() -> dict[str, str]:
  """``{dotted module name: file path}`` of every module in the package."""
  out = {}
  root = os.path.dirname(PACKAGE_DIR)
  for dirpath, _, files in os.walk(PACKAGE_DIR):
    for f in files:
      if not f.endswith('.py'):
        continue
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, root)[:-3].split(os.sep)
      if rel[-1] == '__init__':
        rel = rel[:-1]
      out['.'.join(rel)] = path
  return out


def _resolve_relative(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
  parts = module.split('.')
  if not is_pkg:
    parts = parts[:-1]
  if node.level > 1:
    parts = parts[:len(parts) - (node.level - 1)]
  return '.'.join(parts + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
  """``{module: modules of the package it imports anywhere in its code}``.

  Imports inside functions count. Edges go to the most specific module an
  import names: ``from prolip_jax.losses import csd`` is an edge to
  ``prolip_jax.losses`` (``csd`` is a function), ``from prolip_jax.data
  import digits`` to ``prolip_jax.data.digits``.
  """
  modules = _modules()
  graph = {m: set() for m in modules}
  for module, path in modules.items():
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), path)
    is_pkg = path.endswith('__init__.py')
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = (_resolve_relative(node, module, is_pkg) if node.level
                else node.module or '')
        for a in node.names:
          sub = f'{base}.{a.name}'
          targets.append(sub if sub in modules else base)
      for t in targets:
        if t in modules and t != module:
          graph[module].add(t)
  return graph


def find_cycle(graph: dict[str, set[str]]):
  """One cycle as a list of modules (first == last), or None."""
  state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
  stack: list[str] = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        return stack[stack.index(n):] + [n]
      if n not in state:
        found = visit(n)
        if found:
          return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


# ----------------------------------------------------------------------------
# A workdir lock whose holder is paused past the stale limit


def lock_taken_over_while_paused(workdir, monkeypatch, lock_module):
  """Run A holds ``workdir``'s lock; its heartbeat thread is paused (its
  store requests held at a gate, as a SIGSTOP or a paused VM would hold
  them) past the stale limit; run B takes the lock over; A resumes.
  Returns (A, B, the lock's text B wrote, the lock's text a few of A's
  heartbeats later)."""
  gate = threading.Event()
  gate.set()

  def held(real):
    def call(*args, **kwargs):
      if threading.current_thread().name == 'prolip_jax-lock':
        gate.wait()
      return real(*args, **kwargs)
    return call

  monkeypatch.setattr(lock_module, '_read', held(lock_module._read))  # pylint: disable=protected-access
  monkeypatch.setattr(lock_module.paths, 'write_bytes',
                      held(lock_module.paths.write_bytes))
  monkeypatch.setattr(lock_module, 'HEARTBEAT_SECONDS', 0.05)
  monkeypatch.setattr(lock_module, 'STALE_SECONDS', 1.0)
  a = lock_module.WorkdirLock(workdir).acquire()
  time.sleep(0.3)
  a.check()  # beating: still A's
  lock = a.path
  gate.clear()  # A paused
  time.sleep(1.5)  # past the stale limit
  b = lock_module.WorkdirLock(workdir).acquire()
  taken = paths.read_text(lock)  # B's heartbeat rewrites it while we read
  gate.set()  # A continues
  time.sleep(0.5)
  return a, b, taken, paths.read_text(lock)
