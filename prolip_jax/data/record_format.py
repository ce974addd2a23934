"""The record format of image-text pairs in array_record shards, and its writer.

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

Reading shards for training: ``record_sources``; what makes a record
unusable and how training handles it: ``bad_records``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import msgpack

from prolip_jax.data import bad_records

SUFFIX = '.array_record'
DONE_SUFFIX = '.done'
SUMMARY_FILE = 'summary.json'  # written by a converter when it finishes
# group_size:1 makes every record its own chunk: O(1) random reads, no
# decompression of neighbours; JPEG bytes do not compress, so none is tried.
WRITER_OPTIONS = 'group_size:1,uncompressed'


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

  Raises ``bad_records.BadRecord(UNREADABLE)`` for bytes that are not a
  serialized example.
  """
  try:
    record = msgpack.unpackb(data, raw=False)
  except Exception as e:  # pylint: disable=broad-except
    raise bad_records.BadRecord(bad_records.UNREADABLE,
                                f'not msgpack: {e}') from None
  if not isinstance(record, dict):
    raise bad_records.BadRecord(
        bad_records.UNREADABLE,
        f'expected a map, got {type(record).__name__}')
  return record


def record_captions(record: dict) -> list[str]:
  """The non-blank captions of a record (``caption`` or ``captions``),
  stripped."""
  if 'captions' in record:
    caps = record['captions']
  else:
    caps = [record.get('caption')]
  return [c.strip() for c in caps if isinstance(c, str) and c.strip()]


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

