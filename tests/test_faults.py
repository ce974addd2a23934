"""Faults a long run meets: kill -9, NaNs, corrupt checkpoints, a second run
on the same workdir, resuming with other settings, user mistakes.

Each test runs the real loop (``configs/prolip_micro.py``, one device) and
checks what was kept on disk against an independent run or the bytes
themselves.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from prolip_jax import errors
from prolip_jax.config import presets
from prolip_jax.evaluation import evaluator
from prolip_jax.storage import checkpoint
from prolip_jax.training import loop
from prolip_jax.training import train

from support import damage_file
from support import main_env
from support import micro_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')


def _main(*args, **kwargs):
  return subprocess.Popen([sys.executable, '-m', 'prolip_jax.main', *args],
                          cwd=REPO, env=main_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **kwargs)


def _run_main(*args, timeout=300):
  proc = _main(*args)
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def _leaves(workdir, step=None, item='params'):
  params, meta = checkpoint.load_params(workdir, step, item)
  return [np.asarray(x) for x in jax.tree.leaves(params)], meta


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------
# kill -9


def _tmp_checkpoint_writing(ckpt_dir):
  try:
    return any('tmp' in name for name in os.listdir(ckpt_dir))
  except FileNotFoundError:
    return False


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_is_bit_identical(tmp_path):
  flags = [f'--config={MICRO}', '--config.total_steps=100',
           '--config.checkpoint_every_steps=2', '--config.log_every_steps=5',
           '--config.keep_checkpoints=2']
  code, _, err = _run_main(*flags, f'--workdir={tmp_path / "ref"}')
  assert code == 0, err
  workdir = tmp_path / 'killed'
  ckpt_dir = workdir / 'checkpoints'
  rng = random.Random(0)
  kills, during_write = 0, 0
  for attempt in range(12):
    proc = _main(*flags, f'--workdir={workdir}')
    # Half the kills wait for a checkpoint being written; the others land
    # at a random moment after start-up.
    target_write = attempt % 2 == 0
    deadline = time.time() + rng.uniform(3, 10)
    killed_in_write = False
    while proc.poll() is None:
      if target_write and _tmp_checkpoint_writing(ckpt_dir):
        killed_in_write = True
        break
      if not target_write and time.time() > deadline:
        break
      time.sleep(0.002)
    if proc.poll() is not None:  # finished before we struck
      proc.communicate()
      break
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    kills += 1
    during_write += killed_in_write
    if kills >= 6 and during_write >= 2:
      break
  assert kills >= 5 and during_write >= 1, (kills, during_write)
  # The stale lock of the killed process is taken over; the run completes.
  code, _, err = _run_main(*flags, f'--workdir={workdir}')
  assert code == 0, err
  assert 'taking over the stale lock' in err or not os.path.exists(
      workdir / '.lock')
  ref, meta_ref = _leaves(str(tmp_path / 'ref'))
  got, meta = _leaves(str(workdir))
  assert meta['step'] == meta_ref['step'] == 100
  _assert_same(ref, got)


# ----------------------------------------------------------------------------
# Ctrl-C and SIGTERM: a flag the loop reads at step boundaries


class _Lines:
  """A started process's stdout lines, read as they come (a thread)."""

  def __init__(self, proc):
    self.lines: list[str] = []
    self._thread = threading.Thread(target=self._read, args=(proc,),
                                    daemon=True)
    self._thread.start()

  def _read(self, proc):
    for line in proc.stdout:
      self.lines.append(line)

  def wait_for(self, text, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
      if any(text in line for line in self.lines):
        return True
      time.sleep(0.01)
    return False

  def text(self):
    self._thread.join(timeout=30)
    return ''.join(self.lines)


def _signal_on(text, signum, *flags):
  """Starts the command, sends ``signum`` once ``text`` is printed; returns
  ``(exit status, stdout, stderr)``."""
  proc = _main(*flags)
  lines = _Lines(proc)
  assert lines.wait_for(text, proc), lines.text()
  proc.send_signal(signum)
  err = proc.stderr.read()
  proc.wait(timeout=120)
  return proc.returncode, lines.text(), err


def _rows(workdir):
  return [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]


def _train_rows(workdir):
  return [r for r in _rows(workdir) if 'loss' in r]


# SIGINTs of the random-moment test (the closing note of issue 31 records a
# run of 30: PROLIP_SIGNAL_LOOPS=30).
SIGNAL_LOOPS = int(os.environ.get('PROLIP_SIGNAL_LOOPS', '8'))


@pytest.mark.slow
@pytest.mark.parametrize('signum', [signal.SIGINT])
def test_signals_at_random_moments_save_at_the_step_boundary(tmp_path,
                                                             signum):
  """Ctrl-C at random moments (start-up, compiling, mid-step, at a logging
  or checkpoint step): every run exits 130 with one line and no traceback;
  one that trained saves the step it stopped after; the run finished after
  all of them equals an uninterrupted one bit for bit, and metrics.jsonl
  holds each logged step once, with the same numbers."""
  total = 60 * max(1, SIGNAL_LOOPS // 8)  # room for every stop to train
  flags = [f'--config={MICRO}', f'--config.total_steps={total}',
           '--config.checkpoint_every_steps=8', '--config.log_every_steps=4',
           '--config.keep_checkpoints=2']
  code, _, err = _run_main(*flags, f'--workdir={tmp_path / "ref"}')
  assert code == 0, err
  workdir = str(tmp_path / 'stopped')
  rng = random.Random(1)
  saved_mid_run = 0
  for attempt in range(SIGNAL_LOOPS):
    before = checkpoint.latest_step(workdir) if os.path.isdir(
        os.path.join(workdir, 'checkpoints')) else None
    proc = _main(*flags, f'--workdir={workdir}')
    lines = _Lines(proc)
    if attempt % 4 == 0:  # start-up: imports, tokenizer, restore
      time.sleep(rng.uniform(0.2, 4.0))
    else:  # in the loop: compiling, mid-step, a logging or checkpoint step
      lines.wait_for('Compiling the train step', proc)
      time.sleep(rng.uniform(0.0, 2.5))
    if proc.poll() is not None:  # finished first: nothing left to stop
      break
    proc.send_signal(signum)
    err = proc.stderr.read()
    proc.wait(timeout=120)
    out = lines.text()
    assert proc.returncode == errors.EXIT_INTERRUPTED, (out, err)
    assert 'Traceback' not in err and 'Exception' not in err, err
    latest = checkpoint.latest_step(workdir) if os.path.isdir(
        os.path.join(workdir, 'checkpoints')) else None
    stopped = re.search(r'Interrupted \(Ctrl-C\) at step (\d+), checkpoint '
                        r'saved', out)
    if stopped:  # saved where it stopped: the last step it printed or later
      step = int(stopped.group(1))
      assert latest == step, (latest, out)
      printed = [int(m) for m in re.findall(r'^\[(\d+)/', out, re.M)]
      assert not printed or printed[-1] <= step
      saved_mid_run += 1
    else:  # stopped before any new step: one line says so, nothing changed
      last = err.strip().splitlines()[-1]
      assert last.startswith('stopped by Ctrl-C after'), err
      assert 'nothing new to save' in last and latest == before
  assert saved_mid_run >= SIGNAL_LOOPS // 2, saved_mid_run
  code, _, err = _run_main(*flags, f'--workdir={workdir}')
  assert code == 0, err
  ref, meta_ref = _leaves(str(tmp_path / 'ref'))
  got, meta = _leaves(workdir)
  assert meta['step'] == meta_ref['step'] == total
  _assert_same(ref, got)
  # Every logged step once, with an uninterrupted run's numbers (the
  # timings aside); the final evaluation once.
  timing = ('samples_per_sec', 'time/', 'perf/', 'data/')
  strip = lambda rows: [{k: v for k, v in r.items()
                         if not k.startswith(timing)} for r in rows]
  assert strip(_train_rows(workdir)) == strip(_train_rows(tmp_path / 'ref'))
  evals = [r['step'] for r in _rows(workdir) if any(k.startswith('eval/')
                                                    for k in r)]
  assert evals == [total]


@pytest.mark.slow
def test_sigterm_while_setting_up_or_compiling_exits_75_with_its_line(
    tmp_path):
  """SIGTERM while the tokenizer is trained: 75, one line, no lock left,
  nothing saved; SIGTERM while the first step compiles: that step ends, is
  saved, 75."""
  flags = [f'--config={MICRO}', '--config.total_steps=50',
           f'--workdir={tmp_path}']
  code, _, err = _signal_on('Training a sentencepiece tokenizer',
                            signal.SIGTERM, *flags)
  assert code == errors.EXIT_PREEMPTED, err
  assert err.strip().splitlines() == [
      'stopped by SIGTERM after the tokenizer and the data pipeline, before '
      'any new step: nothing new to save; run the same command to start '
      'again'], err
  assert not os.path.exists(tmp_path / '.lock')
  assert not os.path.exists(tmp_path / 'checkpoints') or not os.listdir(
      tmp_path / 'checkpoints')

  code, out, err = _signal_on('Compiling the train step', signal.SIGTERM,
                              *flags)
  assert code == errors.EXIT_PREEMPTED, (out, err)
  assert 'Traceback' not in err, err
  step = int(re.search(r'Stopped by SIGTERM at step (\d+)', out).group(1))
  assert step >= 1 and checkpoint.latest_step(str(tmp_path)) == step
  assert not os.path.exists(tmp_path / '.lock')


# ----------------------------------------------------------------------------
# Non-finite steps


@pytest.mark.slow
def test_a_nan_step_changes_nothing_and_is_counted(tmp_path):
  cfg = micro_config(total_steps=6, debug_nan_steps=(3,),
                     checkpoint_every_steps=1, keep_checkpoints=10)
  # Stop right after the bad step (the stop writes its checkpoint), resume.
  assert train.train_and_evaluate(cfg, str(tmp_path), max_steps=3)[
      'step'] == 3
  assert train.train_and_evaluate(cfg, str(tmp_path))['step'] == 6
  rows = [json.loads(l) for l in open(tmp_path / 'metrics.jsonl')]
  by_step = {r['step']: r for r in rows if 'loss' in r}
  assert np.isnan(by_step[3]['loss']) and by_step[3]['nonfinite'] == 1
  assert [by_step[s]['nonfinite'] for s in (1, 2, 4, 5, 6)] == [0] * 5
  assert by_step[3]['nonfinite_steps'] == 1
  # Step 3 left parameters and optimizer state as step 2 had them ...
  p2, _ = _leaves(str(tmp_path), 2)
  p3, _ = _leaves(str(tmp_path), 3)
  _assert_same(p2, p3)
  with checkpoint.manager(str(tmp_path), read_only=True) as mngr:
    opt = [checkpoint.read_meta(mngr, s) for s in (2, 3)]
  assert opt[0]['checksums']['opt_state'] == opt[1]['checksums']['opt_state']
  # ... and training went on from there.
  p4, _ = _leaves(str(tmp_path), 4)
  assert any(not np.array_equal(a, b) for a, b in zip(p3, p4))
  assert all(np.isfinite(x).all() for x in p4)


@pytest.mark.slow
def test_consecutive_nan_steps_stop_the_run_and_keep_the_good_checkpoint(
    tmp_path):
  cfg = micro_config(total_steps=12, debug_nan_steps=tuple(range(4, 13)),
                     checkpoint_every_steps=2, keep_checkpoints=2,
                     max_nonfinite_steps=3)
  with pytest.raises(errors.TrainingDivergedError,
                     match=r'steps 4-6 .*last good checkpoint, step 2'):
    train.train_and_evaluate(cfg, str(tmp_path))
  # No checkpoint was written during the streak; rotation kept step 2.
  assert checkpoint.latest_step(str(tmp_path)) == 2
  leaves, _ = _leaves(str(tmp_path))
  assert all(np.isfinite(x).all() for x in leaves)
  assert not os.path.exists(tmp_path / '.lock')


@pytest.mark.slow
def test_divergence_from_the_command_line_is_one_error_line(tmp_path):
  code, out, err = _run_main(
      f'--config={MICRO}', f'--workdir={tmp_path}',
      '--config.optim.lr=1e4', '--config.total_steps=30',
      '--config.checkpoint_every_steps=2')
  assert code == errors.EXIT_USER_ERROR, err
  lines = err.strip().splitlines()
  assert lines[-1].startswith('error: training diverged'), err
  assert 'Traceback' not in err and 'Finished' not in out
  assert ' loss nan ' in out  # the progress line shows the real loss
  last = checkpoint.latest_step(str(tmp_path))
  assert last is not None and f'step {last}, is kept' in lines[-1]
  for step in (s for s in range(2, 31, 2) if s <= last):
    leaves, _ = _leaves(str(tmp_path), step)
    assert all(np.isfinite(x).all() for x in leaves)


def test_checkpoint_with_nonfinite_params_is_never_written(tmp_path):
  mngr = checkpoint.manager(str(tmp_path))
  params = {'w': jax.numpy.array([1.0, np.nan])}
  assert not checkpoint.save(mngr, 1, params, {}, {'step': 1})
  mngr.wait_until_finished()
  assert mngr.all_steps() == []


# ----------------------------------------------------------------------------
# Checkpoint integrity


def _largest_file(directory):
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


@pytest.mark.slow
@pytest.mark.parametrize('damage', ['garble', 'truncate'])
def test_unreadable_latest_checkpoint_falls_back_with_a_message(
    tmp_path, capfd, damage):
  cfg = micro_config(total_steps=6, checkpoint_every_steps=3)
  train.train_and_evaluate(cfg, str(tmp_path / 'ref'))
  shutil.copytree(tmp_path / 'ref', tmp_path / 'run')
  target = _largest_file(tmp_path / 'run' / 'checkpoints' / '6' / 'params' /
                         'ocdbt.process_0')
  damage_file(target, damage)
  capfd.readouterr()

  # prolip_jax.load (and so the export tool) fall back without moving it.
  import prolip_jax  # pylint: disable=g-import-not-at-top
  model = prolip_jax.load(str(tmp_path / 'run'))
  err = capfd.readouterr().err
  assert 'checkpoint step 6' in err and 'cannot be read' in err
  assert 'trying step 3' in err
  p3, _ = _leaves(str(tmp_path / 'ref'), 3)
  _assert_same(p3, [np.asarray(x) for x in jax.tree.leaves(model.params)])
  assert len(err.strip().splitlines()) == 1, err

  # Training resumes from step 3, sets step 6 aside (nothing deleted) and
  # ends where an undamaged run ends.
  train.train_and_evaluate(cfg, str(tmp_path / 'run'))
  err = capfd.readouterr().err
  assert 'moved to' in err and 'trying step 3' in err
  assert os.path.isdir(tmp_path / 'run' / 'checkpoints_unreadable' / '6')
  _assert_same(_leaves(str(tmp_path / 'ref'))[0],
               _leaves(str(tmp_path / 'run'))[0])


def test_checksum_is_independent_of_sharding_and_sees_one_bit():
  x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
  mesh = jax.make_mesh((len(jax.devices()),), ('d',))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('d')))
  tree = {'a': sharded, 'b': np.arange(5, dtype=np.int32)}
  digest, finite = checkpoint.checksum(tree)
  assert finite and digest == checkpoint.checksum(
      {'a': x, 'b': np.arange(5, dtype=np.int32)})[0]
  flipped = x.copy()
  flipped.view(np.uint32)[7, 3] ^= 1 << 31
  assert checkpoint.checksum({'a': flipped, 'b': tree['b']})[0] != digest
  swapped = x.copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert checkpoint.checksum({'a': swapped, 'b': tree['b']})[0] != digest


