"""The tools' mistakes, each through the tool's own ``main`` in this process:
one ``error:`` line on stderr, exit status 2, and the files on disk as they
were (or as the rule says they may become).

* Export and import never delete or replace what they did not write: a
  non-empty ``--out`` is replaced only when it is an export of ours (its
  ``prolip_jax_manifest.json`` lists what is there), locally and on
  ``gs://``; an import refuses a workdir that holds a run or another
  ``tokenizer.model``, and checks its input against the export's manifest.
* Converters: a missing images folder, captions that give no record, a CSV
  without the needed columns and a corrupt tar are each one line; no shard
  is left half-written and a corrupt tar's shard gets no ``.done`` marker.
"""

import hashlib
import io
import json
import os
import shutil
import tarfile

from absl import flags
import jax
import numpy as np
from PIL import Image
import pytest

import prolip_jax
from prolip_jax import errors
from prolip_jax.data import record_format
from prolip_jax.interop import manifest
from prolip_jax.storage import checkpoint
from prolip_jax.storage import paths

import support


@pytest.fixture(scope='module')
def folder_tool():
  return support.load_module('tools/convert_folder.py', 'convert_folder_te')


@pytest.fixture(scope='module')
def webdataset_tool():
  return support.load_module('tools/convert_webdataset.py',
                             'convert_webdataset_te')


def _absl_cli(tool, args, capfd):
  """``tool``'s command line ``args`` (absl flags) through its ``main``:
  (exit status, stdout, stderr). The flags it defines are dropped again, so
  another tool can define its own in the same test."""
  before = set(flags.FLAGS)
  tool._define_flags()  # pylint: disable=protected-access
  try:
    flags.FLAGS(['prog', *args])
    capfd.readouterr()
    try:
      status = tool.main(['prog'])
    except SystemExit as e:
      status = e.code
  finally:
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)
  out, err = capfd.readouterr()
  return status, out, err


def _argparse_cli(tool, args, capfd):
  """``tool``'s command line ``args`` as its ``__main__`` runs it:
  ``errors.cli_main(main)`` -> (exit status, stdout, stderr)."""
  capfd.readouterr()
  try:
    status = errors.cli_main(lambda: tool.main(args), argv=['prog', *args])
  except SystemExit as e:
    status = e.code
  out, err = capfd.readouterr()
  return status if isinstance(status, int) else 0, out, err


def _error_line(err):
  """The one line of stderr, which must be an ``error:`` line."""
  assert err.startswith('error: ') and err.count('\n') == 1, err
  assert 'Traceback' not in err
  return err.rstrip('\n')


def _tree(root):
  """``{relative path: bytes}`` of every file under ``root`` (folders as
  ``path/``: None), or None when ``root`` does not exist."""
  if not os.path.exists(root):
    return None
  out = {}
  for d, dirs, files in os.walk(root):
    for name in dirs:
      out[os.path.relpath(os.path.join(d, name), root) + '/'] = None
    for name in files:
      path = os.path.join(d, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, root)] = f.read()
  return out


def _objects(url):
  """``{relative path: bytes}`` of every object under the prefix ``url``."""
  root = paths.parse(url)
  return {rel: root.joinpath(*rel.split('/')).read_bytes()
          for rel in paths.files_under(root)}


def _assert_whole_export(files):
  """``files`` (``{name: bytes}``) are exactly what their manifest lists,
  with the sizes and sha256 it gives (computed here, not by manifest.py)."""
  listed = json.loads(files[manifest.MANIFEST_FILE])['files']
  assert sorted(files) == sorted([*listed, manifest.MANIFEST_FILE])
  for name, want in listed.items():
    data = files[name]
    assert want == {'bytes': len(data),
                    'sha256': hashlib.sha256(data).hexdigest()}, name


# ----------------------------------------------------------------------------
# Export: a non-empty --out is replaced only when it is an export of ours


@pytest.fixture(scope='module')
def workdirs(tmp_path_factory, tokenizers):
  """Two tiny imported workdirs (different parameters, same tokenizer)."""
  d = tmp_path_factory.mktemp('workdirs')
  return (support.imported_workdir(d / 'wd1', tokenizers[0]),
          support.imported_workdir(d / 'wd2', tokenizers[0],
                                   params=support.tiny_params(seed=1)))


