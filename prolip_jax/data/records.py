"""Image-text pairs in array_record shards, and record sources for training.

Record format
-------------
One array_record record is one example: a MessagePack map (msgpack.org, read
by any language's msgpack library; strings are UTF-8 ``str``, the image is
``bin``) with the keys

* ``"key"``: str, the image's id (the webdataset key, or the image's path
  relative to the image folder). Several records may share a key: one record
  per caption of the same image (retrieval sets group them by key).
* ``"image"``: bin, the encoded image byte-for-byte as it was in the input
  (JPEG normally; PNG/WebP inputs are kept as they are, not re-encoded).
* ``"caption"``: str, the caption with surrounding whitespace stripped.

Readers ignore keys they do not know, so fields can be added later.
``serialize_example`` / ``parse_example`` write and read it.

Shards are ``NAME.array_record`` files written with ``group_size:1`` (Grain's
random access needs it) and no compression (JPEG does not compress). A
converter writes ``NAME.array_record.done`` (its JSON summary) after the shard
is complete, so an interrupted conversion can resume.

Sources
-------
``ArrayRecordSource(glob)`` and ``TfdsSource`` are random-access sequences of
record dicts for ``pipeline.train_dataset``. ``CheckedSource`` wraps either
for training: it decodes every record, replaces bad ones deterministically
(see its docstring), counts them, and stops the run when too many are bad.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import glob as glob_lib
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Iterable, Optional, Sequence

import msgpack
import numpy as np
from PIL import Image

from prolip_jax import errors
from prolip_jax.data import image_decode

SUFFIX = '.array_record'
DONE_SUFFIX = '.done'
SUMMARY_FILE = 'summary.json'  # written by a converter when it finishes
# group_size:1 makes every record its own chunk: O(1) random reads, no
# decompression of neighbours; JPEG bytes do not compress, so none is tried.
WRITER_OPTIONS = 'group_size:1,uncompressed'

# Why a record is unusable. Converters count skipped inputs under these
# names; ``CheckedSource`` counts bad training records under them too.
CORRUPT_IMAGE = 'corrupt_image'  # PIL cannot decode it (truncated, garbage)
MISSING_IMAGE = 'missing_image'
MISSING_CAPTION = 'missing_caption'
EMPTY_CAPTION = 'empty_caption'  # empty or only whitespace
BAD_CAPTION = 'bad_caption'  # not UTF-8 text / invalid JSON
TOO_LONG = 'too_long'  # serialized record above max_record_bytes
UNREADABLE = 'unreadable_record'  # not a valid serialized example
REASONS = (CORRUPT_IMAGE, MISSING_IMAGE, MISSING_CAPTION, EMPTY_CAPTION,
           BAD_CAPTION, TOO_LONG, UNREADABLE)


class BadRecord(ValueError):
  """One unusable record; ``reason`` is one of ``REASONS``."""

  def __init__(self, reason: str, detail: str = ''):
    super().__init__(f'{reason}: {detail}' if detail else reason)
    self.reason = reason
    self.detail = detail


class BadRecordError(errors.UserError, RuntimeError):
  """Too many bad records: the data needs fixing before training goes on."""


# ----------------------------------------------------------------------------
# Serialization.


def serialize_example(image: bytes, caption: str, key: str) -> bytes:
  """The record bytes of one example (format in the module docstring)."""
  if not isinstance(image, (bytes, bytearray, memoryview)):
    raise TypeError(f'image must be encoded bytes, got {type(image)}')
  if not isinstance(caption, str) or not isinstance(key, str):
    raise TypeError('caption and key must be str')
  return msgpack.packb({'key': key, 'image': bytes(image), 'caption': caption},
                       use_bin_type=True)


def parse_example(data: bytes) -> dict[str, Any]:
  """Record bytes -> ``{'key': str, 'image': bytes, 'caption': str, ...}``.

  Raises ``BadRecord(UNREADABLE)`` for bytes that are not a serialized example.
  """
  try:
    record = msgpack.unpackb(data, raw=False)
  except Exception as e:  # pylint: disable=broad-except
    raise BadRecord(UNREADABLE, f'not msgpack: {e}') from None
  if not isinstance(record, dict):
    raise BadRecord(UNREADABLE, f'expected a map, got {type(record).__name__}')
  return record


def check_image_bytes(data: bytes) -> Optional[str]:
  """None when PIL fully decodes ``data``, else a skip reason."""
  if not data:
    return MISSING_IMAGE
  try:
    decode_image(data)
  except Exception:  # pylint: disable=broad-except
    return CORRUPT_IMAGE
  return None


# The decoder of training records (RGB at decode); the name records.decode_image
# is kept for callers written against it.
decode_image = image_decode.decode_rgb


class ShardWriter:
  """Writes one array_record shard atomically (``PATH.tmp`` then rename)."""

  def __init__(self, path: str):
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    self.path = path
    self._tmp = path + '.tmp'
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self._writer = array_record_module.ArrayRecordWriter(self._tmp,
                                                         WRITER_OPTIONS)
    self.count = 0

  def write(self, record: bytes):
    self._writer.write(record)
    self.count += 1

  def close(self):
    self._writer.close()
    os.replace(self._tmp, self.path)

  def abort(self):
    self._writer.close()
    if os.path.exists(self._tmp):
      os.remove(self._tmp)


def write_done_marker(path: str, summary: dict):
  tmp = path + DONE_SUFFIX + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(summary, f, indent=1, sort_keys=True)
  os.replace(tmp, path + DONE_SUFFIX)


def incomplete_conversions(paths: Sequence[str]) -> list[str]:
  """One line for each folder of ``paths`` that a converter started but did
  not finish: it has shard markers (``.done``) or a half-written shard
  (``.tmp``) but no final ``summary.json``, or shards without a marker."""
  out = []
  for folder in sorted({os.path.dirname(os.path.abspath(p)) for p in paths}):
    try:
      names = set(os.listdir(folder))
    except OSError:
      continue
    shards = {n for n in names if n.endswith(SUFFIX)}
    done = {n[:-len(DONE_SUFFIX)] for n in names if n.endswith(DONE_SUFFIX)}
    partial = [n for n in names if n.endswith(SUFFIX + '.tmp')]
    if not (done or partial):
      continue  # not written by our converters: nothing to judge by
    unmarked = sorted(shards - done)
    if SUMMARY_FILE in names and not unmarked and not partial:
      continue
    what = [f'no {SUMMARY_FILE}'] if SUMMARY_FILE not in names else []
    if unmarked:
      what.append(f'{len(unmarked)} shards without a {DONE_SUFFIX} marker '
                  f'(e.g. {unmarked[0]})')
    if partial:
      what.append(f'{len(partial)} half-written shards')
    out.append(f'the conversion in {folder} did not finish '
               f'({"; ".join(what)}): re-run the converter with the same '
               'arguments to complete it')
  return out


def read_done_marker(path: str) -> Optional[dict]:
  """The summary stored by a finished conversion of ``path``, else None."""
  marker = path + DONE_SUFFIX
  if not (os.path.exists(path) and os.path.exists(marker)):
    return None
  try:
    with open(marker) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def num_records(path: str) -> int:
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  reader = array_record_module.ArrayRecordReader(path)
  try:
    return reader.num_records()
  finally:
    reader.close()


def read_shard(path: str) -> list[dict]:
  """Every record of one shard, parsed (small shards, tests and tools)."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  reader = array_record_module.ArrayRecordReader(path)
  try:
    n = reader.num_records()
    return [parse_example(r) for r in (reader.read(list(range(n))) if n
                                       else [])]
  finally:
    reader.close()


