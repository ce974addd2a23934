"""Resume rules without training: config drift, the workdir lock and the
fallback from an unreadable checkpoint.

The fast twins of ``test_faults.py``'s end-to-end resume tests (slow: they
train): ``config_drift.check`` on a stored and a requested config,
``WorkdirLock`` against live, dead and foreign holders, and
``checkpoint.load_params`` on checkpoints written directly.
"""

import json
import os
import signal
import socket

import ml_collections
import numpy as np
import pytest

from prolip_jax import errors
from prolip_jax.config import drift as config_drift
from prolip_jax.config import presets
from prolip_jax.storage import checkpoint
from prolip_jax.training import progress
from prolip_jax.training import signals
from prolip_jax.training import workdir_lock
from prolip_jax.training.workdir_lock import WorkdirLock

# The same damage as test_faults.py's end-to-end tests.
from support import damage_file
from support import lock_taken_over_while_paused

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')


def _stored():
  """The config as a checkpoint stores it: JSON (tuples become lists)."""
  return json.loads(presets.load_config_file(MICRO).to_json_best_effort())


def test_same_config_from_json_is_no_drift():
  # Tuples read back from JSON as lists are not a change.
  assert config_drift.diff(_stored(), presets.load_config_file(MICRO)) == {}
  assert config_drift.check(_stored(), presets.load_config_file(MICRO),
                            3) == []


def test_shape_and_data_changes_are_refused_with_every_key():
  requested = presets.load_config_file(MICRO)
  requested.model.embed_dim = 24
  requested.seed = 5
  requested.optim.lr = 1e-3  # allowed, but not reported while refusing
  with pytest.raises(errors.ConfigDriftError) as info:
    config_drift.check(_stored(), requested, 3)
  message = str(info.value)
  assert 'step 3' in message
  assert 'model.embed_dim: 16 -> 24' in message and 'seed: 0 -> 5' in message
  assert 'optim.lr' not in message
  assert isinstance(info.value, errors.UserError)


def test_other_changes_are_listed_and_applied():
  stored = _stored()
  requested = presets.load_config_file(MICRO)
  requested.optim.lr = 1e-3
  requested.total_steps = 9
  assert config_drift.check(stored, requested, 3) == [
      f"optim.lr: {stored['optim']['lr']!r} -> 0.001",
      f"total_steps: {stored['total_steps']!r} -> 9"]


def test_fixed_keys_by_prefix():
  # Fixed-ness as declared in config_keys.KEYS, spot-checked by hand.
  for key in ('model.vision.width', 'tokenizer.vocab_size', 'batch_size',
              'seed', 'objective', 'data.name', 'data.crop_scale',
              'uniclip.aug_features', 'optim.unc_lr_mult'):
    assert config_drift.is_fixed(key), key
  for key in ('optim.lr', 'total_steps', 'evals.eval.every_steps',
              'mesh.fsdp', 'data.num_threads', 'log_every_steps'):
    assert not config_drift.is_fixed(key), key
  # An undeclared key the requested config adds is refused.
  requested = ml_collections.ConfigDict({'seed': 0, 'model': {'new': 1}})
  with pytest.raises(errors.ConfigDriftError, match="model.new: '<absent>'"):
    config_drift.check({'seed': 0, 'model': {}}, requested, 1)


def _dead_pid() -> int:
  """A pid no process has now (counting down from the largest)."""
  for pid in range(2**22 - 1, 2**21, -1):
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return pid
    except PermissionError:
      pass
  raise RuntimeError('no free pid')


def _write_lock(workdir, **holder):
  with open(os.path.join(workdir, '.lock'), 'w') as f:
    json.dump(holder, f)


def test_lock_is_exclusive_and_released(tmp_path):
  with WorkdirLock(str(tmp_path)):
    with open(tmp_path / '.lock') as f:
      assert json.load(f)['pid'] == os.getpid()
    with pytest.raises(errors.WorkdirLockedError,
                       match=f'in use by pid {os.getpid()}'):
      WorkdirLock(str(tmp_path)).acquire()
  assert not os.path.exists(tmp_path / '.lock')


def test_stale_lock_is_taken_over_foreign_host_is_not(tmp_path, capfd):
  dead = _dead_pid()
  _write_lock(str(tmp_path), host=socket.gethostname(), pid=dead)
  with WorkdirLock(str(tmp_path)):
    pass
  assert f'stale lock {tmp_path / ".lock"} of pid {dead}' in (
      capfd.readouterr().err)
  # Another host's pid cannot be checked from here: never taken over.
  _write_lock(str(tmp_path), host=socket.gethostname() + '-other',
              pid=dead)
  with pytest.raises(errors.WorkdirLockedError, match='-other'):
    WorkdirLock(str(tmp_path)).acquire()