@pytest.mark.parametrize('case', ['config_json', 'export_by_name',
                                  'export_plus_notes', 'unreadable_manifest'])
def test_export_never_replaces_a_folder_that_is_not_all_ours(
    tmp_path, capfd, workdirs, export_tool, case):
  out = tmp_path / 'u'
  if case in ('export_plus_notes', 'unreadable_manifest'):
    export_tool.export(workdirs[0], str(out))
  else:
    out.mkdir()
  if case == 'config_json':  # the user's own config beside other files
    (out / 'config.json').write_text('{"lr": 0.1}\n')
    (out / 'data').mkdir()
    (out / 'data' / 'x.bin').write_bytes(bytes(range(256)))
  elif case == 'export_by_name':  # an export's file names, no manifest
    (out / 'config.json').write_text('{}')
    (out / 'model.safetensors').write_bytes(b'mine')
  elif case == 'unreadable_manifest':
    (out / manifest.MANIFEST_FILE).write_text('{"files": ')
  (out / 'notes.txt').write_bytes(b'keep me\n')
  before, around = _tree(out), sorted(os.listdir(tmp_path))

  status, _, err = _absl_cli(
      export_tool, [f'--workdir={workdirs[1]}', f'--out={out}'], capfd)
  assert status == 2
  line = _error_line(err)
  assert line.startswith(f'error: --out {out} is not an export of ours: '
                         'it holds '), line
  foreign = {'config_json': 'config.json, data/, notes.txt (no ',
             'export_by_name': 'config.json, model.safetensors, notes.txt '
                               '(no ',
             'export_plus_notes': 'notes.txt (its prolip_jax_manifest.json '
                                  'does not list them)',
             'unreadable_manifest': 'cannot be read'}[case]
  assert foreign in line, line
  assert _tree(out) == before  # every byte, the export's own files too
  assert sorted(os.listdir(tmp_path)) == around  # no staging folder left


def test_export_fills_a_new_or_empty_folder_and_replaces_its_own_export(
    tmp_path, capfd, workdirs, export_tool):
  wd1, wd2 = workdirs
  reference = tmp_path / 'reference'  # a fresh export of wd2: the bytes due
  export_tool.export(wd2, str(reference))
  want = _tree(reference)
  _assert_whole_export(want)

  empty = tmp_path / 'empty'
  empty.mkdir()
  for out in (tmp_path / 'new' / 'deeper', empty):
    status, _, err = _absl_cli(export_tool,
                               [f'--workdir={wd2}', f'--out={out}'], capfd)
    assert status == 0, err
    assert _tree(out) == want

  # A hub export of wd1 (one more file) replaced by a plain export of wd2:
  # the old export's files are ours, none lingers.
  out = tmp_path / 'out'
  export_tool.export(wd1, str(out), hub_compatible=True)
  assert 'prolip_jax.json' in os.listdir(out)
  status, _, err = _absl_cli(export_tool,
                             [f'--workdir={wd2}', f'--out={out}'], capfd)
  assert status == 0, err
  assert _tree(out) == want
  # One of its files deleted by hand: what is left is still all ours.
  os.remove(out / 'tokenizer.model')
  status, _, err = _absl_cli(export_tool,
                             [f'--workdir={wd2}', f'--out={out}'], capfd)
  assert status == 0, err
  assert _tree(out) == want


