"""A user's mistakes and the OS's refusals: one line, exit status 2, nothing
lost.

* The tokenizer belongs to the checkpoint: swapped, missing, corrupt or
  empty tokenizer files are refused in one line by resume, ``load``,
  evaluate and export.
* Whole-or-nothing outputs: export and import never leave a mix of old and
  new files; files get the umask's modes; readers warn about unfinished
  conversions.
* One error path (``errors.cli_main``) for every command: OS errors (no such
  workdir, a file in the way, read-only, permission denied, disk full) and
  config errors (batch size vs. masking stride, checked before any work).
* Library inputs of ``LoadedModel.encode_image``/``encode_text`` and
  ``load`` of non-finite parameters.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from PIL import Image

import prolip_jax
from prolip_jax import errors
from prolip_jax import main
from prolip_jax.conversion import image_folder
from prolip_jax.data import record_sources
from prolip_jax.data.tokenizer import file_sha256
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.storage import checkpoint
from prolip_jax.training import resume
from prolip_jax.training import train

import support
from support import assert_same_model
from support import imported_workdir
from support import tiny_params
from support import tiny_run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')


def _one_line(text):
  lines = [l for l in text.strip().splitlines() if l.startswith('error: ')]
  assert len(lines) == 1, text
  return lines[0]


# ----------------------------------------------------------------------------
# 3. The tokenizer belongs to the checkpoint


@pytest.mark.parametrize('content', [b'', b'\x00garbage' * 50,
                                     b'not a model at all\n'])
def test_unreadable_tokenizer_file_is_one_line_naming_it(tmp_path, content):
  path = tmp_path / 'tokenizer.model'
  path.write_bytes(content)
  with pytest.raises(errors.TokenizerError) as e:
    Tokenizer(str(path), 12)
  msg = str(e.value)
  assert str(path) in msg and '\n' not in msg
  assert 'ModelProto' not in msg.split('(')[0]


def test_swapped_tokenizer_is_refused_by_load_and_export(
    tmp_path, tokenizers, export_tool):
  a, b = tokenizers
  wd = imported_workdir(tmp_path / 'wd', a)
  ids_a = prolip_jax.load(wd).tokenizer(['a red cat'])
  shutil.copyfile(b, os.path.join(wd, checkpoint.TOKENIZER_FILE))  # swap
  for fn in (lambda: prolip_jax.load(wd),
             lambda: export_tool.export(wd, str(tmp_path / 'out'))):
    with pytest.raises(errors.TokenizerError) as e:
      fn()
    msg = str(e.value)
    assert '\n' not in msg
    assert os.path.join(wd, 'tokenizer.model') in msg
    assert file_sha256(b)[:16] in msg and file_sha256(a)[:16] in msg
  assert not (tmp_path / 'out').exists()
  # Put back, it loads again, the same numbers.
  shutil.copyfile(a, os.path.join(wd, checkpoint.TOKENIZER_FILE))
  np.testing.assert_array_equal(
      prolip_jax.load(wd).tokenizer(['a red cat']), ids_a)
  assert not np.array_equal(Tokenizer(b, 12)(['a red cat']), ids_a)


def test_evaluate_of_an_export_runs_the_evaluators_of_its_run(
    tmp_path, tokenizers, export_tool):
  """Issue 45, finding 17: an export records what evaluation reads of its
  run (the training set, its evals), so ``evaluate --workdir EXPORT`` of a
  digits run runs the digits report, as it does on the workdir."""
  from prolip_jax.evaluation import runner  # pylint: disable=g-import-not-at-top
  from prolip_jax.interop import manifest  # pylint: disable=g-import-not-at-top
  wd = imported_workdir(tmp_path / 'wd', tokenizers[0])  # trained on digits
  out = str(tmp_path / 'out')
  cfg = export_tool.export(wd, out)
  assert cfg['prolip_jax']['run_config']['data'] == {'name': 'digits'}
  from_workdir = runner.checkpoint_evals(prolip_jax.load(wd)).to_dict()
  assert 'zero_shot' in from_workdir  # the bundled digits report
  assert runner.checkpoint_evals(
      prolip_jax.load(out)).to_dict() == from_workdir
  # An export that records no run says so, not that it was not trained on
  # the digits.
  config_json = os.path.join(out, 'config.json')
  cfg['prolip_jax'].pop('run_config')
  with open(config_json, 'w') as f:
    json.dump(cfg, f)
  manifest.write(out)  # as an export from before the record was written
  with pytest.raises(errors.ConfigError, match='records no training run'):
    runner.checkpoint_evals(prolip_jax.load(out, tokenizer=tokenizers[0]))


def test_export_records_the_tokenizer_and_load_checks_it(
    tmp_path, tokenizers, export_tool):
  a, b = tokenizers
  wd = imported_workdir(tmp_path / 'wd', a)
  out = str(tmp_path / 'out')
  cfg = export_tool.export(wd, out)
  assert cfg['prolip_jax']['tokenizer_sha256'] == file_sha256(a)
  assert cfg['prolip_jax']['tokenizer_vocab_size'] == Tokenizer(
      a, 12).vocab_size
  assert_same_model(prolip_jax.load(out), prolip_jax.load(wd))
  shutil.copyfile(b, os.path.join(out, 'tokenizer.model'))
  with pytest.raises(errors.TokenizerError, match='the export'):
    prolip_jax.load(out)
  # An explicitly chosen tokenizer is the caller's decision.
  prolip_jax.load(out, tokenizer=a)


def test_checkpoints_without_a_tokenizer_hash_keep_working(
    tmp_path, tokenizers, export_tool):
  a, b = tokenizers
  wd = imported_workdir(tmp_path / 'wd', a, record_hash=False)
  _, meta = checkpoint.load_params(wd)
  assert checkpoint.TOKENIZER_SHA256 not in meta
  shutil.copyfile(b, os.path.join(wd, checkpoint.TOKENIZER_FILE))
  prolip_jax.load(wd)  # nothing recorded: nothing to check
  cfg = export_tool.export(wd, str(tmp_path / 'out'))
  assert cfg['prolip_jax']['tokenizer_sha256'] == file_sha256(b)


def test_resume_refuses_a_swapped_or_missing_tokenizer_before_training_one(
    tmp_path, tokenizers):
  a, b = tokenizers
  wd = imported_workdir(tmp_path / 'wd', a)
  with checkpoint.manager(wd, read_only=True) as mngr:
    stored = resume.stored_config(mngr)
  config = micro_config()
  config.tokenizer.model_path = ''
  shutil.copyfile(b, os.path.join(wd, checkpoint.TOKENIZER_FILE))
  with pytest.raises(errors.TokenizerError, match='is not the one'):
    train.setup_tokenizer(config, wd, lambda: ['x'] * 10, stored)
  os.remove(os.path.join(wd, checkpoint.TOKENIZER_FILE))
  called = []
  with pytest.raises(errors.TokenizerError, match='is missing'):
    train.setup_tokenizer(config, wd, lambda: called.append(1), stored)
  assert not called  # no tokenizer was trained in its place
  assert not os.path.exists(os.path.join(wd, checkpoint.TOKENIZER_FILE))


def micro_config(total_steps=4, **overrides):
  return support.micro_config(total_steps, **overrides)


def _env():
  env = support.main_env()
  env.pop('PROLIP_DEBUG', None)
  return env


def _run(*args, timeout=300):
  proc = subprocess.run([sys.executable, *args], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_training_run_tied_to_its_tokenizer_end_to_end(tmp_path, tokenizers):
  """Train 2 steps, swap the workdir's tokenizer: resume, evaluate and
  export refuse in one line and the checkpoint is untouched."""
  wd = str(tmp_path / 'wd')
  rc, out, err = _run('-m', 'prolip_jax.main', f'--config={MICRO}',
                      f'--workdir={wd}', '--config.total_steps=2',
                      '--config.mesh.num_devices=1')
  assert rc == 0, err
  _, meta = checkpoint.load_params(wd)
  tok = os.path.join(wd, checkpoint.TOKENIZER_FILE)
  assert meta[checkpoint.TOKENIZER_SHA256] == file_sha256(tok)
  steps = sorted(os.listdir(checkpoint.checkpoint_dir(wd)))
  shutil.copyfile(tokenizers[1], tok)
  for args in (['-m', 'prolip_jax.main', f'--config={MICRO}',
                f'--workdir={wd}', '--config.total_steps=4',
                '--config.mesh.num_devices=1'],
               ['-m', 'prolip_jax.evaluate', f'--workdir={wd}'],
               ['tools/export_pytorch.py', f'--workdir={wd}',
                f'--out={tmp_path / "export"}']):
    rc, out, err = _run(*args)
    assert rc == 2, err
    line = _one_line(err)
    assert tok in line and 'sha256' in line, line
    assert 'Traceback' not in err
  assert sorted(os.listdir(checkpoint.checkpoint_dir(wd))) == steps
  assert not (tmp_path / 'export').exists()


# ----------------------------------------------------------------------------
# 4. Whole-or-nothing outputs


def _files(d):
  return {n: open(os.path.join(d, n), 'rb').read() for n in os.listdir(d)}


def test_export_is_replaced_whole_and_a_failed_export_keeps_the_old(
    tmp_path, tokenizers, export_tool, monkeypatch):
  a, _ = tokenizers
  wd1 = imported_workdir(tmp_path / 'wd1', a)
  wd2 = imported_workdir(tmp_path / 'wd2', a, params=tiny_params(seed=1))
  out = str(tmp_path / 'out')
  export_tool.export(wd1, out, hub_compatible=True)
  old = _files(out)
  assert 'prolip_jax.json' in old

  # Killed mid-write (after the weights, before the tokenizer copy): the old
  # export stays as it was, no staging folder is left.
  def boom(*args, **kwargs):
    raise KeyboardInterrupt('killed')
  monkeypatch.setattr(export_tool.shutil, 'copyfile', boom)
  with pytest.raises(KeyboardInterrupt):
    export_tool.export(wd2, out)
  monkeypatch.undo()
  assert _files(out) == old
  assert sorted(os.listdir(tmp_path)) == ['out', 'wd1', 'wd2']

  # A re-export replaces the folder whole: prolip_jax.json of the hub
  # export does not linger beside the new config.json.
  export_tool.export(wd2, out)
  new = _files(out)
  assert 'prolip_jax.json' not in new
  assert new['model.safetensors'] != old['model.safetensors']
  assert_same_model(prolip_jax.load(out), prolip_jax.load(wd2))


def test_stale_staging_folder_of_a_killed_export_is_cleaned(
    tmp_path, tokenizers, export_tool):
  wd = imported_workdir(tmp_path / 'wd', tokenizers[0])
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  stale = tmp_path / f'.out.partial-{dead.pid}-abc'
  stale.mkdir()
  (stale / 'model.safetensors').write_bytes(b'half')
  export_tool.export(wd, str(tmp_path / 'out'))
  assert not stale.exists()


def test_replace_dir_without_an_atomic_exchange_still_replaces_whole(
    tmp_path, monkeypatch):
  from prolip_jax.storage import atomic  # pylint: disable=g-import-not-at-top
  target = tmp_path / 'out'
  target.mkdir()
  (target / 'old.txt').write_text('old')
  monkeypatch.setattr(atomic, '_exchange', lambda a, b: False)
  with atomic.staging_dir(str(target)) as tmp:
    with open(os.path.join(tmp, 'new.txt'), 'w') as f:
      f.write('new')
    atomic.replace_dir(tmp, str(target))
  assert sorted(os.listdir(target)) == ['new.txt']
  assert sorted(os.listdir(tmp_path)) == ['out']


def test_an_export_through_a_symlink_replaces_the_folder_it_points_to(
    tmp_path, tokenizers, export_tool, monkeypatch):
  """Issue 45, finding 21: ``--out LINK`` (a link to an export of ours)
  replaces the folder the link points to; the link stays a link and no
  staging folder or renamed link is left, with or without the atomic
  exchange."""
  from prolip_jax.storage import atomic  # pylint: disable=g-import-not-at-top
  wd1 = imported_workdir(tmp_path / 'wd1', tokenizers[0])
  wd2 = imported_workdir(tmp_path / 'wd2', tokenizers[0],
                         params=tiny_params(seed=1))
  real = tmp_path / 'exports' / 'v1'
  weights = lambda: (real / 'model.safetensors').read_bytes()
  export_tool.export(wd1, str(real))
  of_wd1 = weights()
  link = tmp_path / 'LINK'
  link.symlink_to(real)
  for exchange in (True, False):
    if not exchange:
      monkeypatch.setattr(atomic, '_exchange', lambda a, b: False)
    export_tool.export(wd2 if exchange else wd1, str(link))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(os.listdir(tmp_path)) == ['LINK', 'exports', 'wd1', 'wd2']
    assert os.listdir(tmp_path / 'exports') == ['v1']
    assert (weights() == of_wd1) == (not exchange)  # the new export's
  # A renamed link left by an earlier version is removed as stale.
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  left = tmp_path / f'.LINK.partial-{dead.pid}-abc-old'
  left.symlink_to(real)
  export_tool.export(wd1, str(link))
  assert not os.path.lexists(left) and real.is_dir()


def test_export_refuses_a_folder_that_is_not_an_export(
    tmp_path, tokenizers, export_tool):
  wd = imported_workdir(tmp_path / 'wd', tokenizers[0])
  mine = tmp_path / 'mine'
  mine.mkdir()
  (mine / 'notes.txt').write_text('keep me')
  with pytest.raises(errors.UserError, match='not an export'):
    export_tool.export(wd, str(mine))
  assert (mine / 'notes.txt').read_text() == 'keep me'


def test_created_files_follow_the_umask(tmp_path, tokenizers, export_tool,
                                        import_tool):
  wd = imported_workdir(tmp_path / 'wd', tokenizers[0])
  old = os.umask(0o022)
  try:
    out = tmp_path / 'out'
    export_tool.export(wd, str(out))
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o755)
    for name in os.listdir(out):
      assert oct(os.stat(out / name).st_mode & 0o777) == oct(0o644), name
    src = out / 'model.safetensors'
    wd2 = tmp_path / 'wd2'
    import_tool.import_weights(str(src), tiny_run_config(), str(wd2),
                               tokenizers[0])
    for root, dirs, files in os.walk(wd2):
      for n in dirs:
        assert os.stat(os.path.join(root, n)).st_mode & 0o777 == 0o755, n
      for n in files:
        assert os.stat(os.path.join(root, n)).st_mode & 0o777 == 0o644, n
  finally:
    os.umask(old)


def test_import_is_whole_or_nothing(tmp_path, tokenizers, export_tool,
                                    import_tool, monkeypatch):
  a, _ = tokenizers
  out = tmp_path / 'out'
  export_tool.export(imported_workdir(tmp_path / 'wd0', a), str(out))
  src = str(out / 'model.safetensors')
  wd = tmp_path / 'wd'

  # Killed between the checkpoint and the tokenizer copy: nothing is left.
  def boom(*args, **kwargs):
    raise KeyboardInterrupt('killed')
  monkeypatch.setattr(import_tool.shutil, 'copyfile', boom)
  with pytest.raises(KeyboardInterrupt):
    import_tool.import_weights(src, tiny_run_config(), str(wd), a)
  monkeypatch.undo()
  assert not wd.exists()
  assert sorted(os.listdir(tmp_path)) == ['out', 'wd0']

  # A kill after the tokenizer was moved into an existing workdir but before
  # checkpoints/ was: a re-import proceeds.
  wd.mkdir()
  (wd / 'notes.txt').write_text('mine')
  shutil.copyfile(a, wd / 'tokenizer.model')
  import_tool.import_weights(src, tiny_run_config(), str(wd), a)
  assert (wd / 'notes.txt').read_text() == 'mine'
  _, meta = checkpoint.load_params(str(wd))
  assert meta[checkpoint.TOKENIZER_SHA256] == file_sha256(a)
  assert_same_model(prolip_jax.load(str(wd)),
                    prolip_jax.load(str(tmp_path / 'wd0')))
  # A second import into it is refused; nothing changes.
  with pytest.raises(import_tool.ImportFailed, match='already has'):
    import_tool.import_weights(src, tiny_run_config(), str(wd), a)


def test_import_refuses_an_unreadable_tokenizer_before_writing(
    tmp_path, tokenizers, export_tool, import_tool):
  out = tmp_path / 'out'
  export_tool.export(imported_workdir(tmp_path / 'wd0', tokenizers[0]),
                     str(out))
  bad = tmp_path / 'bad.model'
  bad.write_bytes(b'\x01\x02 nope')
  with pytest.raises(errors.TokenizerError, match=str(bad)):
    import_tool.import_weights(str(out / 'model.safetensors'),
                               tiny_run_config(), str(tmp_path / 'wd'),
                               str(bad))
  assert not (tmp_path / 'wd').exists()


def _tiny_png(path, value):
  Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)


def test_readers_warn_about_an_unfinished_conversion(tmp_path, capfd):
  images = tmp_path / 'images'
  images.mkdir()
  rows = []
  for i in range(4):
    _tiny_png(images / f'{i}.png', 40 * i)
    rows.append(json.dumps({'image': f'{i}.png', 'caption': f'image {i}'}))
  (tmp_path / 'caps.jsonl').write_text('\n'.join(rows) + '\n')
  out = tmp_path / 'shards'
  image_folder.convert_folder(str(images), str(tmp_path / 'caps.jsonl'),
                            str(out), shard_size=2)
  capfd.readouterr()
  assert len(record_sources.ArrayRecordSource(str(out))) == 4
  assert 'warning' not in capfd.readouterr().err
  # Killed before the summary (and the last shard's marker) were written.
  os.remove(out / 'summary.json')
  os.remove(out / '00001.array_record.done')
  assert len(record_sources.ArrayRecordSource(str(out))) == 4
  err = capfd.readouterr().err
  assert err.count('warning: ') == 1
  assert str(out) in err and 'did not finish' in err
  assert 'no summary.json' in err and '00001.array_record' in err


# ----------------------------------------------------------------------------
# 5. One error path for every command


def _train_cli(config, workdir):
  return errors.cli_main(lambda: train.train_and_evaluate(config, workdir))


@pytest.mark.parametrize('key,value', [
    ('checkpoint_every_steps', 0), ('log_every_steps', 0),
    ('data.num_workers', -1), ('keep_checkpoints', 0),
    ('keep_checkpoints', -1), ('evals.eval.batch_size', 0),
    ('evals.eval.every_steps', -5), ('max_nonfinite_steps', 0),
    ('data.num_threads', 0), ('batch_size', 0), ('total_steps', -1),
    ('optim.warmup_steps', -1), ('mesh.num_devices', 9),
])
def test_zero_or_negative_counts_are_refused_before_any_work(
    tmp_path, capfd, key, value):
  """Each interval, size or count below its minimum (or more devices than
  the 8 present) is one line naming the key, before the workdir exists:
  not a ZeroDivisionError at step 1, an Orbax traceback or a deleting
  keep_checkpoints=0."""
  config = micro_config(**{key: value})
  wd = tmp_path / 'wd'
  assert _train_cli(config, str(wd)) == errors.EXIT_USER_ERROR
  line = _one_line(capfd.readouterr().err)
  assert f'{key}' in line, line
  assert 'device(s) are present' in line if key == 'mesh.num_devices' else (
      f'(got {value!r})' in line), line
  assert not wd.exists()


def test_a_config_file_must_return_a_config(tmp_path, capfd):
  for body in ('def get_config():\n  return [1, 2]\n',
               'def get_config():\n  return None\n', 'x = 1\n'):
    path = tmp_path / 'c.py'
    path.write_text(body)
    assert main.run(['main', f'--config={path}',
                     f'--workdir={tmp_path / "wd"}']) == 2
    line = _one_line(capfd.readouterr().err)
    assert 'get_config()' in line and str(path) in line, line
  assert not (tmp_path / 'wd').exists()


@pytest.mark.parametrize('case', ['file', 'under_file', 'read_only',
                                  'permission', 'disk_full_lock'])
def test_os_errors_of_the_workdir_are_one_line_status_2(
    tmp_path, capfd, monkeypatch, case):
  config = micro_config()
  target = tmp_path / 'wd'
  if case == 'file':
    target.write_text('x')
  elif case == 'under_file':
    (tmp_path / 'f').write_text('x')
    target = tmp_path / 'f' / 'wd'
  else:
    code = {'read_only': errno.EROFS, 'permission': errno.EACCES,
            'disk_full_lock': errno.ENOSPC}[case]

    def refuse(self):
      raise OSError(code, os.strerror(code), os.path.join(target, '.lock'))
    # Root passes chmod; the OS refusal itself is what is simulated.
    monkeypatch.setattr(train.WorkdirLock, 'acquire', refuse)
  t0 = time.time()
  assert _train_cli(config, str(target)) == errors.EXIT_USER_ERROR
  assert time.time() - t0 < 10
  err = capfd.readouterr().err
  line = _one_line(err)
  assert 'Traceback' not in err
  assert str(target) in line, line
  expected = {'file': 'is a file', 'under_file': 'Not a directory',
              'read_only': 'read-only', 'permission': 'ermission denied',
              'disk_full_lock': 'No space left'}[case]
  assert expected in line, line


def test_training_refuses_a_folder_holding_another_tools_files(
    tmp_path, capfd):
  """Issue 45, finding 2: a folder holding another tool's metrics.jsonl
  (two rows and a free-text line) is refused in one line before anything
  in it changes; no lock or marker is left behind."""
  target = tmp_path / 'other_tool'
  target.mkdir()
  theirs = '{"step":100,"acc":0.91}\n{"step":200,"acc":0.93}\nfree text\n'
  (target / 'metrics.jsonl').write_text(theirs)
  t0 = time.time()
  assert _train_cli(micro_config(), str(target)) == errors.EXIT_USER_ERROR
  assert time.time() - t0 < 10
  err = capfd.readouterr().err
  line = _one_line(err)
  assert line.startswith(f'error: --workdir {target} is not a training run '
                         'of ours: it holds metrics.jsonl'), line
  assert 'dropped' not in err
  assert (target / 'metrics.jsonl').read_text() == theirs
  assert sorted(os.listdir(target)) == ['metrics.jsonl']


def test_a_run_of_ours_or_a_fresh_folder_is_claimed(tmp_path):
  """What counts as a run of ours: the marker a run writes right after its
  lock; checkpoints (a run from before the marker, an import); a fresh
  folder holding only a lock (a run killed before its marker) and a
  tokenizer (read, never written over). Anything else is refused."""
  from prolip_jax.storage.workdir import Workdir  # pylint: disable=g-import-not-at-top
  fresh = Workdir(tmp_path / 'fresh')
  fresh.claim()  # missing: nothing to refuse
  assert fresh.marker.exists()
  (fresh.root / 'notes.txt').write_text('later')
  fresh.claim()  # marked: a run of ours, whatever was added since
  killed = Workdir(tmp_path / 'killed')
  killed.create()
  killed.lock.write_text('{"host": "h", "pid": 1}')
  killed.tokenizer.write_bytes(b'x')
  killed.claim()
  assert killed.marker.exists()
  legacy = Workdir(tmp_path / 'legacy')  # checkpoints, no marker
  (legacy.checkpoints / '5').mkdir(parents=True)
  (legacy.root / 'metrics.jsonl').write_text('{"step": 0}\n')
  legacy.claim()
  assert legacy.marker.exists()
  for name in ('metrics.jsonl', 'tensorboard/', 'notes.txt'):
    other = Workdir(tmp_path / 'other' / name.strip('/'))
    other.create()
    if name.endswith('/'):
      (other.root / name).mkdir()
    else:
      (other.root / name).write_text('theirs')
    with pytest.raises(errors.UserError, match=f'it holds {name}'):
      other.claim()
    assert not other.marker.exists()


def test_a_bug_keeps_its_traceback(capfd):
  def bug():
    raise KeyError('ours')
  with pytest.raises(KeyError):
    errors.cli_main(bug)
  # ... also when it happened while handling an OS error of ours.
  def bug_after_oserror():
    try:
      raise ValueError('not an OS error')
    except ValueError:
      raise TypeError('ours') from None
  with pytest.raises(TypeError):
    errors.cli_main(bug_after_oserror)


def test_debug_keeps_the_traceback_of_a_user_error(capfd, monkeypatch):
  monkeypatch.setenv('PROLIP_DEBUG', '1')
  def user():
    raise FileNotFoundError(errno.ENOENT, 'No such file or directory', '/x/y')
  assert errors.cli_main(user, argv=['prog']) == 2
  err = capfd.readouterr().err
  assert 'Traceback' in err and err.strip().endswith(
      'error: No such file or directory: /x/y')


def test_disk_full_found_behind_a_wrapping_error(capfd):
  """Orbax reports a failed async write wrapped in its own exceptions."""
  def orbax_like():
    try:
      raise OSError(errno.ENOSPC, 'No space left on device', '/wd/ckpt/3')
    except OSError as e:
      raise RuntimeError('Checkpoint save failed') from e
  assert errors.cli_main(orbax_like, argv=['prog']) == 2
  line = _one_line(capfd.readouterr().err)
  assert 'No space left on device: /wd/ckpt/3' in line


@pytest.mark.slow
def test_batch_size_not_multiple_of_masking_stride_fails_before_any_work(
    tmp_path):
  wd = tmp_path / 'wd'
  t0 = time.time()
  rc, _, err = _run('-m', 'prolip_jax.main', f'--workdir={wd}',
                    '--config.batch_size=7')
  took = time.time() - t0
  assert rc == 2, err
  line = _one_line(err)
  assert 'batch_size 7' in line and 'masking.fraction' in line
  assert 'Traceback' not in err
  assert took < 30, took  # the tokenizer took 45 s before
  assert not (wd / 'tokenizer.model').exists()
  assert not (wd / 'checkpoints').exists()


def test_batch_check_is_the_objectives_own():
  from prolip_jax import objectives  # pylint: disable=g-import-not-at-top
  config = micro_config(batch_size=12, **{'masking.fraction': 0.125})
  with pytest.raises(ValueError, match='multiple of 1/masking.fraction = 8'):
    objectives.get('prolip').validate_batch(config, 1)
  objectives.get('prolip').validate_batch(micro_config(batch_size=16), 2)
  with pytest.raises(ValueError, match='per-device batch of 8'):
    objectives.get('prolip').validate_batch(
        micro_config(batch_size=16, **{'masking.fraction': 0.0625}), 2)


@pytest.mark.slow
def test_evaluate_and_export_of_an_empty_or_missing_workdir_are_one_line(
    tmp_path):
  empty = tmp_path / 'empty'
  empty.mkdir()
  for args in (['-m', 'prolip_jax.evaluate', f'--workdir={empty}'],
               ['-m', 'prolip_jax.evaluate',
                f'--workdir={tmp_path / "missing"}'],
               ['tools/export_pytorch.py', f'--workdir={empty}',
                f'--out={tmp_path / "o"}']):
    rc, _, err = _run(*args)
    assert rc == 2, err
    line = _one_line(err)
    assert 'Traceback' not in err
    assert str(tmp_path) in line and 'no checkpoints' in line, line


@pytest.mark.slow
def test_tools_report_missing_inputs_in_one_line(tmp_path):
  missing = tmp_path / 'missing'
  for args, path in (
      (['tools/convert_folder.py', f'--images={missing}',
        f'--captions={missing}.csv', f'--output={tmp_path / "o1"}'],
       f'{missing}.csv'),
      (['tools/convert_webdataset.py', f'--input={missing}/{{0..1}}.tar',
        f'--output={tmp_path / "o2"}', '--workers=1'], str(missing)),
      (['tools/train_tokenizer.py', f'--input={missing}/*.array_record',
        f'--output={tmp_path / "t.model"}'], str(missing)),
      (['tools/import_pytorch.py', f'--src={missing}.safetensors',
        f'--config={MICRO}', f'--workdir={tmp_path / "wd"}'],
       f'{missing}.safetensors')):
    rc, _, err = _run(*args)
    assert rc == 2, (args, err)
    assert path in _one_line(err), err
    assert 'Traceback' not in err


@pytest.mark.slow
def test_workdir_that_is_a_file_from_the_command_line(tmp_path):
  target = tmp_path / 'wd'
  target.write_text('x')
  rc, _, err = _run('-m', 'prolip_jax.main', f'--workdir={target}',
                    f'--config={MICRO}')
  assert rc == 2, err
  assert _one_line(err) == f'error: {target} is a file, not a directory'


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_write_is_one_line(tmp_path):
  """A real full disk (a small tmpfs; needs root): the run stops with one
  line, the previous checkpoint restores."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root')
  wd = str(tmp_path / 'wd')
  rc, _, err = _run('-m', 'prolip_jax.main', f'--config={MICRO}',
                    f'--workdir={wd}', '--config.total_steps=2',
                    '--config.mesh.num_devices=1')
  assert rc == 0, err
  used = sum(os.path.getsize(os.path.join(r, f))
             for r, _, fs in os.walk(wd) for f in fs)
  mnt = tmp_path / 'small'
  mnt.mkdir()
  size_kb = (used + used // 3) // 1024 + 64
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size_kb}k',
                     'tmpfs', str(mnt)], capture_output=True).returncode:
    pytest.skip('cannot mount a tmpfs here')
  try:
    small = str(mnt / 'wd')
    shutil.copytree(wd, small)
    before, _ = checkpoint.load_params(small)
    rc, _, err = _run('-m', 'prolip_jax.main', f'--config={MICRO}',
                      f'--workdir={small}', '--config.total_steps=4',
                      '--config.mesh.num_devices=1',
                      '--config.keep_checkpoints=10')
    assert rc == 2, err[-3000:]
    line = _one_line(err)
    assert 'No space left on device' in line, line
    # Nothing else: no echo of Orbax's pending writes failing in closed
    # event loops (unraisable exceptions, once 196 tracebacks).
    assert err.strip().splitlines() == [line], err[-3000:]
    after, meta = checkpoint.load_params(small, 2)
    assert meta['step'] == 2
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  finally:
    subprocess.run(['umount', str(mnt)], check=False)