# ----------------------------------------------------------------------------
# One run per workdir; SIGTERM


@pytest.mark.slow
def test_second_run_on_a_held_workdir_is_refused_and_sigterm_exits_75(
    tmp_path):
  proc = _main(f'--config={MICRO}', f'--workdir={tmp_path}',
               '--config.total_steps=100000', '--config.log_every_steps=1')
  for _ in range(600):
    if os.path.exists(tmp_path / 'metrics.jsonl'):
      break
    time.sleep(0.1)
  holder = json.load(open(tmp_path / '.lock'))
  assert holder['pid'] == proc.pid
  with pytest.raises(errors.WorkdirLockedError, match=f'pid {proc.pid}'):
    train.train_and_evaluate(micro_config(), str(tmp_path))
  code, _, err = _run_main(f'--config={MICRO}', f'--workdir={tmp_path}')
  assert code == 2 and err.strip().startswith('error: workdir') and (
      len(err.strip().splitlines()) == 1), err
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == errors.EXIT_PREEMPTED, err
  assert 'Stopped by SIGTERM at step' in out and 'Finished' not in out
  assert checkpoint.latest_step(str(tmp_path)) is not None
  assert not os.path.exists(tmp_path / '.lock')


@pytest.mark.slow
def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capfd):
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  import socket  # pylint: disable=g-import-not-at-top
  with open(tmp_path / '.lock', 'w') as f:
    json.dump({'host': socket.gethostname(), 'pid': dead.pid}, f)
  train.train_and_evaluate(micro_config(total_steps=1), str(tmp_path))
  assert f'stale lock {tmp_path / ".lock"} of pid {dead.pid}' in (
      capfd.readouterr().err)


