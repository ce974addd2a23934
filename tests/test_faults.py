"""Faults a long run meets: kill -9, NaNs, corrupt checkpoints, a second run
on the same workdir, resuming with other settings, user mistakes.

Each test runs the real loop (``configs/prolip_micro.py``, one device) and
checks what was kept on disk against an independent run or the bytes
themselves.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from prolip_jax import checkpoint
from prolip_jax import errors
from prolip_jax import presets
from prolip_jax import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')


def micro_config(total_steps=6, **overrides):
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


def _env():
  env = dict(os.environ)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _main(*args, **kwargs):
  return subprocess.Popen([sys.executable, '-m', 'prolip_jax.main', *args],
                          cwd=REPO, env=_env(), stdout=subprocess.PIPE,
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
  flags = [f'--config={MICRO}', '--config.total_steps=40',
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
    deadline = time.time() + 8 + rng.uniform(0, 6)
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
  assert meta['step'] == meta_ref['step'] == 40
  _assert_same(ref, got)


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
  data = bytearray(open(target, 'rb').read())
  if damage == 'garble':  # same size: only the checksum can tell
    for i in range(len(data) // 2, len(data) // 2 + 16):
      data[i] ^= 0xFF
  else:
    data = data[:len(data) // 3]
  open(target, 'wb').write(bytes(data))
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
  from prolip_jax import config_help  # pylint: disable=g-import-not-at-top
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
  cfg = json.load(open(out / 'config.json'))
  for name in ('../w/tokenizer.model', str(tmp_path / 'w' / 'tokenizer.model')):
    cfg['prolip_jax']['tokenizer_file'] = name
    json.dump(cfg, open(out / 'config.json', 'w'))
    with pytest.raises(errors.CheckpointError, match='outside'):
      prolip_jax.load(str(out))
  (out / 'config.json').write_text('{"model_cfg": ')
  with pytest.raises(errors.CheckpointError, match='config.json'):
    prolip_jax.load(str(out))