# ----------------------------------------------------------------------------
# 7. Library inputs


@pytest.fixture(scope='module')
def model(tmp_path_factory, tokenizers):
  wd = imported_workdir(tmp_path_factory.mktemp('m') / 'wd', tokenizers[0])
  return prolip_jax.load(wd)


def test_float_images_in_0_1_embed_like_their_uint8(model):
  rng = np.random.default_rng(0)
  u8 = rng.integers(0, 256, (2, 20, 24, 3), dtype=np.uint8)
  want_mu, want_lv = model.encode_image(list(u8))
  for images in ([x.astype(np.float32) / 255 for x in u8],
                 [x.astype(np.float64) / 255 for x in u8],
                 [x.astype(np.int64) for x in u8],
                 [Image.fromarray(x) for x in u8]):
    mu, lv = model.encode_image(images)
    np.testing.assert_array_equal(mu, want_mu)
    np.testing.assert_array_equal(lv, want_lv)
  # Grey (h, w) = the same grey repeated over 3 channels.
  grey = u8[0, :, :, 0]
  np.testing.assert_array_equal(
      model.encode_image([grey])[0],
      model.encode_image([np.repeat(grey[:, :, None], 3, -1)])[0])


def test_image_paths_embed_like_their_arrays(model, tmp_path):
  u8 = np.random.default_rng(1).integers(0, 256, (20, 20, 3), dtype=np.uint8)
  Image.fromarray(u8).save(tmp_path / 'x.png')
  np.testing.assert_array_equal(
      model.encode_image([str(tmp_path / 'x.png')])[0],
      model.encode_image([u8])[0])
  with pytest.raises(FileNotFoundError):
    model.encode_image([str(tmp_path / 'missing.png')])
  (tmp_path / 'bad.png').write_bytes(b'not a png')
  with pytest.raises(ValueError, match='image 0: .*bad.png is not a readable'):
    model.encode_image([str(tmp_path / 'bad.png')])