# ----------------------------------------------------------------------------
# Config drift, re-runs


@pytest.mark.slow
def test_resume_with_changed_shapes_is_refused_other_changes_apply(
    tmp_path, capfd):
  train.train_and_evaluate(micro_config(total_steps=3), str(tmp_path))
  changed = micro_config(total_steps=3, **{'model.embed_dim': 24, 'seed': 5})
  with pytest.raises(errors.ConfigDriftError) as info:
    train.train_and_evaluate(changed, str(tmp_path))
  assert 'model.embed_dim: 16 -> 24' in str(info.value)
  assert 'seed: 0 -> 5' in str(info.value)
  capfd.readouterr()
  train.train_and_evaluate(
      micro_config(total_steps=4, **{'optim.lr': 1e-3}), str(tmp_path))
  out = capfd.readouterr().out
  assert 'optim.lr: 0.0005 -> 0.001' in out and 'total_steps: 3 -> 4' in out
  assert checkpoint.latest_step(str(tmp_path)) == 4


@pytest.mark.slow
def test_rerunning_a_finished_run_adds_no_rows(tmp_path):
  cfg = micro_config(total_steps=2)
  train.train_and_evaluate(cfg, str(tmp_path))
  before = open(tmp_path / 'metrics.jsonl').read()
  summary = train.train_and_evaluate(cfg, str(tmp_path))
  assert open(tmp_path / 'metrics.jsonl').read() == before
  assert summary['eval']  # still reported