def test_a_holder_paused_past_the_stale_limit_loses_its_lock(
    tmp_path, monkeypatch, capfd):
  """A paused, B takes over, A resumes: A's heartbeat leaves B's lock as
  it is, A's next step boundary stops it with one line, A's release leaves
  B's lock and B's release removes it (issue 45, finding 4)."""
  a, b, taken, later = lock_taken_over_while_paused(
      str(tmp_path), monkeypatch, workdir_lock)
  assert 'taking over the stale lock' in capfd.readouterr().err
  token = lambda text: json.loads(text).get('token', 'none')
  assert token(later) == token(taken) != 'none'  # A wrote nothing over it
  with pytest.raises(errors.WorkdirLockedError) as lost:
    a.check()
  assert str(lost.value).startswith(
      f'this run lost the workdir lock {tmp_path / ".lock"}: pid '
      f'{os.getpid()} on {socket.gethostname()} holds it now (this run sent '
      'no heartbeat for '), lost.value
  assert 'stopped without saving' in str(lost.value)
  a.release()
  assert token((tmp_path / '.lock').read_text()) == token(taken)
  b.release()
  assert not os.path.exists(tmp_path / '.lock')


def test_a_live_holder_is_named_with_its_heartbeat_age_and_takeover_time(
    tmp_path, monkeypatch):
  """The refusal says how old the holder's heartbeat is and when the lock
  is taken over automatically; a holder without ``started`` is not shown
  as ``(since None)`` (issue 45, finding 18)."""
  now = 1_000_000.0
  monkeypatch.setattr(workdir_lock.time, 'time', lambda: now)
  _write_lock(str(tmp_path), host='other-vm', pid=7, heartbeat=now - 90)
  with pytest.raises(errors.WorkdirLockedError) as held:
    WorkdirLock(str(tmp_path)).acquire()
  assert str(held.value) == (
      f'workdir {tmp_path} is in use by pid 7 on other-vm; last heartbeat '
      '90 s ago; it is taken over automatically if its heartbeat stops for '
      '600 s (in 510 s at the earliest); wait for it to finish, or delete '
      f'{tmp_path / ".lock"} if that run is gone')
  _write_lock(str(tmp_path), host='other-vm', pid=7, heartbeat=now,
              started='2025-01-02 03:04:05')
  with pytest.raises(errors.WorkdirLockedError,
                     match=r'pid 7 on other-vm \(since 2025-01-02 03:04:05\); '
                     r'last heartbeat 0 s ago; .* \(in 600 s at the earliest'):
    WorkdirLock(str(tmp_path)).acquire()


@pytest.mark.parametrize('damage', ['garble', 'truncate'])
def test_unreadable_newest_checkpoint_falls_back_to_the_previous(
    tmp_path, capfd, damage):
  """Checkpoints written directly (no training); the newest damaged on disk
  as ``test_faults.py`` does after a real run: reading falls back one step
  with one line saying why, and returns that step's exact arrays."""
  rng = np.random.default_rng(0)
  saved = {s: {'w': rng.normal(size=(64, 32)).astype(np.float32),
               'b': rng.normal(size=(32,)).astype(np.float32)}
           for s in (3, 6)}
  with checkpoint.manager(str(tmp_path)) as mngr:
    for step, params in saved.items():
      assert checkpoint.save(mngr, step, params, {'n': np.zeros(1)},
                             {'step': step}, force=True)
      mngr.wait_until_finished()
  files = [os.path.join(d, f) for d, _, fs in os.walk(
      tmp_path / 'checkpoints' / '6' / 'params') for f in fs]
  target = max(files, key=os.path.getsize)
  damage_file(target, damage)
  capfd.readouterr()
  params, meta = checkpoint.load_params(str(tmp_path))
  err = capfd.readouterr().err
  assert meta['step'] == 3
  assert 'checkpoint step 6' in err and 'cannot be read' in err
  assert 'trying step 3' in err and len(err.strip().splitlines()) == 1, err
  for key, value in saved[3].items():
    np.testing.assert_array_equal(np.asarray(params[key]), value)