def test_export_to_gcs_replaces_only_its_own_objects(
    gcs, tmp_path, capfd, monkeypatch, workdirs, export_tool):
  wd1, wd2 = workdirs
  reference = tmp_path / 'reference'
  export_tool.export(wd2, str(reference))
  want = _tree(reference)

  # The user's objects under the prefix: refused, every object as it was.
  url = gcs.url('u')
  mine = {'config.json': b'{"lr": 0.1}\n', 'notes.txt': b'keep me\n',
          'data/x.bin': bytes(range(256))}
  for rel, data in mine.items():
    paths.write_bytes(f'{url}/{rel}', data)
  status, _, err = _absl_cli(export_tool,
                             [f'--workdir={wd2}', f'--out={url}'], capfd)
  assert status == 2
  line = _error_line(err)
  assert line.startswith(f'error: --out {url} is not an export of ours: it '
                         'holds config.json, data/x.bin, notes.txt'), line
  assert _objects(url) == mine

  # A hub export replaced by a plain one: the extra object is removed.
  url = gcs.url('export')
  export_tool.export(wd1, url, hub_compatible=True)
  assert 'prolip_jax.json' in _objects(url)
  export_tool.export(wd2, url)
  assert _objects(url) == want

  # An upload cut short after two objects (the old manifest already gone):
  # load refuses it, and the next export still knows the objects as ours.
  real_copy, copied = paths.copy_file, []

  def killed_after_two(src, dst):
    if len(copied) == 2:
      raise KeyboardInterrupt('killed')
    copied.append(dst)
    real_copy(src, dst)
  monkeypatch.setattr(paths, 'copy_file', killed_after_two)
  with pytest.raises(KeyboardInterrupt):
    export_tool.export(wd1, url)
  monkeypatch.undo()
  left = _objects(url)
  assert manifest.MANIFEST_FILE not in left and manifest.PENDING_FILE in left
  with pytest.raises(manifest.ExportIncompleteError, match='incomplete'):
    prolip_jax.load(url)
  status, _, err = _absl_cli(export_tool,
                             [f'--workdir={wd2}', f'--out={url}'], capfd)
  assert status == 0, err
  assert _objects(url) == want

  # A user's object added beside the export: refused, nothing touched.
  paths.write_bytes(f'{url}/notes.txt', b'mine')
  status, _, err = _absl_cli(export_tool,
                             [f'--workdir={wd1}', f'--out={url}'], capfd)
  assert status == 2
  assert 'it holds notes.txt (its prolip_jax_manifest.json does not list ' \
      'them)' in _error_line(err)
  assert _objects(url) == dict(want, **{'notes.txt': b'mine'})


# ----------------------------------------------------------------------------
# Import: never into a run, never over another tokenizer, inputs checked


@pytest.fixture(scope='module')
def export_dir(tmp_path_factory, workdirs, export_tool):
  """An export of ``workdirs[0]`` (its tokenizer included)."""
  out = tmp_path_factory.mktemp('export') / 'export'
  export_tool.export(workdirs[0], str(out))
  return out


@pytest.fixture(scope='module')
def config_file(tmp_path_factory):
  """A config file whose model is the tiny one of the workdirs."""
  path = tmp_path_factory.mktemp('config') / 'tiny.py'
  path.write_text(
      'import ml_collections\nfrom prolip_jax.config import presets\n\n'
      'def get_config():\n  c = presets.base_config()\n'
      f'  c.model = ml_collections.ConfigDict({support.TINY.to_dict()!r})\n'
      '  return c\n')
  return str(path)


def _import(import_tool, capfd, src, workdir, config_file, tokenizer=None):
  args = [f'--src={src}', f'--config={config_file}', f'--workdir={workdir}']
  if tokenizer:
    args.append(f'--tokenizer={tokenizer}')
  return _absl_cli(import_tool, args, capfd)


@pytest.mark.parametrize('case', ['checkpoint', 'metrics', 'unfinished',
                                  'set_aside'])
def test_import_refuses_a_workdir_that_holds_a_run(
    tmp_path, capfd, tokenizers, import_tool, export_dir, config_file, case):
  wd = tmp_path / 'wd'
  if case == 'checkpoint':
    support.imported_workdir(wd, tokenizers[0],
                             params=support.tiny_params(seed=2))
    what = f'{wd / "checkpoints"} already has checkpoints'
  else:
    wd.mkdir()
    shutil.copyfile(tokenizers[0], wd / 'tokenizer.model')
    if case == 'metrics':  # a run that stopped before its first checkpoint
      (wd / 'metrics.jsonl').write_text('{"step": 1, "loss": 2.5}\n')
      what = 'already holds a run (metrics.jsonl)'
    elif case == 'unfinished':  # a checkpoint being written, no step yet
      tmp = wd / 'checkpoints' / '5.orbax-checkpoint-tmp-1'
      tmp.mkdir(parents=True)
      (tmp / 'params').write_bytes(b'half')
      what = 'already holds a run (checkpoints/)'
    else:
      (wd / 'checkpoints_unreadable' / '5').mkdir(parents=True)
      (wd / 'checkpoints_unreadable' / '5' / 'x').write_bytes(b'kept')
      what = 'already holds a run (checkpoints_unreadable/)'
  (wd / 'notes.txt').write_text('mine')
  before, around = _tree(wd), sorted(os.listdir(tmp_path))
  status, _, err = _import(import_tool, capfd, export_dir / 'model.safetensors',
                           wd, config_file, tokenizers[0])
  assert status == 2
  line = _error_line(err)
  assert what in line and line.endswith('; nothing was written'), line
  assert _tree(wd) == before
  assert sorted(os.listdir(tmp_path)) == around  # no staging folder left