# ----------------------------------------------------------------------------
# Paths.


def expand_braces(pattern: str) -> list[str]:
  """Shell-style brace expansion: ``{000..099}`` (zero padding kept) and
  ``{a,b}``, several groups allowed: ``'d/{0..1}-{x,y}.tar'`` -> 4 paths."""
  m = re.search(r'\{([^{}]*)\}', pattern)
  if not m:
    return [pattern]
  head, body, tail = pattern[:m.start()], m.group(1), pattern[m.end():]
  rng = re.fullmatch(r'(-?\d+)\.\.(-?\d+)', body)
  if rng:
    a, b = rng.group(1), rng.group(2)
    width = len(a) if a.lstrip('-').startswith('0') and len(a) > 1 else 0
    lo, hi = int(a), int(b)
    step = 1 if hi >= lo else -1
    items = [str(i).zfill(width) for i in range(lo, hi + step, step)]
  elif ',' in body:
    items = body.split(',')
  else:  # not a brace expression: keep it literally
    return [head + '{' + body + '}' + p for p in expand_braces(tail)]
  return [head + item + p for item in items for p in expand_braces(tail)]


def _split_commas(text: str) -> list[str]:
  """Splits on commas outside braces: ``'a/{0,1}.x,b.x'`` -> 2 items."""
  out, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += (ch == '{') - (ch == '}')
    if ch == ',' and depth == 0:
      out.append(text[start:i])
      start = i + 1
  out.append(text[start:])
  return out


