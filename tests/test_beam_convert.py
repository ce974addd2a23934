"""The Beam converters (prolip_jax/conversion/beam.py) against the
one-machine ones (webdataset.py, image_folder.py) on a planted set: the
same shards, record for record and in order, the same skip counts and
summary; retried and killed workers leave no duplicate or missing record.

Beam is an optional extra that does not install beside the pinned
reference versions (docs/data.md): CI runs these tests in a venv of its own
(.ci/run); elsewhere the Beam tests are skipped.
"""

import glob
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from prolip_jax import errors
from prolip_jax.conversion import beam
from prolip_jax.conversion import common
from prolip_jax.conversion import image_folder
from prolip_jax.conversion import webdataset
from prolip_jax.data import record_format

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_beam = pytest.mark.skipif(
    importlib.util.find_spec('apache_beam') is None,
    reason="apache-beam not installed (pip install 'prolip_jax[beam]')")
# One process, and the runner that retries a failed bundle (up to four
# attempts; the in-process FnApiRunner fails the job instead).
RETRYING = ['--runner=BundleBasedDirectRunner']
MAX_RECORD_BYTES = 60_000


def _jpeg(seed: int, size: int = 32, quality: int = 90) -> bytes:
  pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3))
  buf = io.BytesIO()
  Image.fromarray(pixels.astype(np.uint8)).save(buf, 'JPEG', quality=quality)
  return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope='module')
def planted(tmp_path_factory) -> str:
  """Three tars of good examples mixed with every kind of bad one."""
  root = tmp_path_factory.mktemp('planted')
  for t in range(3):
    with tarfile.open(root / f'part{t}.tar', 'w') as tar:
      for i in range(6):
        key = f'{t}_{i:02d}'
        _add(tar, f'{key}.jpg', _jpeg(10 * t + i))
        if i % 2:
          _add(tar, f'{key}.txt', f'photo {key}\n'.encode())
        else:
          _add(tar, f'{key}.json', json.dumps({'caption': f'p {key}'}).encode())
      bad = _jpeg(99)
      _add(tar, f'{t}_corrupt.jpg', bad[:len(bad) // 2])
      _add(tar, f'{t}_corrupt.txt', b'a truncated jpeg')
      _add(tar, f'{t}_empty.jpg', bad)
      _add(tar, f'{t}_empty.txt', b'  \n')
      _add(tar, f'{t}_long.jpg', _jpeg(t, size=256, quality=100))
      _add(tar, f'{t}_long.txt', b'too big for one record')
      _add(tar, f'{t}_nocap.jpg', bad)
      _add(tar, f'{t}_nocap.json', b'{"status": "failed"}')
      _add(tar, f'{t}_latin1.jpg', bad)
      _add(tar, f'{t}_latin1.txt', 'caf\xe9'.encode('latin-1'))
      _add(tar, f'{t}_noimage.txt', b'a caption alone')
  return str(root)


def _shards(out: str) -> dict[str, list[tuple]]:
  """{shard name: [(key, image, caption)] in order} of a conversion."""
  return {os.path.basename(p): [(r['key'], r['image'], r['caption'])
                                for r in record_format.read_shard(p)]
          for p in sorted(glob.glob(os.path.join(out, '*.array_record')))}


def _relative(obj, out: str):
  """``obj`` with the output folder's path left out of its strings."""
  return json.loads(json.dumps(obj).replace(out.rstrip('/') + '/', 'OUT/'))


def _listing(out: str) -> list[str]:
  return sorted(os.listdir(out))


@pytest.fixture(scope='module')
def reference(planted, tmp_path_factory) -> str:
  """The planted tars converted by today's one-machine converter."""
  out = str(tmp_path_factory.mktemp('reference') / 'out')
  webdataset.convert_webdataset(os.path.join(planted, '*.tar'), out,
                                max_record_bytes=MAX_RECORD_BYTES)
  return out


def _assert_same_conversion(out: str, reference: str):
  assert _listing(out) == _listing(reference)  # no staging folder left
  shards = _shards(out)
  assert shards == _shards(reference)
  keys = [k for records in shards.values() for k, _, _ in records]
  assert len(keys) == len(set(keys)) == 18  # 6 good per tar, once each
  for name in [n for n in _listing(out) if n.endswith('.json') or
               n.endswith(record_format.DONE_SUFFIX)]:
    with open(os.path.join(out, name)) as f, open(
        os.path.join(reference, name)) as g:
      assert _relative(json.load(f), out) == _relative(json.load(g),
                                                       reference), name


@needs_beam
def test_tars_same_as_one_machine_converter(planted, reference, tmp_path):
  out = str(tmp_path / 'out')
  summary = beam.convert_webdataset(
      os.path.join(planted, 'part{0..2}.tar'), out,
      max_record_bytes=MAX_RECORD_BYTES)
  # The planted set's own numbers, not only equality with the reference.
  assert summary['records_written'] == 18
  assert summary['examples_seen'] == 3 * 12
  assert summary['skipped'] == {
      'corrupt_image': 3, 'missing_image': 3, 'missing_caption': 3,
      'empty_caption': 3, 'bad_caption': 3, 'too_long': 3}
  _assert_same_conversion(out, reference)


@needs_beam
@pytest.mark.parametrize('stage', ['writing', 'committed', 'done'])
def test_retried_bundle_leaves_no_duplicate(planted, reference, tmp_path,
                                            stage):
  """Every tar's first attempt fails at ``stage``; the runner's retry
  writes the shard again over whatever the first attempt left."""
  out = str(tmp_path / 'out')
  fault = beam.FailOnce(str(tmp_path), stage)
  beam.convert_webdataset(
      os.path.join(planted, '*.tar'), out, max_record_bytes=MAX_RECORD_BYTES,
      pipeline_args=RETRYING, fault=fault)
  assert len(glob.glob(str(tmp_path / f'{stage}-*.failed'))) == 3
  _assert_same_conversion(out, reference)


def _load_tool():
  """``tools/convert_beam.py`` as a module, to run its ``main`` here."""
  spec = importlib.util.spec_from_file_location(
      'convert_beam_tool', os.path.join(ROOT, 'tools', 'convert_beam.py'))
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  return tool


def _tool(argv, **kwargs):
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, 'tools', 'convert_beam.py')] + argv,
      capture_output=True, text=True, timeout=300, check=False, **kwargs)