# ----------------------------------------------------------------------------
# User errors: one line, status 2


@pytest.mark.parametrize('args,expected', [
    (['--config.batchsize=3'],
     "unknown config key 'batchsize' (did you mean 'batch_size'?)"),
    (['--config=/nonexistent/config.py'], 'config file'),
    (['--config.objective=prolp'], "unknown objective 'prolp' (did you mean "
                                   "'prolip'?)"),
    (['--config.model.vision.patch_size=7'], 'multiple of'),
    (['--config.batch_size=abc'], 'batch_size'),
])
@pytest.mark.slow
def test_user_errors_are_one_line_with_status_2(tmp_path, args, expected):
  code, out, err = _run_main(f'--config={MICRO}', *args,
                             f'--workdir={tmp_path / "w"}')
  assert code == errors.EXIT_USER_ERROR, (out, err)
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), err
  assert expected in lines[0], lines[0]
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints')


@pytest.mark.slow
def test_help_and_print_config():
  code, out, _ = _run_main('--help')
  assert code == 0 and '--print_config' in out and '--config.KEY' in out
  code, out, _ = _run_main(f'--config={MICRO}', '--print_config',
                           '--config.total_steps=7')
  assert code == 0
  lines = out.splitlines()
  assert 'total_steps = 7' in out
  assert any(l.startswith('optim.lr = ') and '# peak learning rate' in l
             for l in lines)
  flat = presets.load_config_file(MICRO)
  from prolip_jax.config import help as config_help  # pylint: disable=g-import-not-at-top
  assert len(lines) == len(config_help.flatten(flat))


# ----------------------------------------------------------------------------
# A clean first run