def expand_paths(paths_or_glob: str | Sequence[str]) -> list[str]:
  """Sorted shard paths from a glob, a brace pattern, a comma-separated list,
  a directory (its ``*.array_record``) or a list of any of those."""
  if isinstance(paths_or_glob, (str, os.PathLike)):
    items = [p for p in _split_commas(str(paths_or_glob)) if p]
  else:
    items = [str(p) for p in paths_or_glob]
  out = []
  for item in items:
    for pattern in expand_braces(os.path.expanduser(item)):
      if os.path.isdir(pattern):
        pattern = os.path.join(pattern, '*' + SUFFIX)
      if glob_lib.has_magic(pattern):
        out.extend(sorted(glob_lib.glob(pattern)))
      elif os.path.exists(pattern):
        out.append(pattern)
      else:
        raise FileNotFoundError(f'no such shard: {pattern}')
  if not out:
    raise FileNotFoundError(f'no shards match {paths_or_glob!r}')
  return out


# ----------------------------------------------------------------------------
# Sources.


class ArrayRecordSource:
  """Random access to the parsed examples of array_record shards.

  ``source[i]`` is ``{'key', 'image' (encoded bytes), 'caption'}``; records
  are numbered shard after shard, in sorted path order. Empty shards are
  skipped. Picklable (Grain worker processes reopen the files lazily).
  """

  def __init__(self, paths_or_glob: str | Sequence[str], parse: bool = True):
    import grain  # pylint: disable=g-import-not-at-top
    paths = expand_paths(paths_or_glob)
    for line in incomplete_conversions(paths):
      print(f'warning: {line}', file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(min(16, len(paths))) as pool:
      counts = list(pool.map(num_records, paths))
    keep = [(p, n) for p, n in zip(paths, counts) if n > 0]
    if not keep:
      raise ValueError(f'the shards {paths_or_glob!r} hold no records')
    self.paths = [p for p, _ in keep]
    self.shard_sizes = [n for _, n in keep]
    self._ends = list(np.cumsum(self.shard_sizes))
    self.parse = parse
    # ``PATH[0:N]`` tells Grain the record count, so it does not reopen files.
    self._ds = grain.sources.ArrayRecordDataSource(
        [f'{p}[0:{n}]' for p, n in keep])

  def __len__(self) -> int:
    return int(self._ends[-1])

  def __getitem__(self, index):
    raw = self._ds[index]
    return parse_example(raw) if self.parse else raw

  def shard_of(self, index: int) -> tuple[str, int]:
    """(shard path, position in it) of record ``index``."""
    index = int(index)
    s = bisect.bisect_right(self._ends, index)
    return self.paths[s], index - (int(self._ends[s - 1]) if s else 0)

  def __repr__(self):
    return (f'ArrayRecordSource({len(self.paths)} shards, {len(self)} records,'
            f' first {self.paths[0]!r})')


def import_tfds():
  """``tensorflow_datasets``, or an ImportError saying how to install it."""
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        'TFDS data sources need the optional tensorflow-datasets package '
        '(and its array_record data files, prepared with `tfds build` or '
        'downloaded): pip install tensorflow-datasets') from e
  return tfds


def _get_field(record: dict, key: str):
  """``record[key]`` where ``key`` may be nested: ``'captions/text'``."""
  value = record
  for part in key.split('/'):
    if not isinstance(value, dict) or part not in value:
      raise KeyError(key)
    value = value[part]
  return value


def _to_text(value) -> str:
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if isinstance(value, (bytes, np.bytes_)):
    return bytes(value).decode('utf-8')
  if isinstance(value, str):
    return value
  raise TypeError(f'caption of type {type(value).__name__}')


