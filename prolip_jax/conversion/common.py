"""What the converters share (``webdataset``, ``image_folder`` and their
Beam forms in ``beam``): the error of an input they cannot convert, the verdict
on one record, the per-reason tallies and the ``summary.json`` they write.

Bad records never stop a conversion: an undecodable image, a missing or blank
caption, a caption that is not UTF-8 text, or a record above
``max_record_bytes`` is skipped and counted by reason (``bad_records.REASONS``).
Bad inputs do, with a ``ConversionError`` (one ``error:`` line on the command
line) naming the input. A conversion returns (and writes to
``OUT_DIR/summary.json``, only when it succeeded) a summary::

  {"records_written": int, "examples_seen": int, "skipped_total": int,
   "skipped": {reason: count}, "skipped_examples": {reason: [first keys]},
   "shards": {output shard: its own summary}, "errors": [str], ...}

This package imports neither JAX nor Grain, so worker processes start fast.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Optional

from prolip_jax import errors as user_errors
from prolip_jax.data import bad_records
from prolip_jax.data import record_format

DEFAULT_MAX_RECORD_BYTES = 8 << 20
SUMMARY_FILE = record_format.SUMMARY_FILE
_EXAMPLES_PER_REASON = 5


class ConversionError(user_errors.UserError, ValueError):
  """An input a converter cannot convert: missing, unreadable, without the
  needed columns, or giving no record at all (a ``ValueError`` for library
  callers)."""


class Counts:
  """Per-shard tallies, JSON-able via ``as_dict``."""

  def __init__(self):
    self.written = 0
    self.seen = 0
    self.skipped = collections.Counter()
    self.examples = collections.defaultdict(list)
    self.errors: list[str] = []

  def skip(self, reason: str, key: str):
    self.skipped[reason] += 1
    if len(self.examples[reason]) < _EXAMPLES_PER_REASON:
      self.examples[reason].append(key)

  def as_dict(self, **extra) -> dict:
    return dict(extra, records_written=self.written, examples_seen=self.seen,
                skipped={r: self.skipped.get(r, 0)
                         for r in bad_records.REASONS
                         if r != bad_records.UNREADABLE},
                skipped_total=sum(self.skipped.values()),
                skipped_examples=dict(self.examples), errors=self.errors)


def make_record(key: str, image: Optional[bytes], caption: Optional[str],
                max_record_bytes: int,
                image_reason: Optional[str] = None) -> tuple[Optional[bytes],
                                                             Optional[str]]:
  """(serialized record, None) or (None, skip reason). ``caption`` None means
  missing. ``image_reason`` is a verdict already reached on the image (None:
  not checked yet, '' : decodes fine), so an image with several captions is
  decoded once. Checks run cheapest first; the first failing one is the
  reason."""
  if image is None:
    return None, bad_records.MISSING_IMAGE
  if caption is None:
    return None, bad_records.MISSING_CAPTION
  caption = caption.strip()
  if not caption:
    return None, bad_records.EMPTY_CAPTION
  data = record_format.serialize_example(image, caption, key)
  if len(data) > max_record_bytes:
    return None, bad_records.TOO_LONG
  reason = image_reason if image_reason is not None else (
      bad_records.check_image_bytes(image))
  if reason:
    return None, reason
  return data, None


def write_summary(output_dir: str, summary: dict) -> str:
  path = os.path.join(output_dir, SUMMARY_FILE)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(summary, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
  return path


def merge_summaries(shards: dict[str, dict], **extra) -> dict:
  skipped = collections.Counter()
  examples: dict[str, list] = {}
  errors = []
  for s in shards.values():
    skipped.update(s['skipped'])
    for r, keys in s.get('skipped_examples', {}).items():
      examples.setdefault(r, []).extend(
          keys[:_EXAMPLES_PER_REASON - len(examples.get(r, []))])
    errors.extend(s.get('errors', []))
  return dict(
      extra,
      records_written=sum(s['records_written'] for s in shards.values()),
      examples_seen=sum(s['examples_seen'] for s in shards.values()),
      skipped={r: skipped.get(r, 0) for r in bad_records.REASONS
               if r != bad_records.UNREADABLE},
      skipped_total=sum(skipped.values()), skipped_examples=examples,
      errors=errors, shards=shards)


def why_none(summary: dict, empty: str) -> str:
  """Why a conversion wrote no record, in a few words; ``empty`` when it
  saw no example at all."""
  if not summary['examples_seen']:
    return empty
  reasons = ', '.join(f'{r} {n}' for r, n in summary['skipped'].items() if n)
  examples = next(iter(summary['skipped_examples'].values()), [])
  first = f'; e.g. {examples[0]!r}' if examples else ''
  seen = summary['examples_seen']
  return (f'{"all " if seen > 1 else ""}{plural(seen, "example")} skipped '
          f'({reasons}{first})')


def plural(n: int, noun: str) -> str:
  """``1 example``, ``2 examples``."""
  return f'{n} {noun}{"" if n == 1 else "s"}'


def print_summary(summary: dict, output: str):
  """Prints a conversion's summary (without its per-shard list) and where
  its whole ``summary.json`` lies in ``output``."""
  brief = {k: v for k, v in summary.items() if k != 'shards'}
  print(json.dumps(brief, indent=1, sort_keys=True), flush=True)
  print(f'summary: {os.path.join(output, SUMMARY_FILE)}', flush=True)


def add_common_args(parser):
  parser.add_argument('--output', required=True, help='output directory')
  parser.add_argument('--max_record_bytes', type=int,
                      default=DEFAULT_MAX_RECORD_BYTES,
                      help='skip serialized records larger than this')