@pytest.mark.slow
def test_load_is_quiet_and_summary_is_labelled(tmp_path, capfd):
  cfg = micro_config(total_steps=2)
  train.train_and_evaluate(cfg, str(tmp_path))
  out = capfd.readouterr().out
  assert 'Held-out digits (1,000 images never trained on)' in out
  assert 'zero-shot top-1, CSD' in out and 'per dimension' in out
  assert out.index('zero-shot top-1') < out.index('retrieval')
  assert out.rstrip().splitlines()[-3].startswith('Checkpoint: ')
  assert 'python -m prolip_jax.evaluate' in out.splitlines()[-2]
  import prolip_jax  # pylint: disable=g-import-not-at-top
  prolip_jax.load(str(tmp_path))
  captured = capfd.readouterr()
  assert captured.err == '' and captured.out == ''


@pytest.mark.slow
def test_export_paths_stay_inside_the_export_directory(tmp_path):
  import prolip_jax  # pylint: disable=g-import-not-at-top
  train.train_and_evaluate(micro_config(total_steps=1), str(tmp_path / 'w'))
  spec = __import__('importlib.util').util.spec_from_file_location(
      'export_pytorch', os.path.join(REPO, 'tools', 'export_pytorch.py'))
  tool = __import__('importlib.util').util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  out = tmp_path / 'export'
  tool.export(str(tmp_path / 'w'), str(out))
  prolip_jax.load(str(out))  # as exported: fine
  # A hand-edited export: without its manifest (which would refuse any edit
  # of config.json) the paths inside config.json are checked on their own.
  (out / 'prolip_jax_manifest.json').unlink()
  cfg = json.load(open(out / 'config.json'))
  for name in ('../w/tokenizer.model', str(tmp_path / 'w' / 'tokenizer.model')):
    cfg['prolip_jax']['tokenizer_file'] = name
    json.dump(cfg, open(out / 'config.json', 'w'))
    with pytest.raises(errors.CheckpointError, match='outside'):
      prolip_jax.load(str(out))
  (out / 'config.json').write_text('{"model_cfg": ')
  with pytest.raises(errors.CheckpointError, match='config.json'):
    prolip_jax.load(str(out))


# ----------------------------------------------------------------------------
# A changed setting on resume never costs a checkpoint


def _tree_digest(directory):
  """``{relative path: bytes}`` of every file under ``directory``."""
  out = {}
  for d, _, files in os.walk(directory):
    for f in files:
      path = os.path.join(d, f)
      with open(path, 'rb') as fh:
        out[os.path.relpath(path, directory)] = fh.read()
  return out


def _one_error_line(err):
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), err
  return lines[0]


@pytest.mark.slow
def test_drift_scenario_from_the_command_line_keeps_the_checkpoints(tmp_path):
  """The issue's scenario: train 20 steps, resume with
  --config.optim.grad_clip=1.0 (refused in one line, nothing touched), then
  the original command continues from step 20."""
  flags = [f'--config={MICRO}', f'--workdir={tmp_path}',
           '--config.total_steps=20', '--config.checkpoint_every_steps=10',
           '--config.log_every_steps=5']
  code, out, err = _run_main(*flags)
  assert code == 0, err
  # A status line before each slow phase, in the order they happen.
  order = ['Training a sentencepiece tokenizer on ', 'prolip_jax: prolip on',
           'Compiling the train step', 'Compiled and ran step 1 in',
           '[5/20]', 'Evaluator eval at step 20',
           'Finished at step 20']
  positions = [out.find(text) for text in order]
  assert -1 not in positions and positions == sorted(positions), out
  before = _tree_digest(tmp_path / 'checkpoints')
  assert {k.split(os.sep)[0] for k in before} == {'10', '20'}
  code, out, err = _run_main(*flags, '--config.optim.grad_clip=1.0')
  assert code == errors.EXIT_USER_ERROR, (out, err)
  line = _one_error_line(err)
  assert 'optim.grad_clip: 0.0 -> 1.0' in line and 'optimizer-state' in line
  assert _tree_digest(tmp_path / 'checkpoints') == before
  assert not os.path.exists(tmp_path / 'checkpoints_unreadable')
  code, out, err = _run_main(*flags)  # the original command
  assert code == 0, err
  assert 'steps 20 -> 20 of 20' in out
  code, out, err = _run_main(*flags[:2], '--config.total_steps=25',
                             '--config.checkpoint_every_steps=10',
                             '--config.log_every_steps=5')
  assert code == 0, err
  assert 'steps 20 -> 25 of 25' in out and 'total_steps: 20 -> 25' in out
  assert 'Training a sentencepiece tokenizer' not in out  # the workdir's own
  assert not os.path.exists(tmp_path / 'checkpoints_unreadable')
  after = _tree_digest(tmp_path / 'checkpoints')
  assert {k: v for k, v in after.items() if k.startswith('20' + os.sep)} == {
      k: v for k, v in before.items() if k.startswith('20' + os.sep)}
  steps = [json.loads(l)['step'] for l in open(tmp_path / 'metrics.jsonl')
           if 'loss' in json.loads(l)]
  assert steps == [5, 10, 15, 20, 25]