class TfdsSource:
  """A ``tfds.data_source`` as records ``{'image', 'caption' | 'captions'}``.

  ``image_key`` / ``caption_key`` name the features (``/`` for nested ones,
  e.g. ``'captions/text'``); a caption feature holding several strings gives
  ``'captions'`` (one is drawn per view). Other features are dropped.
  """

  def __init__(self, data_source, image_key: str = 'image',
               caption_key: str = 'caption', name: str = 'tfds'):
    self.ds = data_source
    self.image_key = image_key
    self.caption_key = caption_key
    self.name = name

  def __len__(self) -> int:
    return len(self.ds)

  def __getitem__(self, index) -> dict:
    rec = self.ds[index]
    try:
      image = _get_field(rec, self.image_key)
    except KeyError:
      raise BadRecord(MISSING_IMAGE, f'no feature {self.image_key!r}; have '
                      f'{sorted(rec)}') from None
    try:
      caption = _get_field(rec, self.caption_key)
    except KeyError:
      raise BadRecord(MISSING_CAPTION, f'no feature {self.caption_key!r}; '
                      f'have {sorted(rec)}') from None
    try:
      if isinstance(caption, (list, tuple)) or (
          isinstance(caption, np.ndarray) and caption.ndim > 0):
        out = {'image': image, 'captions': [_to_text(c) for c in caption]}
      else:
        out = {'image': image, 'caption': _to_text(caption)}
    except (TypeError, UnicodeDecodeError) as e:
      raise BadRecord(BAD_CAPTION, str(e)) from None
    out['key'] = f'{self.name}:{int(index)}'
    return out

  def shard_of(self, index: int) -> tuple[str, int]:
    return self.name, int(index)

  def __repr__(self):
    return f'TfdsSource({self.name}, {len(self)} records)'


def tfds_source(name: str, split: str = 'train', data_dir: Optional[str] = None,
                image_key: str = 'image', caption_key: str = 'caption'
                ) -> TfdsSource:
  """A TFDS dataset's random-access ``data_source`` as training records."""
  ds = open_tfds(name, split, data_dir, image_key)
  return TfdsSource(ds, image_key, caption_key, name=f'tfds:{name}/{split}')


def open_tfds(name: str, split: str, data_dir: Optional[str] = None,
              image_key: str = 'image'):
  """``tfds.data_source`` with the image feature left encoded when TFDS can
  (``SkipDecoding``): it is decoded (and checked) by our own code then."""
  tfds = import_tfds()
  kwargs = dict(split=split, data_dir=data_dir or None)
  skip = getattr(getattr(tfds, 'decode', None), 'SkipDecoding', None)
  if skip is not None and '/' not in image_key:
    try:
      return tfds.data_source(name, decoders={image_key: skip()}, **kwargs)
    except TypeError:  # an older TFDS without decoders= here
      pass
  return tfds.data_source(name, **kwargs)


# ----------------------------------------------------------------------------
# Bad-record handling at training time.


train_min_pixels = image_decode.train_min_pixels


def check_record(record: Any, decode: bool = True, min_pixels: int = 0
                 ) -> dict:
  """A usable copy of ``record`` (image decoded when ``decode``, JPEGs at a
  reduced scale keeping ``min_pixels``: ``decode_image``) or raises
  ``BadRecord``. Captions: ``caption`` must be non-blank text; a ``captions``
  list keeps its non-blank entries and must keep at least one."""
  if not isinstance(record, dict):
    raise BadRecord(UNREADABLE, f'record of type {type(record).__name__}')
  out = dict(record)
  if 'captions' in record:
    caps = record['captions']
    if isinstance(caps, str) or not isinstance(caps, (list, tuple)):
      raise BadRecord(BAD_CAPTION, 'captions is not a list')
    caps = [c for c in caps if isinstance(c, str) and c.strip()]
    if not caps:
      raise BadRecord(EMPTY_CAPTION)
    out['captions'] = caps
  elif 'caption' in record:
    cap = record['caption']
    if not isinstance(cap, str):
      raise BadRecord(BAD_CAPTION, f'caption of type {type(cap).__name__}')
    if not cap.strip():
      raise BadRecord(EMPTY_CAPTION)
  else:
    raise BadRecord(MISSING_CAPTION)
  image = record.get('image')
  if image is None or (isinstance(image, (bytes, bytearray)) and not image):
    raise BadRecord(MISSING_IMAGE)
  if decode:
    try:
      out['image'] = decode_image(image, min_pixels)
    except Exception as e:  # pylint: disable=broad-except
      raise BadRecord(CORRUPT_IMAGE, f'{type(e).__name__}: {e}') from None
  return out


