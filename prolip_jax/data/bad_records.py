"""Bad records: why a record is unusable, and the training-time guard.

The reasons (``REASONS``) name what is wrong with a record; converters count
skipped inputs under them and ``CheckedSource`` counts bad training records
under them too. ``check_record`` decodes and validates one record;
``CheckedSource`` wraps a record source for training: it decodes every
record, replaces bad ones deterministically (see its docstring), counts
them, and stops the run when too many are bad (``BadRecordError``).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Optional, Sequence

from prolip_jax import errors
from prolip_jax.data import image_decode

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


def check_image_bytes(data: bytes) -> Optional[str]:
  """None when ``image_decode.decode_rgb`` fully decodes ``data`` (simplejpeg
  or Pillow; Pillow has the last word on a JPEG simplejpeg rejects), else a
  skip reason."""
  if not data:
    return MISSING_IMAGE
  try:
    image_decode.decode_rgb(data)
  except Exception:  # pylint: disable=broad-except
    return CORRUPT_IMAGE
  return None


# ``check_record``'s ``decode`` for the DALI path: the header only.
HEADER = 'header'


def check_record(record: Any, decode: bool | str = True, min_pixels: int = 0
                 ) -> dict:
  """A usable copy of ``record`` (image decoded when ``decode``, JPEGs at a
  reduced scale keeping ``min_pixels``: ``image_decode.decode_rgb``) or raises
  ``BadRecord``. ``decode=HEADER`` (``data.decode='dali'``): the image stays
  encoded bytes and ``image_size`` is ``image_decode.header_size``'s
  ``(width, height, scale)`` from its header (an image array is bad: DALI
  decodes encoded images only). Captions: ``caption`` must be non-blank text; a ``captions``
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
  if decode == HEADER:
    out['image_size'] = _header_size(image, min_pixels)
  elif decode:
    try:
      out['image'] = image_decode.decode_rgb(image, min_pixels)
    except Exception as e:  # pylint: disable=broad-except
      raise BadRecord(CORRUPT_IMAGE, f'{type(e).__name__}: {e}') from None
  return out


def _header_size(image: Any, min_pixels: int) -> tuple[int, int, int]:
  """``check_record``'s ``image_size`` of ``decode=HEADER``."""
  if not isinstance(image, (bytes, bytearray, memoryview)):
    raise BadRecord(CORRUPT_IMAGE, "an image array, not encoded bytes: "
                    "data.decode='dali' decodes encoded images only")
  try:
    return image_decode.header_size(image, min_pixels)
  except Exception as e:  # pylint: disable=broad-except
    raise BadRecord(CORRUPT_IMAGE, f'{type(e).__name__}: {e}') from None


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
  ``min_pixels``, see ``image_decode.decode_rgb``) and checks its caption.
  When record ``i`` is bad (unreadable, undecodable image, missing/blank
  caption), ``checked[i]`` is the first good record after it, ``i+1, i+2,
  ...`` (wrapping around). The replacement depends only on the data, never
  on thread/worker timing or on where a run resumed, so
  ``pipeline.train_dataset`` stays deterministic and exactly resumable; the
  cost is that the good neighbour of a bad record appears twice in that
  epoch.

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
               warmup: int = 1000, decode: bool | str = True,
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
      reports = [self._local_stats()]
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
          reports.append(json.load(f))
      except (OSError, ValueError):
        continue
    return sum_stats(reports)


def sum_stats(reports) -> dict:
  """The ``CheckedSource.stats`` of several readers together (processes of
  one source, or the sources of a mixture): counts added, the bad fraction
  of the sums."""
  by_reason, by_shard = collections.Counter(), collections.Counter()
  seen = bad = 0
  for rep in reports:
    seen += rep['seen']
    bad += rep['bad']
    by_reason.update(rep['by_reason'])
    by_shard.update(rep['by_shard'])
  return {'seen': seen, 'bad': bad, 'bad_fraction': bad / max(seen, 1),
          'by_reason': dict(by_reason), 'by_shard': dict(by_shard)}

  def __repr__(self):
    return f'CheckedSource({self.source!r})'