def test_import_never_replaces_the_users_files(
    tmp_path, capfd, tokenizers, workdirs, import_tool, export_dir,
    config_file):
  a, b = tokenizers
  src = export_dir / 'model.safetensors'
  # Another tokenizer.model in the workdir: refused, nothing touched.
  wd = tmp_path / 'wd'
  wd.mkdir()
  shutil.copyfile(b, wd / 'tokenizer.model')
  (wd / 'notes.txt').write_text('mine')
  before = _tree(wd)
  status, _, err = _import(import_tool, capfd, src, wd, config_file, a)
  assert status == 2
  line = _error_line(err)
  assert f'{wd / "tokenizer.model"} already exists and is not --tokenizer ' \
      f'{a}' in line, line
  assert _tree(wd) == before

  # The same tokenizer bytes (an import killed after moving it in) and an
  # empty checkpoints/ folder: the import proceeds, leaving the user's
  # files as they are (the tokenizer not even rewritten).
  shutil.copyfile(a, wd / 'tokenizer.model')
  (wd / 'checkpoints').mkdir()
  inode = os.stat(wd / 'tokenizer.model').st_ino
  status, out, err = _import(import_tool, capfd, src, wd, config_file, a)
  assert status == 0, err
  assert 'wrote step 0' in out
  assert (wd / 'notes.txt').read_text() == 'mine'
  assert os.stat(wd / 'tokenizer.model').st_ino == inode
  assert sorted(os.listdir(wd)) == ['checkpoints', 'notes.txt',
                                    'tokenizer.model']
  got, meta = checkpoint.load_params(str(wd))
  want, _ = checkpoint.load_params(workdirs[0])
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert meta['tokenizer_sha256'] == hashlib.sha256(
      open(a, 'rb').read()).hexdigest()


def test_import_into_gcs_refuses_a_run_or_another_tokenizer(
    gcs, capfd, tokenizers, import_tool, export_dir, config_file):
  """The checks come before the object-store branch: the same lines."""
  a, b = tokenizers
  src = export_dir / 'model.safetensors'
  for extra, what in (({'tokenizer.model': open(b, 'rb').read()},
                       '/tokenizer.model already exists and is not '
                       f'--tokenizer {a}'),
                      ({'metrics.jsonl': b'{"step": 1}\n'},
                       'already holds a run (metrics.jsonl)')):
    url = gcs.url()
    mine = dict(extra, **{'notes.txt': b'mine'})
    for rel, data in mine.items():
      paths.write_bytes(f'{url}/{rel}', data)
    status, _, err = _import(import_tool, capfd, src, url, config_file, a)
    assert status == 2
    line = _error_line(err)
    assert what in line and url in line, line
    assert _objects(url) == mine