def test_a_checkpoint_of_another_tree_is_refused_not_set_aside(tmp_path):
  """Checkpoints written directly; restoring them onto targets of another
  shape (what an edited ``model.embed_dim`` asks for) or another
  optimizer-state structure (``optim.grad_clip`` > 0 adds a clip state)
  raises ``TreeMismatchError`` and moves nothing, while restoring onto the
  right targets returns the exact arrays."""
  import jax  # pylint: disable=g-import-not-at-top
  params = {'w': np.arange(12, dtype=np.float32).reshape(4, 3)}
  opt_state = {'mu': np.ones((4, 3), np.float32)}
  with checkpoint.manager(str(tmp_path)) as mngr:
    assert checkpoint.save(mngr, 5, params, opt_state, {'step': 5},
                           force=True)
    mngr.wait_until_finished()
  listing = sorted(os.listdir(tmp_path / 'checkpoints' / '5'))
  shape = lambda t: jax.tree.map(  # pylint: disable=g-long-lambda
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  wrong = [({'w': jax.ShapeDtypeStruct((4, 2), np.float32)}, shape(opt_state)),
           (shape(params), {'mu': shape(opt_state)['mu'],
                            'clip': jax.ShapeDtypeStruct((), np.float32)})]
  for abstract_params, abstract_opt in wrong:
    with checkpoint.manager(str(tmp_path)) as mngr:
      with pytest.raises(checkpoint.TreeMismatchError):
        checkpoint.restore_newest(mngr, abstract_params, abstract_opt,
                                  set_aside=True)
    assert not os.path.exists(tmp_path / checkpoint.UNREADABLE_DIR)
    assert sorted(os.listdir(tmp_path / 'checkpoints' / '5')) == listing
  with checkpoint.manager(str(tmp_path)) as mngr:
    step, (got, got_opt, _, _) = checkpoint.restore_newest(
        mngr, shape(params), shape(opt_state), set_aside=True)
  assert step == 5
  np.testing.assert_array_equal(np.asarray(got['w']), params['w'])
  np.testing.assert_array_equal(np.asarray(got_opt['mu']), opt_state['mu'])


def test_saving_leaves_the_preemption_sync_counter_to_the_loop(
    tmp_path, monkeypatch):
  """Orbax asks JAX's preemption sync manager about the checkpoint's step
  when a save starts and again in its finalize thread; each ask moves the
  manager's call counter, which ``progress.StopFlag`` owns (a stale step
  there makes the hosts agree on a sync point one has passed). Saving,
  unforced and forced, periodic and after a stop, must never ask."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  asked = []
  monkeypatch.setattr(multihost_utils, 'reached_preemption_sync_point',
                      lambda step: asked.append(step) or False)
  params = {'w': np.arange(6, dtype=np.float32)}
  with checkpoint.manager(str(tmp_path), save_interval_steps=2) as mngr:
    for step in (2, 4, 5):
      assert checkpoint.save(mngr, step, params, {'n': np.zeros(1)},
                             {'step': step}, force=step == 5)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 4, 5]
  assert asked == []


# ----------------------------------------------------------------------------
# A second Ctrl-C


@pytest.mark.parametrize('hosts', ['one', 'several'])
def test_a_second_ctrl_c_after_the_first_always_leaves_at_once(
    monkeypatch, capfd, hosts):
  """One host: after the stop the run gives the signals back, and a Ctrl-C
  then (its end, the final evaluation) leaves at once instead of waiting
  for a start-up that is over. Several: the first Ctrl-C became the
  hosts' common stop, the second leaves at once (it printed 'stopping once
  start-up is done' and stayed) (issue 45, finding 6)."""
  left = []

  def leave(code):
    left.append(code)
    raise SystemExit(code)

  monkeypatch.setattr(os, '_exit', leave)
  monkeypatch.setattr(signals, '_early', dict(signals._early, stop=False,  # pylint: disable=protected-access
                                              interrupted=False))
  monkeypatch.setattr(os, 'kill', lambda pid, signum: None)  # the notifier's
  before = signal.getsignal(signal.SIGINT)
  signals.record_early()  # as prolip_jax.main does
  try:
    flag = progress.StopFlag()
    handler = signal.getsignal(signal.SIGINT)
    if hosts == 'one':
      handler(signal.SIGINT, None)  # the first: a stop at the next step
      assert flag.stop and not left
      flag.close()
    else:
      flag._ctrl_c_to_notice(signal.SIGINT, None)  # pylint: disable=protected-access
    with pytest.raises(SystemExit):
      signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    assert left == [errors.EXIT_INTERRUPTED]
    err = capfd.readouterr().err
    assert 'stopping once start-up is done' not in err
    assert err.strip().splitlines()[-1].startswith(
        'interrupted (Ctrl-C twice)'), err
    flag.close()
  finally:
    signal.signal(signal.SIGINT, before)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_stopped_run_leaves_the_next_run_of_its_process_unstopped(
    monkeypatch):
  """After a run stopped by SIGTERM gives the signals back, the next
  ``train_and_evaluate`` of the same process (a notebook, a test) starts
  without a stop pending."""
  monkeypatch.setattr(signals, '_early', dict(signals._FRESH))  # pylint: disable=protected-access
  monkeypatch.setattr(os, 'kill', lambda pid, signum: None)
  before = signal.getsignal(signal.SIGTERM)
  try:
    flag = progress.StopFlag()
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert flag.stop
    flag.close()
    following = progress.StopFlag()
    assert not following.stop and not following.interrupted
    following.close()
  finally:
    signal.signal(signal.SIGTERM, before)
