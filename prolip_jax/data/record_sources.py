"""Record sources for training: array_record shards and TFDS datasets.

``ArrayRecordSource(glob)`` and ``TfdsSource`` are random-access sequences of
record dicts (``record_format``) for ``pipeline.train_dataset``;
``bad_records.CheckedSource`` wraps either for training. ``expand_paths``
turns globs, brace patterns and lists into shard paths; ``caption_corpus``
samples captions for tokenizer training.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import glob as glob_lib
import os
import re
import sys
from typing import Iterable, Optional, Sequence

import numpy as np

from prolip_jax import errors
from prolip_jax.storage import paths
from prolip_jax.data import record_format
from prolip_jax.data.bad_records import BAD_CAPTION
from prolip_jax.data.bad_records import BadRecord
from prolip_jax.data.bad_records import MISSING_CAPTION
from prolip_jax.data.bad_records import MISSING_IMAGE

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
    paths.require_local(item, 'data path')
    for pattern in expand_braces(os.path.expanduser(item)):
      if os.path.isdir(pattern):
        pattern = os.path.join(pattern, '*' + record_format.SUFFIX)
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
    for line in record_format.incomplete_conversions(paths):
      print(f'warning: {line}', file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(min(16, len(paths))) as pool:
      counts = list(pool.map(record_format.num_records, paths))
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
    return record_format.parse_example(raw) if self.parse else raw

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
  """A prepared TFDS data set as a random-access source (the image
  feature left encoded). Raises ``errors.DatasetUnavailableError`` naming
  the data set and how to prepare it, rather than letting TFDS start a
  download (``tfds.data_source`` would download and prepare it)."""
  if data_dir:
    paths.require_local(data_dir, 'TFDS data_dir')
  try:
    tfds = import_tfds()
  except ImportError as e:
    raise errors.DatasetUnavailableError(str(e)) from e
  try:
    # A prepared copy is read from its files; the builder's code (some
    # builders need TensorFlow) only runs when there is none.
    builder = tfds.builder(name, data_dir=data_dir or None)
  except tfds.core.DatasetNotFoundError as e:
    raise errors.DatasetUnavailableError(
        f'TFDS has no data set {name!r}') from e
  except ImportError as e:
    raise errors.DatasetUnavailableError(
        f'TFDS data set {name} is not prepared under '
        f'{data_dir or "~/tensorflow_datasets"} (its builder needs '
        f'{e.name or "TensorFlow"}): '
        "pip install -e '.[eval]', then `tfds build "
        f'{name} --data_dir DIR --file_format=array_record`') from e
  if not builder.is_prepared():
    manual = (' (ImageNet: put ILSVRC2012_img_val.tar in DIR/downloads/manual '
              'first)' if name.startswith('imagenet2012') else '')
    raise errors.DatasetUnavailableError(
        f'TFDS data set {name} is not prepared under {builder.data_dir}: '
        f'prepare it with `tfds build {name} --data_dir DIR '
        f'--file_format=array_record`{manual}, then pass DIR as '
        'data.tfds_data_dir (training data) or eval.tfds_data_dir '
        '(evaluators)')
  splits = builder.info.splits
  if splits and split not in splits:
    raise errors.DatasetUnavailableError(
        f'TFDS data set {name} has no split {split!r} (has '
        f'{", ".join(sorted(splits))})')
  # Images stay encoded: decoded (and checked) by our own code.
  decoders = ({image_key: tfds.decode.SkipDecoding()} if '/' not in image_key
              else None)
  try:
    return builder.as_data_source(split, decoders=decoders)
  except (NotImplementedError, ValueError, FileNotFoundError) as e:
    raise errors.DatasetUnavailableError(
        f'TFDS data set {name} under {builder.data_dir} cannot be read at '
        f'random ({e}); it needs array_record files: `tfds build {name} '
        '--file_format=array_record`') from e


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
      out.extend(record_format.record_captions(source[int(i)]))
    except Exception:  # pylint: disable=broad-except
      continue
  return out