@pytest.mark.parametrize('case', ['weights', 'tokenizer', 'manifest'])
def test_import_checks_its_input_against_the_exports_manifest(
    tmp_path, capfd, tokenizers, import_tool, export_dir, config_file, case):
  export = tmp_path / 'export'
  shutil.copytree(export_dir, export)
  if case == 'weights':  # one flipped bit, same size
    data = bytearray((export / 'model.safetensors').read_bytes())
    data[len(data) // 2] ^= 0x08
    (export / 'model.safetensors').write_bytes(bytes(data))
    what = (f'error: the export {export}: model.safetensors differs from the '
            'manifest')
  elif case == 'tokenizer':  # another tokenizer put in its place
    shutil.copyfile(tokenizers[1], export / 'tokenizer.model')
    what = (f'error: the export {export}: tokenizer.model differs from the '
            'manifest')
  else:
    (export / manifest.MANIFEST_FILE).write_text('not json')
    what = f'error: {export / manifest.MANIFEST_FILE} is not a manifest'
  wd = tmp_path / 'wd'
  status, _, err = _import(import_tool, capfd, export / 'model.safetensors',
                           wd, config_file, export / 'tokenizer.model')
  assert status == 2
  line = _error_line(err)
  assert line.startswith(what) and line.endswith('; nothing was written'), \
      line
  assert not wd.exists()
  assert sorted(os.listdir(tmp_path)) == ['export']


# ----------------------------------------------------------------------------
# Converters


def _png(value) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(buf, 'PNG')
  return buf.getvalue()


def _random_bytes(n=4096, seed=0) -> bytes:
  return np.random.default_rng(seed).bytes(n)


@pytest.fixture
def images(tmp_path):
  """An images folder with two PNGs, a.png and b.png."""
  d = tmp_path / 'images'
  d.mkdir()
  (d / 'a.png').write_bytes(_png(10))
  (d / 'b.png').write_bytes(_png(200))
  return d


@pytest.mark.parametrize('case', [
    'missing_images', 'missing_captions', 'random_jsonl', 'random_csv',
    'empty_jsonl', 'empty_csv', 'csv_without_columns',
    'csv_without_caption', 'no_listed_image_exists'])
def test_convert_folder_bad_inputs_are_one_line_and_write_nothing(
    tmp_path, capfd, images, folder_tool, case):
  captions = tmp_path / ('captions.csv' if 'csv' in case else
                         'captions.jsonl')
  content = {
      'random_jsonl': _random_bytes(), 'random_csv': _random_bytes(seed=1),
      'empty_jsonl': b'', 'empty_csv': b'',
      'csv_without_columns': b'name,description\na.png,a dark square\n',
      'csv_without_caption': b'image,label\na.png,3\n',
      'no_listed_image_exists':
          b'{"image": "c.png", "caption": "x"}\n'
          b'{"image": "d.png", "caption": "y"}\n',
  }.get(case, b'{"image": "a.png", "caption": "a dark square"}\n')
  if case != 'missing_captions':
    captions.write_bytes(content)
  images_arg = tmp_path / 'no_such_folder' if case == 'missing_images' \
      else images
  out = tmp_path / 'out'
  before = _tree(tmp_path)
  status, _, err = _argparse_cli(
      folder_tool, ['--images', str(images_arg), '--captions', str(captions),
                    '--output', str(out)], capfd)
  assert status == 2
  line = _error_line(err)
  expected = {
      'missing_images': f'error: images folder {images_arg} does not exist',
      'missing_captions': f'error: captions file {captions} does not exist',
      'random_csv': f'error: {captions}',
      'empty_csv': f'error: {captions} is empty',
      'csv_without_columns': f'error: {captions}: the CSV header has no '
                             'image and no caption column',
      'csv_without_caption': f'error: {captions}: the CSV header has no '
                             'caption column',
      'no_listed_image_exists': f'error: no records from captions file '
                                f'{captions} with images folder {images}: '
                                'all 2 examples skipped (missing_image 2',
  }.get(case, f'error: no records from captions file {captions}')
  assert line.startswith(expected), line
  assert _tree(tmp_path) == before  # no output folder, shard or summary


def _tar(path, examples):
  """A webdataset tar of ``(key, {extension: bytes})``."""
  with tarfile.open(path, 'w') as tar:
    for key, files in examples:
      for ext, data in files.items():
        info = tarfile.TarInfo(f'{key}.{ext}')
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def _good_examples(prefix, n=2):
  return [(f'{prefix}{i}', {'png': _png(30 * i + 5),
                            'txt': f'square {prefix}{i}'.encode()})
          for i in range(n)]


@pytest.mark.parametrize('damage', ['random_bytes', 'truncated'])
def test_convert_webdataset_refuses_a_corrupt_tar_and_marks_no_shard(
    tmp_path, capfd, webdataset_tool, damage):
  inp = tmp_path / 'in'
  inp.mkdir()
  _tar(inp / '00000.tar', _good_examples('a'))
  bad = inp / '00001.tar'
  if damage == 'random_bytes':
    bad.write_bytes(_random_bytes())
  else:  # cut inside the second example's image
    _tar(bad, _good_examples('b', 3))
    with tarfile.open(bad) as tar:
      cut = tar.getmember('b1.png').offset_data + 20
    bad.write_bytes(bad.read_bytes()[:cut])
  out = tmp_path / 'out'
  args = ['--input', str(inp / '{00000..00001}.tar'), '--output', str(out),
          '--workers', '1']
  status, _, err = _argparse_cli(webdataset_tool, args, capfd)
  assert status == 2
  line = _error_line(err)
  where = 'before any example' if damage == 'random_bytes' else \
      'after 1 example)'
  assert line.startswith(f'error: 1 of 2 input shards not converted: {bad} '
                         'is truncated or not a tar ('), line
  assert where in line, line
  # The good shard is whole and marked; of the bad one nothing at all.
  assert sorted(os.listdir(out)) == ['00000.array_record',
                                     '00000.array_record.done']
  got = record_format.read_shard(str(out / '00000.array_record'))
  assert [(r['key'], r['image'], r['caption']) for r in got] == [
      (k, f['png'], f['txt'].decode()) for k, f in _good_examples('a')]

  # The tar replaced: a re-run converts only that shard.
  _tar(bad, _good_examples('b', 3))
  mtime = os.path.getmtime(out / '00000.array_record')
  status, _, err = _argparse_cli(webdataset_tool, args, capfd)
  assert status == 0, err
  assert os.path.getmtime(out / '00000.array_record') == mtime
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['records_written'] == 5 and summary['shards_resumed'] == 1
  assert [r['key'] for r in record_format.read_shard(
      str(out / '00001.array_record'))] == ['b0', 'b1', 'b2']


def _member_end(tar_path, name):
  """The offset just past member ``name`` of a tar: its header, its data
  and the data's padding to a whole 512-byte block."""
  with tarfile.open(tar_path) as tar:
    member = tar.getmember(name)
  return member.offset_data + -(-member.size // 512) * 512


@pytest.mark.parametrize('cut', ['member_boundary', 'inside_a_header',
                                 'end_marker'])
def test_convert_webdataset_refuses_a_tar_without_its_end_marker(
    tmp_path, capfd, webdataset_tool, cut):
  """tarfile reads a tar cut on a member boundary (or inside the next
  member's header, or just before its end-of-archive blocks) to a clean
  end: only the missing end-of-archive marker tells it was cut short, and
  then it is refused as a tar cut inside a member is."""
  inp = tmp_path / 'in'
  inp.mkdir()
  _tar(inp / '00000.tar', _good_examples('a'))
  bad = inp / '00001.tar'
  _tar(bad, _good_examples('b', 4))
  end, where = {
      # b2's image whole, its caption gone: was 'missing_caption 1'.
      'member_boundary': (_member_end(bad, 'b2.png'), 'after 2 examples)'),
      'inside_a_header': (_member_end(bad, 'b2.png') + 100,
                          'after 2 examples)'),
      'end_marker': (_member_end(bad, 'b3.txt'), 'after 3 examples)'),
  }[cut]
  bad.write_bytes(bad.read_bytes()[:end])
  out = tmp_path / 'out'
  args = ['--input', str(inp), '--output', str(out), '--workers', '1']
  status, _, err = _argparse_cli(webdataset_tool, args, capfd)
  assert status == 2
  line = _error_line(err)
  assert line.startswith(f'error: 1 of 2 input shards not converted: {bad} '
                         'is truncated or not a tar ('), line
  assert 'end-of-archive' in line and where in line, line
  assert sorted(os.listdir(out)) == ['00000.array_record',
                                     '00000.array_record.done']


def test_convert_webdataset_reads_a_tar_ending_in_one_zero_block(
    tmp_path, capfd, webdataset_tool):
  """The end-of-archive marker is two zero blocks; one (all the members
  whole before it, as a lone-zero-block writer leaves) is an end too."""
  inp = tmp_path / 'in'
  inp.mkdir()
  tar = inp / 'x.tar'
  _tar(tar, _good_examples('b', 3))
  tar.write_bytes(tar.read_bytes()[:_member_end(tar, 'b2.txt') + 512])
  status, _, err = _argparse_cli(
      webdataset_tool, ['--input', str(inp), '--output',
                        str(tmp_path / 'out'), '--workers', '1'], capfd)
  assert status == 0, err
  assert [r['key'] for r in record_format.read_shard(
      str(tmp_path / 'out' / 'x.array_record'))] == ['b0', 'b1', 'b2']


@pytest.mark.parametrize('case', ['no_record_at_all', 'beside_a_corrupt_tar'])
def test_convert_webdataset_failed_run_leaves_no_empty_shard_to_resume(
    tmp_path, capfd, webdataset_tool, case):
  """A conversion that fails keeps no shard that gave no record (nor its
  ``.done`` marker): once its input is replaced by a good one, the same
  command converts it instead of resuming the empty shard (shards with
  records stay done)."""
  inp = tmp_path / 'in'
  inp.mkdir()
  captions_only = [('k0', {'txt': b'a'}), ('k1', {'txt': b'b'})]
  _tar(inp / '1.tar', captions_only)
  if case == 'beside_a_corrupt_tar':
    _tar(inp / '0.tar', _good_examples('a'))
    (inp / '2.tar').write_bytes(_random_bytes())
  out = tmp_path / 'out'
  args = ['--input', str(inp), '--output', str(out), '--workers', '1']
  status, _, err = _argparse_cli(webdataset_tool, args, capfd)
  assert status == 2
  line = _error_line(err)
  if case == 'no_record_at_all':
    assert line.startswith(f'error: no records from {inp}'), line
    assert not out.exists()  # ours, and nothing came of it
  else:
    assert '2.tar is truncated or not a tar' in line, line
    assert sorted(os.listdir(out)) == ['0.array_record',
                                       '0.array_record.done']

  _tar(inp / '1.tar', _good_examples('b', 3))
  if case == 'beside_a_corrupt_tar':
    _tar(inp / '2.tar', _good_examples('c'))
  status, _, err = _argparse_cli(webdataset_tool, args, capfd)
  assert status == 0, err
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['shards']['1.array_record']['records_written'] == 3
  assert summary['shards_resumed'] == (case == 'beside_a_corrupt_tar')
  assert [r['key'] for r in record_format.read_shard(
      str(out / '1.array_record'))] == ['b0', 'b1', 'b2']


@pytest.mark.parametrize('case', ['only_a_corrupt_tar', 'no_images',
                                  'missing_folder', 'empty_folder'])
def test_convert_webdataset_without_a_record_is_one_line(
    tmp_path, capfd, webdataset_tool, case):
  inp = tmp_path / 'in'
  if case != 'missing_folder':
    inp.mkdir()
  if case == 'only_a_corrupt_tar':
    (inp / 'x.tar').write_bytes(b'')
    expected = f'error: 1 of 1 input shards not converted: {inp / "x.tar"}'
  elif case == 'no_images':  # captions without images
    _tar(inp / 'x.tar', [('k0', {'txt': b'a'}), ('k1', {'txt': b'b'})])
    expected = (f'error: no records from {inp} (1 tar shard): all 2 '
                'examples skipped (missing_image 2')
  elif case == 'missing_folder':
    expected = f'error: no such shard: {inp}'
  else:
    expected = f"error: no shards match '{inp / '*.tar'}'"
  before = _tree(tmp_path)
  status, _, err = _argparse_cli(
      webdataset_tool, ['--input', str(inp), '--output',
                        str(tmp_path / 'out'), '--workers', '1'], capfd)
  assert status == 2
  line = _error_line(err)
  assert line.startswith(expected), line
  # Not even the output folder: an empty shard with its .done marker
  # would be resumed as done once the input is fixed.
  assert _tree(tmp_path) == before


@pytest.mark.slow
def test_convert_webdataset_corrupt_tar_in_a_worker_process(
    tmp_path, capfd, webdataset_tool):
  """Workers (spawned processes) report a corrupt tar the same way."""
  inp = tmp_path / 'in'
  inp.mkdir()
  for i in range(3):
    _tar(inp / f'{i}.tar', _good_examples(f's{i}_'))
  (inp / '1.tar').write_bytes(_random_bytes(2048))
  out = tmp_path / 'out'
  status, _, err = _argparse_cli(
      webdataset_tool, ['--input', str(inp), '--output', str(out),
                        '--workers', '2'], capfd)
  assert status == 2
  line = _error_line(err)
  assert line.startswith(f'error: 1 of 3 input shards not converted: '
                         f'{inp / "1.tar"} is truncated or not a tar'), line
  assert sorted(os.listdir(out)) == [
      '0.array_record', '0.array_record.done', '2.array_record',
      '2.array_record.done']