OK = np.zeros((8, 8, 3), np.uint8)


@pytest.mark.parametrize('bad,reason', [
    (np.full((8, 8, 3), 1.5, np.float32), r'\[0, 1\]'),
    (np.full((8, 8, 3), -0.1, np.float32), r'\[0, 1\]'),
    (np.full((8, 8, 3), np.nan, np.float32), 'NaN'),
    (np.full((8, 8, 3), np.inf, np.float64), 'NaN or infinite'),
    (np.zeros((3, 32, 32), np.uint8), 'channels-first'),
    (np.zeros((0, 0, 3), np.uint8), 'empty'),
    (np.zeros((0, 0), np.uint8), 'empty'),
    (np.full((8, 8, 3), 1000, np.int64), '0..255'),
    (np.full((8, 8, 3), -1, np.int32), '0..255'),
    (np.zeros((8, 8, 5), np.uint8), 'not an image'),
    (np.zeros((8,), np.uint8), 'not an image'),
    (np.zeros((8, 8, 3), bool), 'not an image dtype'),
])
def test_silently_wrong_images_are_refused_naming_the_index(model, bad,
                                                           reason):
  with pytest.raises(ValueError, match=f'^image 1: .*{reason}') as e:
    model.encode_image([OK, bad])
  assert '\n' not in str(e.value)