@needs_beam
@pytest.mark.slow
def test_killed_worker_then_rerun_with_two_worker_processes(planted, reference,
                                                            tmp_path):
  """DirectRunner, two worker processes: a worker dies mid-shard (the
  multi-process DirectRunner fails the job, as a cluster job that ran out of
  retries); the same command again completes it, equal to the reference."""
  out = str(tmp_path / 'out')
  args = ['--runner=DirectRunner', '--direct_num_workers=2',
          '--direct_running_mode=multi_processing']
  fault = beam.FailOnce(str(tmp_path), 'writing', kill=True)
  with pytest.raises(Exception):  # the runner's own error: a worker is gone
    beam.convert_webdataset(
        os.path.join(planted, '*.tar'), out,
        max_record_bytes=MAX_RECORD_BYTES, pipeline_args=args, fault=fault)
  assert glob.glob(str(tmp_path / 'writing-*.failed'))  # a worker died
  assert not os.path.exists(os.path.join(out, 'summary.json'))
  result = _tool(['--input', os.path.join(planted, '*.tar'), '--output', out,
                  '--max_record_bytes', str(MAX_RECORD_BYTES)] + args)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads(open(os.path.join(out, 'summary.json')).read())
  assert summary['shards_converted'] + summary['shards_resumed'] == 3
  # Resumed shards keep the markers of the first run: the summary matches
  # the reference once the resume counts are set aside.
  for s in summary['shards'].values():
    s.pop('resumed', None)
  want = json.loads(open(os.path.join(reference, 'summary.json')).read())
  drop = ('shards_converted', 'shards_resumed')
  assert ({k: v for k, v in _relative(summary, out).items() if k not in drop}
          == {k: v for k, v in _relative(want, reference).items()
              if k not in drop})
  assert _shards(out) == _shards(reference)
  assert _listing(out) == _listing(reference)