OPTIM_CHANGES = {
    'optim.lr': 1e-3, 'optim.b1': 0.8, 'optim.b2': 0.9, 'optim.eps': 1e-7,
    'optim.weight_decay': 0.0, 'optim.warmup_steps': 1,
    'optim.end_lr_ratio': 0.1, 'optim.grad_clip': 1.0,
    'optim.max_logit_scale': 50.0, 'optim.unc_lr_mult': 10.0,
    'optim.ema_decay': 0.5,  # turned on: starts from the restored params
    'optim.freeze': ('visual/.*',),
}


def _step_counts(workdir, step):
  """The integer step counters (Adam's, the schedule's) in the optimizer
  state of one checkpoint, read as its own metadata describes it."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with checkpoint.manager(workdir, read_only=True) as mngr:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
        mngr.item_metadata(step)['opt_state'])
    opt = mngr.restore(step, args=ocp.args.Composite(
        opt_state=ocp.args.StandardRestore(target)))['opt_state']
  return {int(np.asarray(x)) for x in jax.tree.leaves(opt)
          if np.asarray(x).dtype == np.int32 and np.ndim(x) == 0}


@pytest.mark.slow
def test_each_optimizer_key_on_resume_resumes_or_refuses(tmp_path):
  """Every optim.* key changed on resume: the run either resumes from the
  newest step with its optimizer state restored, or refuses in one line;
  it never sets a checkpoint aside."""
  from prolip_jax.config import keys as config_keys  # pylint: disable=g-import-not-at-top
  assert set(OPTIM_CHANGES) == {k for k in config_keys.KEYS
                                if k.startswith('optim.')}
  workdir = str(tmp_path)
  train.train_and_evaluate(micro_config(total_steps=40), workdir,
                           max_steps=2)
  step = 2
  for key, value in OPTIM_CHANGES.items():
    before = _tree_digest(tmp_path / 'checkpoints')
    cfg = micro_config(total_steps=40, **{key: value})
    try:
      summary = train.train_and_evaluate(cfg, workdir, max_steps=1)
    except errors.ConfigDriftError as e:
      assert '\n' not in str(e) and f'{key}: ' in str(e), str(e)
      assert _tree_digest(tmp_path / 'checkpoints') == before, key
      assert config_keys.KEYS[key].fixed, key
    else:
      assert not config_keys.KEYS[key].fixed, key
      assert summary['step'] == step + 1, key
      # Adam's count went on from the restored state (a fresh one is 1).
      assert _step_counts(workdir, step + 1) == {step + 1}, key
      step += 1
    assert not os.path.exists(tmp_path / 'checkpoints_unreadable'), key
  assert step == 2 + sum(not config_keys.KEYS[k].fixed for k in OPTIM_CHANGES)


@pytest.mark.slow
def test_a_checkpoint_of_another_tree_is_refused_not_set_aside(
    tmp_path, monkeypatch):
  """The restore itself cannot destroy: with the drift rule for
  optim.grad_clip switched off, the optimizer-state tree no longer fits,
  and the run stops naming the setting instead of setting steps aside."""
  from prolip_jax.config import keys as config_keys  # pylint: disable=g-import-not-at-top
  train.train_and_evaluate(micro_config(total_steps=4,
                                        checkpoint_every_steps=2),
                           str(tmp_path))
  before = _tree_digest(tmp_path / 'checkpoints')
  monkeypatch.setitem(config_keys.KEYS, 'optim.grad_clip',
                      config_keys.Key(0.0, 'clip (test: declared free)'))
  with pytest.raises(errors.ConfigDriftError) as info:
    train.train_and_evaluate(
        micro_config(total_steps=4, **{'optim.grad_clip': 1.0}),
        str(tmp_path))
  text = str(info.value)
  assert 'readable but does not fit' in text and '\n' not in text
  assert 'optim.grad_clip: 0.0 -> 1.0' in text and 'opt_state' in text
  assert _tree_digest(tmp_path / 'checkpoints') == before
  assert not os.path.exists(tmp_path / 'checkpoints_unreadable')


def _meta_file(workdir, step):
  meta_dir = os.path.join(workdir, 'checkpoints', str(step), 'meta')
  for name in os.listdir(meta_dir):
    path = os.path.join(meta_dir, name)
    try:
      if 'config' in json.load(open(path)):
        return path
    except (ValueError, UnicodeDecodeError, IsADirectoryError):
      continue
  raise AssertionError(f'no meta JSON under {meta_dir}')


@pytest.mark.slow
def test_an_embed_dim_edited_into_the_saved_config_is_refused_untouched(
    tmp_path):
  """The issue's second case: the newest checkpoint's stored config says
  model.embed_dim=24 (edited), its arrays are 16 wide; resuming with 24 is
  refused in one line, and no step is set aside."""
  train.train_and_evaluate(micro_config(total_steps=4,
                                        checkpoint_every_steps=2),
                           str(tmp_path))
  path = _meta_file(str(tmp_path), 4)
  meta = json.load(open(path))
  meta['config']['model']['embed_dim'] = 24
  json.dump(meta, open(path, 'w'))
  before = _tree_digest(tmp_path / 'checkpoints')
  with pytest.raises(errors.ConfigDriftError) as info:
    train.train_and_evaluate(micro_config(total_steps=6,
                                          **{'model.embed_dim': 24}),
                             str(tmp_path))
  text = str(info.value)
  assert 'step 4' in text and 'does not fit' in text and '\n' not in text
  assert '(16,' in text or ', 16)' in text, text
  assert _tree_digest(tmp_path / 'checkpoints') == before
  assert not os.path.exists(tmp_path / 'checkpoints_unreadable')
  # The settings the checkpoint's arrays were trained with still resume.
  meta['config']['model']['embed_dim'] = 16
  json.dump(meta, open(path, 'w'))
  assert train.train_and_evaluate(micro_config(total_steps=5),
                                  str(tmp_path))['step'] == 5


@pytest.mark.slow
def test_set_aside_steps_are_not_trained_over_without_being_asked(
    tmp_path, capfd):
  train.train_and_evaluate(micro_config(total_steps=3), str(tmp_path))
  os.makedirs(tmp_path / 'checkpoints_unreadable')
  for name in os.listdir(tmp_path / 'checkpoints'):
    shutil.move(str(tmp_path / 'checkpoints' / name),
                str(tmp_path / 'checkpoints_unreadable' / name))
  aside = _tree_digest(tmp_path / 'checkpoints_unreadable')
  with pytest.raises(errors.CheckpointError, match='--allow_fresh_start'):
    train.train_and_evaluate(micro_config(total_steps=3), str(tmp_path))
  code, _, err = _run_main(f'--config={MICRO}', f'--workdir={tmp_path}',
                           '--config.total_steps=3')
  assert code == errors.EXIT_USER_ERROR
  assert 'checkpoints_unreadable' in _one_error_line(err)
  assert checkpoint.latest_step(str(tmp_path)) is None
  assert _tree_digest(tmp_path / 'checkpoints_unreadable') == aside
  capfd.readouterr()
  summary = train.train_and_evaluate(micro_config(total_steps=3),
                                     str(tmp_path), allow_fresh_start=True)
  assert summary['step'] == 3 and 'steps 0 -> 3' in capfd.readouterr().out
  assert _tree_digest(tmp_path / 'checkpoints_unreadable') == aside


# ----------------------------------------------------------------------------
# metrics.jsonl: every step once


@pytest.mark.slow
def test_resume_drops_rows_after_the_checkpoint_and_a_cut_line(tmp_path,
                                                             capfd):
  """A kill after step 6 was logged but before it was checkpointed, in the
  middle of writing a row: after resuming, every step appears once, and the
  re-logged steps match an uninterrupted run."""
  cfg = micro_config(total_steps=6, checkpoint_every_steps=3)
  train.train_and_evaluate(cfg, str(tmp_path / 'ref'))
  shutil.copytree(tmp_path / 'ref', tmp_path / 'run')
  shutil.rmtree(tmp_path / 'run' / 'checkpoints' / '6')  # never written
  metrics = tmp_path / 'run' / 'metrics.jsonl'
  text = metrics.read_text()
  metrics.write_text(text + text.splitlines()[-1][:25])  # cut mid-row
  capfd.readouterr()
  train.train_and_evaluate(cfg, str(tmp_path / 'run'))
  rows = [json.loads(l) for l in metrics.read_text().splitlines()]
  ref = [json.loads(l) for l in (tmp_path / 'ref' / 'metrics.jsonl')
         .read_text().splitlines()]
  beyond = sum(r['step'] > 3 for r in ref)  # the loss rows 4-6, the eval row
  assert (f'dropped {beyond} row(s) logged after step 3, which is trained '
          'again and 1 incomplete line') in capfd.readouterr().err
  assert [r['step'] for r in rows] == [r['step'] for r in ref]
  # The step-time fields are measurements: the first row after a (re)start
  # has none (its interval is the compiling step), so they are left out.
  measured = ('time/', 'perf/')
  assert ([sorted(k for k in r if not k.startswith(measured)) for r in rows]
          == [sorted(k for k in r if not k.startswith(measured))
              for r in ref])
  assert [r['step'] for r in rows if 'loss' in r] == [1, 2, 3, 4, 5, 6]
  by_step = {r['step']: r for r in ref if 'loss' in r}
  for r in rows:
    if 'loss' in r:
      assert r['loss'] == by_step[r['step']]['loss'], r['step']


@pytest.mark.slow
def test_lowering_keep_checkpoints_says_what_it_deletes_and_keeps_the_newest(
    tmp_path, capfd):
  cfg = micro_config(total_steps=6, checkpoint_every_steps=2,
                     keep_checkpoints=3)
  train.train_and_evaluate(cfg, str(tmp_path))
  ckpts = tmp_path / 'checkpoints'
  assert sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) == [2, 4, 6]
  capfd.readouterr()
  cfg.total_steps, cfg.keep_checkpoints = 7, 1
  summary = train.train_and_evaluate(cfg, str(tmp_path))
  out = capfd.readouterr().out
  assert ('note: keep_checkpoints=1 deletes the checkpoints older than the '
          'newest keep_checkpoints: checkpoint(s) of step 2, 4, 6 will be '
          'deleted once the next checkpoint is saved') in out, out
  assert sorted(n for n in os.listdir(ckpts) if n.isdigit()) == ['7']
  assert summary['checkpoint'] == str(ckpts / '7')
  assert checkpoint.latest_step(str(tmp_path)) == 7


def _with_evaluator(cfg, every_steps):
  """``cfg`` with a zero-shot evaluator next to its held-out one."""
  evals = cfg.evals.to_dict()
  assert set(evals) == {'eval'}  # the held-out evaluation
  evals['zs'] = {'kind': 'zero_shot', 'data': 'digits:heldout',
                 'every_steps': every_steps, 'batch_size': 250}
  cfg.evals = evals
  return cfg


def _steps_with(rows, prefix):
  return [r['step'] for r in rows if any(k.startswith(prefix) for k in r)]


@pytest.mark.slow
def test_an_evaluation_cut_short_runs_again_on_resume(tmp_path, monkeypatch,
                                                      capfd):
  """A kill during the evaluations of step 4, after its checkpoint (the
  held-out one done, the zero-shot one under way): the resumed run (from
  step 4) runs them first; every row appears once."""
  cfg = _with_evaluator(micro_config(total_steps=8, checkpoint_every_steps=4,
                                     log_every_steps=2), every_steps=4)
  cfg.evals.eval.every_steps = 4
  ran = []
  real_run = evaluator.Evaluator.run

  def run(self, *args, **kwargs):
    ran.append(self.name)
    return real_run(self, *args, **kwargs)

  def killed(self, params):
    del self, params
    raise RuntimeError('killed mid-evaluation')
  monkeypatch.setattr(evaluator.Evaluator, 'run', run)
  monkeypatch.setattr(evaluator.kind_class('zero_shot'), 'evaluate', killed)
  with pytest.raises(RuntimeError, match='killed mid-evaluation'):
    train.train_and_evaluate(cfg, str(tmp_path))
  assert ran == ['eval', 'zs']  # the held-out one done, then the kill
  assert checkpoint.latest_step(str(tmp_path)) == 4
  assert _steps_with(_rows(tmp_path), 'zs/') == []
  monkeypatch.undo()
  train.train_and_evaluate(cfg, str(tmp_path))
  rows = _rows(tmp_path)
  assert [r['step'] for r in rows if 'loss' in r] == [2, 4, 6, 8]
  assert _steps_with(rows, 'eval/') == [4, 8]
  assert _steps_with(rows, 'zs/') == [4, 8]
  # The periodic held-out evaluation prints its figures, those of its row.
  row = next(r for r in rows if r['step'] == 4 and 'eval/zeroshot_csd_top1'
             in r)
  assert (f"Held-out digits at step 4: top-1 CSD "
          f"{100 * row['eval/zeroshot_csd_top1']:.1f}%, cosine "
          f"{100 * row['eval/zeroshot_cosine_top1']:.1f}%"
          in capfd.readouterr().out)


@pytest.mark.slow
def test_sigterm_in_the_last_step_leaves_the_final_evaluations_to_the_rerun(
    tmp_path, monkeypatch, capfd):
  """A real SIGTERM during the last step: the run saves it and exits without
  evaluating; the same command again trains nothing and writes the final
  held-out row and the configured evaluator once; a third run adds
  nothing."""
  cfg = _with_evaluator(micro_config(total_steps=4), every_steps=0)
  real = loop._injected_fault  # pylint: disable=protected-access

  def sigterm_at_the_end(config, step):
    if step == config.total_steps:
      os.kill(os.getpid(), signal.SIGTERM)
    return real(config, step)
  monkeypatch.setattr(loop, '_injected_fault', sigterm_at_the_end)
  summary = train.train_and_evaluate(cfg, str(tmp_path))
  assert summary['preempted'] and summary['step'] == 4
  assert 'Stopped by SIGTERM at step 4' in capfd.readouterr().out
  assert checkpoint.latest_step(str(tmp_path)) == 4
  assert _steps_with(_rows(tmp_path), 'eval/') == []
  monkeypatch.undo()
  summary = train.train_and_evaluate(cfg, str(tmp_path))
  assert not summary['preempted'] and summary['evals']
  rows = _rows(tmp_path)
  assert _steps_with(rows, 'eval/') == [4] and _steps_with(rows, 'zs/') == [4]
  train.train_and_evaluate(cfg, str(tmp_path))
  assert _rows(tmp_path) == rows


def test_truncate_metrics_keeps_rows_up_to_the_step(tmp_path):
  from prolip_jax.training import progress  # pylint: disable=g-import-not-at-top
  path = tmp_path / 'metrics.jsonl'
  rows = [json.dumps({'step': s, 'loss': s / 10}) for s in range(1, 6)]
  path.write_text('\n'.join(rows) + '\n' + rows[-1][:7])
  note = progress.truncate_metrics(str(path), 3)
  assert 'dropped 2 row(s)' in note and '1 incomplete line' in note
  assert path.read_text() == '\n'.join(rows[:3]) + '\n'
  assert progress.truncate_metrics(str(path), 3) is None  # nothing to do
  # Only the chief touches the file.
  path.write_text('\n'.join(rows) + '\n')
  progress.MetricWriter(str(tmp_path), enabled=False, resume_step=1)
  assert path.read_text() == '\n'.join(rows) + '\n'
  progress.MetricWriter(str(tmp_path), enabled=True, resume_step=1).close()
  assert path.read_text() == rows[0] + '\n'
