"""An image folder plus a CSV / JSONL captions file -> array_record shards
(format in ``data.record_format``) of ``shard_size`` records each.

A missing images folder or captions file, a CSV without image and caption
columns, and captions that give no record at all are a ``ConversionError``;
bad records are skipped and counted as ``common`` says. The command line is
``tools/convert_folder.py``.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Iterator, Optional, Sequence

from prolip_jax import errors as user_errors
from prolip_jax.conversion import common
from prolip_jax.conversion.common import ConversionError
from prolip_jax.conversion.common import Counts
from prolip_jax.data import bad_records
from prolip_jax.data import record_format

IMAGE_COLUMNS = ('image', 'filepath', 'file', 'filename', 'path', 'image_path')
CAPTION_COLUMNS = ('caption', 'captions', 'text', 'title')


def _pick(row: dict, names: Sequence[str], what: str, path: str):
  for n in names:
    if n in row:
      return row[n]
  raise ConversionError(f'{path}: no {what} field; expected one of '
                        f'{list(names)}, got {_shown(row)}')


def _shown(names) -> str:
  """A few column or field names, each cut short (a binary file's 'header'
  can be one long line of bytes)."""
  names = sorted(str(n) for n in names)
  shown = [repr(n if len(n) <= 40 else n[:40] + '...') for n in names[:6]]
  more = f' and {len(names) - 6} more' if len(names) > 6 else ''
  return f'[{", ".join(shown)}{more}]'


def _csv_columns(path: str, fields: Optional[Sequence[str]]):
  """Raises ``ConversionError`` unless the CSV header ``fields`` has an image
  column and a caption column."""
  if not fields:
    raise ConversionError(f'{path} is empty: a CSV captions file needs a '
                          f'header with an image column {list(IMAGE_COLUMNS)} '
                          f'and a caption column {list(CAPTION_COLUMNS)}')
  missing = [what for what, names in (('image', IMAGE_COLUMNS),
                                      ('caption', CAPTION_COLUMNS))
             if not any(n in fields for n in names)]
  if missing:
    raise ConversionError(
        f'{path}: the CSV header has no {" and no ".join(missing)} column: '
        f'expected one of {list(IMAGE_COLUMNS)} and one of '
        f'{list(CAPTION_COLUMNS)}, got {_shown(fields)}')


def _is_utf8(text: str) -> bool:
  try:
    text.encode('utf-8')
  except UnicodeEncodeError:  # surrogate-escaped bytes that were not UTF-8
    return False
  return True


def read_captions_file(path: str, counts: Counts
                       ) -> Iterator[tuple[str, Optional[list[str]]]]:
  """(image path, captions or None when the line is malformed) per entry.

  CSV: a header with an image column (``image``/``filepath``/``file``/...)
  and a caption column (``caption``/``text``/``title``). JSONL: one object a
  line, ``{"image": ..., "caption": str}`` or ``{"image": ..., "captions":
  [str, ...]}``. Malformed JSONL lines are counted as ``bad_caption``; a
  CSV without those columns, or that is not CSV text, and a JSONL object
  without an image field raise ``ConversionError``.
  """
  if path.endswith('.csv') or path.endswith('.tsv'):
    with open(path, newline='', encoding='utf-8',
              errors='surrogateescape') as f:
      reader = csv.DictReader(f, delimiter='\t' if path.endswith('.tsv')
                              else ',')
      try:
        _csv_columns(path, reader.fieldnames)
        for row in reader:
          image = _pick(row, IMAGE_COLUMNS, 'image', path)
          caption = _pick(row, CAPTION_COLUMNS, 'caption', path)
          if caption is not None and not _is_utf8(caption):
            caption = caption.encode('utf-8', 'surrogateescape')  # a bad one
          yield image, [caption] if caption is not None else [None]
      except csv.Error as e:  # NUL bytes, a runaway quoted field
        raise ConversionError(f'{path} is not CSV text (line '
                              f'{reader.line_num}: {e})') from e
    return
  with open(path, 'rb') as f:
    for lineno, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      try:
        # A caption that is not UTF-8 is a bad record, not one to write
        # with replacement characters.
        obj = json.loads(raw.decode('utf-8'))
        if not isinstance(obj, dict):
          raise ValueError('not an object')
      except ValueError:
        counts.seen += 1
        counts.skip(bad_records.BAD_CAPTION, f'{path}:{lineno}')
        continue
      image = _pick(obj, IMAGE_COLUMNS, 'image', path)
      caps = obj.get('captions', obj.get('caption', obj.get('text')))
      if caps is None:
        yield image, [None]
      elif isinstance(caps, str):
        yield image, [caps]
      elif isinstance(caps, list) and caps:
        yield image, caps
      else:
        yield image, [None]


def entry_records(rel: str, image: Optional[bytes],
                  captions: Sequence[Optional[str]], max_record_bytes: int
                  ) -> Iterator[tuple[Optional[bytes], Optional[str]]]:
  """(serialized record, None) or (None, skip reason) per caption of one
  entry of a captions file (``read_captions_file``), ``image`` its bytes or
  None when unreadable: the one definition of a good folder record
  (``convert_folder`` and ``beam`` use it). The image is decoded
  once, not once per caption."""
  image_reason = None
  for caption in captions:
    if caption is not None and not isinstance(caption, str):
      yield None, bad_records.BAD_CAPTION
      continue
    data, reason = common.make_record(rel, image, caption, max_record_bytes,
                               image_reason)
    if reason:
      if reason in (bad_records.CORRUPT_IMAGE, bad_records.MISSING_IMAGE):
        image_reason = reason
      yield None, reason
      continue
    image_reason = image_reason or ''  # decoded fine once: trust it
    yield data, None


def shard_name(index: int) -> str:
  """The name of a folder conversion's ``index``-th output shard."""
  return f'{index:05d}{record_format.SUFFIX}'