def _member_end(tar_path: str, name: str) -> int:
  """The offset just past member ``name`` of a tar (header, data and the
  data's padding to a whole 512-byte block)."""
  with tarfile.open(tar_path) as tar:
    member = tar.getmember(name)
  return member.offset_data + -(-member.size // 512) * 512


@needs_beam
@pytest.mark.parametrize('cut', ['inside_a_member', 'member_boundary'])
def test_corrupt_tar_fails_as_the_one_machine_converter(planted, tmp_path,
                                                        cut):
  """A tar cut inside a member, or on a member boundary (tarfile reads it
  to a quiet end; only its end-of-archive marker is missing), is refused
  by both converters in the same words."""
  part0 = os.path.join(planted, 'part0.tar')
  data = open(part0, 'rb').read()
  # member_boundary: 0_03's image whole, its caption gone.
  end = (len(data) // 2 if cut == 'inside_a_member'
         else _member_end(part0, '0_03.jpg'))
  (tmp_path / 'in').mkdir()
  (tmp_path / 'in' / 'cut.tar').write_bytes(data[:end])
  (tmp_path / 'in' / 'whole.tar').write_bytes(data)
  messages = []
  for convert in (webdataset.convert_webdataset,
                  beam.convert_webdataset):
    out = tmp_path / f'out_{len(messages)}'
    with pytest.raises(common.ConversionError) as e:
      convert(str(tmp_path / 'in'), str(out),
              max_record_bytes=MAX_RECORD_BYTES)
    messages.append(str(e.value).replace(str(out), 'OUT'))
    assert _listing(str(out)) == ['whole.array_record',
                                  'whole.array_record.done']
  assert 'cut.tar is truncated' in messages[0]
  if cut == 'member_boundary':
    assert 'no end-of-archive marker' in messages[0], messages[0]
    assert 'after 3 examples' in messages[0], messages[0]
  assert messages[0] == messages[1]


@needs_beam
def test_failed_run_leaves_no_empty_shard_as_the_one_machine_converter(
    planted, tmp_path):
  """A conversion that gave no record leaves no empty shard with a
  ``.done`` marker (nor the folder it made): once the input is replaced by
  a good one, the same command converts it instead of resuming nothing."""
  (tmp_path / 'in').mkdir()
  tar_path = tmp_path / 'in' / 'x.tar'
  for i, convert in enumerate((webdataset.convert_webdataset,
                               beam.convert_webdataset)):
    with tarfile.open(tar_path, 'w') as tar:
      _add(tar, 'k0.txt', b'a caption without its image')
    out = tmp_path / f'out_{i}'
    with pytest.raises(common.ConversionError, match='no records from'):
      convert(str(tmp_path / 'in'), str(out))
    assert not out.exists()
    shutil.copy(os.path.join(planted, 'part1.tar'), tar_path)
    summary = convert(str(tmp_path / 'in'), str(out),
                      max_record_bytes=MAX_RECORD_BYTES)
    assert (summary['records_written'], summary['shards_resumed']) == (6, 0)
    assert [k for k, _, _ in _shards(str(out))['x.array_record']] == [
        f'1_{i:02d}' for i in range(6)]


@needs_beam
@pytest.mark.parametrize('layout', ['tars', 'folder'])
def test_unknown_runner_is_one_line_and_leaves_no_folder(planted, folder,
                                                         tmp_path, capfd,
                                                         layout):
  """Beam checks its options when the pipeline is made: that happens
  before any output, and its refusal is one ``error:`` line."""
  tool = _load_tool()
  out = tmp_path / 'out'
  images, captions = folder
  args = (['--input', planted] if layout == 'tars' else
          ['--images', images, '--captions', captions])
  args += ['--output', str(out), '--runner=NoSuchRunner']
  capfd.readouterr()
  status = errors.cli_main(lambda: tool.main(args), argv=['prog', *args])
  err = capfd.readouterr().err
  assert status == errors.EXIT_USER_ERROR, err
  assert 'Traceback' not in err, err
  line = err.strip().splitlines()[-1]
  assert line.startswith('error: ') and 'NoSuchRunner' in line, err
  assert not out.exists()


@pytest.fixture(scope='module')
def folder(tmp_path_factory) -> tuple[str, str]:
  """Images plus a JSONL captions file with every kind of bad entry."""
  root = tmp_path_factory.mktemp('folder')
  (root / 'img').mkdir()
  lines = []
  for i in range(9):
    (root / 'img' / f'{i}.jpg').write_bytes(_jpeg(i))
    caps = [f'photo {i}', f'also {i}'] if i % 3 == 0 else f'photo {i}'
    lines.append(json.dumps({'image': f'{i}.jpg', 'captions' if i % 3 == 0
                             else 'caption': caps}))
    if i == 4:
      lines.append('{not json')
  (root / 'img' / 'cut.jpg').write_bytes(_jpeg(50)[:200])
  lines += [json.dumps({'image': 'cut.jpg', 'captions': ['a', 'b']}),
            json.dumps({'image': '0.jpg', 'caption': ' '}),
            json.dumps({'image': 'gone.jpg', 'caption': 'missing'}),
            json.dumps({'image': '../outside.jpg', 'caption': 'escape'}),
            json.dumps({'image': '1.jpg'})]
  (root / 'caps.jsonl').write_text('\n'.join(lines) + '\n')
  return str(root / 'img'), str(root / 'caps.jsonl')


@needs_beam
@pytest.mark.parametrize('block', [3, 1000])
def test_folder_same_as_one_machine_converter(folder, tmp_path, monkeypatch,
                                              block):
  """With one block of entries, and with blocks of 3 entries (ranks carried
  across blocks: shards cut in the middle of blocks)."""
  monkeypatch.setattr(beam, '_BLOCK', block)
  images, captions = folder
  ref, out = str(tmp_path / 'ref'), str(tmp_path / 'out')
  want = image_folder.convert_folder(images, captions, ref, shard_size=4,
                                   max_record_bytes=MAX_RECORD_BYTES)
  got = beam.convert_folder(images, captions, out, shard_size=4,
                                    max_record_bytes=MAX_RECORD_BYTES)
  assert want['records_written'] == 12 and len(want['shards']) == 3
  assert got == want
  assert _shards(out) == _shards(ref)
  assert _listing(out) == _listing(ref)


@needs_beam
def test_folder_retried_shard_writes(folder, tmp_path, monkeypatch):
  monkeypatch.setattr(beam, '_BLOCK', 4)
  images, captions = folder
  ref, out = str(tmp_path / 'ref'), str(tmp_path / 'out')
  image_folder.convert_folder(images, captions, ref, shard_size=5)
  beam.convert_folder(
      images, captions, out, shard_size=5, pipeline_args=RETRYING,
      fault=beam.FailOnce(str(tmp_path), 'committed'))
  assert len(glob.glob(str(tmp_path / 'committed-*.failed'))) == 3
  assert _shards(out) == _shards(ref)
  assert _listing(out) == _listing(ref)


def test_without_beam_one_line_names_the_install(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, 'apache_beam', None)  # import fails
  with pytest.raises(beam.BeamMissingError,
                     match=r"pip install 'prolip_jax\[beam\]'"):
    beam.convert_webdataset(str(tmp_path / '*.tar'),
                                    str(tmp_path / 'out'))


@needs_beam
@pytest.mark.slow
def test_tars_on_gcs(planted, reference, gcs, tmp_path):
  """Tars read from and shards written to ``gs://`` through Beam's file
  systems (a GCS API server on 127.0.0.1: tests/gcs_server.py)."""
  from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  prefix = gcs.url('beam')
  for name in sorted(os.listdir(planted)):
    with open(os.path.join(planted, name), 'rb') as src, FileSystems.create(
        f'{prefix}/in/{name}') as dst:
      dst.write(src.read())
  summary = beam.convert_webdataset(
      f'{prefix}/in/part{{0..2}}.tar', f'{prefix}/out',
      max_record_bytes=MAX_RECORD_BYTES)
  local = tmp_path / 'out'
  local.mkdir()
  found = FileSystems.match([f'{prefix}/out/**'])[0].metadata_list
  assert not [m.path for m in found if beam.STAGING_PREFIX in m.path]
  for m in found:
    with FileSystems.open(m.path) as src:
      (local / m.path.rsplit('/', 1)[1]).write_bytes(src.read())
  assert _listing(str(local)) == _listing(reference)
  assert _shards(str(local)) == _shards(reference)
  want = json.loads(open(os.path.join(reference, 'summary.json')).read())
  assert (json.loads(json.dumps(summary).replace(prefix + '/in/', '')
                     .replace(prefix + '/out/', 'OUT/'))
          == json.loads(json.dumps(want).replace(planted + '/', '')
                        .replace(reference + '/', 'OUT/')))


@needs_beam
def test_tool_refuses_a_typo_of_its_own_options(folder, tmp_path):
  """Beam only logs options it does not know: a misspelt option of the
  tool is refused instead of ignored (a shard size silently left at its
  default)."""
  tool = _load_tool()
  images, captions = folder
  args = ['--images', images, '--captions', captions, '--output',
          str(tmp_path / 'out'), '--direct_num_workers=1']
  with pytest.raises(errors.ConfigError,
                     match='did you mean --shard_size'):
    tool.main(args + ['--shard-size', '3'])
  assert not (tmp_path / 'out').exists()
  summary = tool.main(args + ['--shard_size', '5'])
  assert sorted(summary['shards']) == [f'{i:05d}.array_record'
                                       for i in range(3)]