def test_int64_1000_does_not_wrap_to_232(model):
  assert np.uint8(np.int64(1000) % 256) == 232  # what a cast used to give
  with pytest.raises(ValueError, match='found 1000..1000'):
    model.encode_image([np.full((8, 8, 3), 1000, np.int64)])


def test_empty_inputs_give_empty_arrays(model):
  mu, lv = model.encode_text(['a cat'])
  for out, one in ((model.encode_text([]), (mu, lv)),
                   (model.encode_image([]), model.encode_image([OK]))):
    for got, ref in zip(out, one):
      assert got.shape == (0,) + ref.shape[1:] and got.dtype == ref.dtype


@pytest.mark.parametrize('what', ['nan_weight', 'inf_logit_scale'])
def test_load_refuses_non_finite_parameters(tmp_path, tokenizers, what,
                                            export_tool):
  params = jax.tree.map(np.array, tiny_params())
  if what == 'nan_weight':
    params['visual']['conv1']['kernel'][0, 0, 0, 0] = np.nan
    key = "['visual']['conv1']['kernel']"
  else:
    params['logit_scale'] = np.array(np.inf, np.float32)
    key = "['logit_scale']"
  wd = imported_workdir(tmp_path / 'wd', tokenizers[0], params=params)
  with pytest.raises(errors.NonFiniteParamsError) as e:
    prolip_jax.load(wd)
  assert key in str(e.value) and '\n' not in str(e.value)
  # The same model exported: load of the export refuses too.
  export_tool.export(wd, str(tmp_path / 'out'))
  with pytest.raises(errors.NonFiniteParamsError, match='non-finite'):
    prolip_jax.load(str(tmp_path / 'out'))