def _numbered_writer(output_dir: str, index: int) -> record_format.ShardWriter:
  return record_format.ShardWriter(
      os.path.join(output_dir, shard_name(index)))


def convert_folder(images_dir: str, captions_path: str, output_dir: str,
                   shard_size: int = 10000,
                   max_record_bytes: int = common.DEFAULT_MAX_RECORD_BYTES
                   ) -> dict:
  """Images under ``images_dir`` + captions file -> ``OUT/00000.array_record``...

  One record per (image, caption); an image with several captions gives
  several records sharing its key (its path as written in the captions
  file). Skips are counted per record. Shards hold ``shard_size`` records.
  A missing captions file or images folder, a CSV without image and caption
  columns, and captions that give no record at all raise
  ``ConversionError``; then no shard is left half-written (finished ones
  keep their markers) and no ``summary.json`` is written.
  """
  if shard_size <= 0:
    raise user_errors.ConfigError(
        f'shard_size must be positive, not {shard_size}')
  if not os.path.isfile(captions_path):
    raise ConversionError(f'captions file {captions_path} '
                          f'{_missing_or(captions_path, "a folder")}')
  if not os.path.isdir(images_dir):
    raise ConversionError(f'images folder {images_dir} '
                          f'{_missing_or(images_dir, "a file")}')
  counts = Counts()
  shards: dict[str, dict] = {}
  writer, shard_index = None, 0

  def finish():
    nonlocal writer, shard_index
    if writer is not None:
      writer.close()
      name = os.path.basename(writer.path)
      shards[name] = {'records_written': writer.count}
      record_format.write_done_marker(writer.path, shards[name])
      writer, shard_index = None, shard_index + 1

  try:
    root = os.path.realpath(images_dir)
    for rel, captions in read_captions_file(captions_path, counts):
      full = os.path.realpath(os.path.join(root, str(rel)))
      image = None
      # Only files under images_dir: a captions file naming an absolute or
      # ../ path does not get to read the rest of the disk.
      if os.path.commonpath([root, full]) == root:
        try:
          with open(full, 'rb') as f:
            image = f.read()
        except OSError:
          pass
      for data, reason in entry_records(rel, image, captions,
                                        max_record_bytes):
        counts.seen += 1
        if reason:
          counts.skip(reason, rel)
          continue
        if writer is None:
          writer = _numbered_writer(output_dir, shard_index)
        writer.write(data)
        counts.written += 1
        if writer.count >= shard_size:
          finish()
    finish()
  except BaseException:
    if writer is not None:
      writer.abort()
    raise
  summary = folder_summary(counts, images_dir, captions_path, shards)
  common.write_summary(output_dir, summary)
  return summary


def folder_summary(counts: Counts, images_dir: str, captions_path: str,
                   shards: dict[str, dict]) -> dict:
  """The summary of a folder conversion from its tallies and its shards'
  ``{name: {'records_written': n}}``; raises ``ConversionError`` when no
  record was written."""
  summary = counts.as_dict(images=images_dir, captions=captions_path)
  if not counts.written:  # nothing was written, not even the output folder
    raise ConversionError(
        f'no records from captions file {captions_path} with images folder '
        f'{images_dir}: {common.why_none(summary, "it lists no image")}')
  summary['shards'] = dict(sorted(shards.items()))
  return summary


def _missing_or(path: str, other: str) -> str:
  """'does not exist', or 'is {other}' for an input path of the wrong
  kind."""
  return f'is {other}' if os.path.exists(path) else 'does not exist'