_MAX_KNOWN_BAD = 1 << 16  # bad indices remembered per process


def _remove_dir(path: str, owner_pid: int):
  if os.getpid() != owner_pid:
    return
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(path, ignore_errors=True)


class CheckedSource:
  """Training-time guard over a record source: decode, validate, replace.

  ``checked[i]`` reads ``source[i]``, decodes its image (so the pipeline does
  not decode it again; JPEGs at a reduced DCT scale that keeps
  ``min_pixels``, see ``decode_image``) and checks its caption. When record ``i`` is bad
  (unreadable, undecodable image, missing/blank caption), ``checked[i]`` is
  the first good record after it, ``i+1, i+2, ...`` (wrapping around). The
  replacement depends only on the data, never on thread/worker timing or on
  where a run resumed, so ``pipeline.train_dataset`` stays deterministic and
  exactly resumable; the cost is that the good neighbour of a bad record
  appears twice in that epoch.

  Counting: every ``checked[i]`` call counts one record seen, and one bad
  record when record ``i`` itself is bad (records only probed as
  replacements are counted when they are requested themselves), so the bad
  fraction is exactly that of the records the run has read. Once
  ``bad > max_bad_fraction * max(seen, warmup)`` the read raises
  ``BadRecordError`` naming the shard and position of the record, and the
  shards with the most bad records. ``warmup`` keeps a few early bad records
  from stopping the run: up to ``max_bad_fraction * warmup`` are tolerated
  before the fraction applies.

  Counters live per process. ``stats()`` in the process that built the
  source also adds the counts of Grain worker processes (each copy of the
  source unpickled in a worker reports to a small file in a temporary
  directory on every bad record, every ``report_every`` reads and at least
  once a second while reading), so ``stats()`` is exact with
  ``num_workers=0``; with workers, bad counts are exact and ``seen`` lags by
  at most a second of reading. Each process applies the threshold to its
  own reads.
  """

  def __init__(self, source: Sequence[Any], max_bad_fraction: float = 0.01,
               warmup: int = 1000, decode: bool = True,
               report_every: int = 256, min_pixels: int = 0):
    if not 0 <= max_bad_fraction < 1:
      raise ValueError(f'max_bad_fraction {max_bad_fraction} not in [0, 1)')
    self.source = source
    self.max_bad_fraction = float(max_bad_fraction)
    self.warmup = int(warmup)
    self.decode = decode
    self.min_pixels = int(min_pixels)
    self.report_every = int(report_every)
    self._report_dir = tempfile.mkdtemp(prefix='prolip_bad_records_')
    weakref.finalize(self, _remove_dir, self._report_dir, os.getpid())
    self._report_file = None  # set in copies (worker processes)
    self._init_counters()

  def _init_counters(self):
    self._lock = threading.Lock()
    self._seen = 0
    self._bad = 0
    self._by_reason = collections.Counter()
    self._by_shard = collections.Counter()
    self._known_bad: dict[int, tuple[str, str]] = {}
    self._last_report = 0.0

  def __getstate__(self):
    state = dict(self.__dict__)
    for k in ('_lock', '_seen', '_bad', '_by_reason', '_by_shard',
              '_known_bad', '_last_report'):
      state.pop(k)
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_counters()
    self._report_file = os.path.join(
        self._report_dir, f'{os.getpid()}-{uuid.uuid4().hex[:8]}.json')

  def __len__(self) -> int:
    return len(self.source)

  def describe(self, index: int) -> tuple[str, int]:
    """(shard name, position) of record ``index``."""
    shard_of = getattr(self.source, 'shard_of', None)
    if shard_of is not None:
      return shard_of(index)
    return repr(self.source), int(index)

  def _read(self, index: int) -> dict:
    known = self._known_bad.get(index)
    if known is not None:  # do not decode a known-bad record again
      raise BadRecord(*known)
    try:
      return check_record(self.source[index], self.decode, self.min_pixels)
    except Exception as e:  # pylint: disable=broad-except
      if not isinstance(e, BadRecord):
        e = BadRecord(UNREADABLE, f'{type(e).__name__}: {e}')
      if len(self._known_bad) < _MAX_KNOWN_BAD:
        self._known_bad[index] = (e.reason, e.detail)
      raise e from None

  def __getitem__(self, index) -> dict:
    index = int(index)
    n = len(self.source)
    first_error = None
    for probe in range(n):
      j = (index + probe) % n
      try:
        record = self._read(j)
      except BadRecord as e:
        if probe == 0:
          first_error = e
          self._count(index, e)  # may raise BadRecordError
        continue
      if probe == 0:
        self._count(index, None)
      return record
    raise BadRecordError(f'every one of the {n} records of {self.source!r} '
                         f'is bad (record {index}: {first_error})')

  def _count(self, index: int, error: Optional[BadRecord]):
    with self._lock:
      self._seen += 1
      if error is not None:
        self._bad += 1
        self._by_reason[error.reason] += 1
        shard, pos = self.describe(index)
        self._by_shard[shard] += 1
      if self._report_file is not None:
        now = time.monotonic()
        if (error is not None or self._seen % self.report_every == 0 or
            now - self._last_report > 1.0):
          self._last_report = now
          self._write_report()
      if error is None or self._bad <= self.max_bad_fraction * max(
          self._seen, self.warmup):
        return
      worst = ', '.join(f'{s} ({c})' for s, c in
                        self._by_shard.most_common(3))
      seen, bad = self._seen, self._bad
    raise BadRecordError(
        f'{bad} of the {seen} training records read by process '
        f'{os.getpid()} are bad ({bad / seen:.2%}), more than '
        f'data.max_bad_fraction={self.max_bad_fraction:g}. Last bad record: '
        f'shard {shard} position {pos} (index {index}): {error}. Shards with '
        f'the most bad records: {worst}. Fix or drop those shards, or raise '
        'data.max_bad_fraction.')

  def _local_stats(self) -> dict:
    return {'seen': self._seen, 'bad': self._bad,
            'by_reason': dict(self._by_reason),
            'by_shard': dict(self._by_shard)}

  def _write_report(self):
    tmp = self._report_file + '.tmp'
    try:
      with open(tmp, 'w') as f:
        json.dump(self._local_stats(), f)
      os.replace(tmp, self._report_file)
    except OSError:
      pass  # the directory went away with its owner: nothing to report to

  def stats(self) -> dict:
    """Counts so far: ``{'seen', 'bad', 'bad_fraction', 'by_reason',
    'by_shard'}``, this process's plus its worker processes' reports."""
    with self._lock:
      total = self._local_stats()
    by_reason = collections.Counter(total['by_reason'])
    by_shard = collections.Counter(total['by_shard'])
    seen, bad = total['seen'], total['bad']
    try:
      names = os.listdir(self._report_dir)
    except OSError:
      names = []
    own = os.path.basename(self._report_file or '')
    for name in names:
      if not name.endswith('.json') or name == own:
        continue
      try:
        with open(os.path.join(self._report_dir, name)) as f:
          rep = json.load(f)
      except (OSError, ValueError):
        continue
      seen += rep['seen']
      bad += rep['bad']
      by_reason.update(rep['by_reason'])
      by_shard.update(rep['by_shard'])
    return {'seen': seen, 'bad': bad, 'bad_fraction': bad / max(seen, 1),
            'by_reason': dict(by_reason), 'by_shard': dict(by_shard)}

  def __repr__(self):
    return f'CheckedSource({self.source!r})'


# ----------------------------------------------------------------------------
# Captions for tokenizer training.


def record_captions(record: dict) -> list[str]:
  if 'captions' in record:
    caps = record['captions']
  else:
    caps = [record.get('caption')]
  return [c.strip() for c in caps if isinstance(c, str) and c.strip()]


def caption_corpus(source: Sequence[dict], max_sentences: int = 1_000_000,
                   ) -> list[str]:
  """Captions of up to ``max_sentences`` records spread evenly over the
  source (all of them when it is smaller), in record order. Unreadable
  records are skipped. Unwrap a ``CheckedSource`` first (its reads decode
  images; the raw source's do not)."""
  source = getattr(source, 'source', source)
  n = len(source)
  if n <= max_sentences:
    indices: Iterable[int] = range(n)
  else:
    indices = np.unique(np.linspace(0, n - 1, max_sentences).astype(np.int64))
  out = []
  for i in indices:
    try:
      out.extend(record_captions(source[int(i)]))
    except Exception:  # pylint: disable=broad-except
      continue
  return out
