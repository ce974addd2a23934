"""Converters to array_record shards (format in ``record_format``).

* ``convert_webdataset``: webdataset / img2dataset tar shards, one output
  shard per input shard, streamed, parallel over shards, resumable.
* ``convert_folder``: an image folder plus a CSV / JSONL captions file.

Bad records never stop a conversion: an undecodable image, a missing or blank
caption, a caption that is not UTF-8 text, or a record above
``max_record_bytes`` is skipped and counted by reason (``bad_records.REASONS``).
Bad inputs do, with a ``ConversionError`` (one ``error:`` line on the command
line) naming the input: a missing images folder or captions file, a CSV
without image and caption columns, a tar that cannot be read to its end
(its output shard is not written and gets no ``.done`` marker), and inputs
that give no record at all. Both return (and write to
``OUT_DIR/summary.json``, only when the conversion succeeded) a summary::

  {"records_written": int, "examples_seen": int, "skipped_total": int,
   "skipped": {reason: count}, "skipped_examples": {reason: [first keys]},
   "shards": {output shard: its own summary}, "errors": [str], ...}

This module imports neither JAX nor Grain, so worker processes start fast.
The command lines are ``tools/convert_webdataset.py`` and
``tools/convert_folder.py``.
"""

from __future__ import annotations

import collections
import csv
import json
import multiprocessing
import os
import tarfile
import traceback
from typing import Iterator, Optional, Sequence

from prolip_jax import errors as user_errors
from prolip_jax.data import bad_records
from prolip_jax.data import record_format
from prolip_jax.data import record_sources

DEFAULT_MAX_RECORD_BYTES = 8 << 20
IMAGE_EXTS = ('jpg', 'jpeg', 'png', 'webp')
SUMMARY_FILE = record_format.SUMMARY_FILE
_EXAMPLES_PER_REASON = 5


class ConversionError(user_errors.UserError, ValueError):
  """An input a converter cannot convert: missing, unreadable, without the
  needed columns, or giving no record at all (a ``ValueError`` for library
  callers)."""


class CorruptTarError(ConversionError):
  """A tar shard that cannot be read to its end (truncated, not a tar)."""


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


# ----------------------------------------------------------------------------
# webdataset tars.


def _split_name(name: str) -> tuple[str, str]:
  """webdataset convention: key = path up to the basename's first dot."""
  d, base = os.path.split(name)
  stem, dot, ext = base.partition('.')
  return (os.path.join(d, stem) if d else stem), ext.lower() if dot else ''


def iter_tar_groups(path: str, fileobj=None
                    ) -> Iterator[tuple[str, dict[str, bytes]]]:
  """(key, {extension: bytes}) per example of a tar, streamed (``r|*``).

  Files of one example are consecutive, as webdataset writes them. A tar
  that cannot be read to its end (truncated, corrupt, not a tar) raises
  ``CorruptTarError`` after the examples read before the damage: its shard
  is incomplete, so the caller writes none of it. ``fileobj``, when given,
  is read instead of opening ``path`` (a stream from another file system;
  ``path`` then only names it).
  """
  key, files, count = None, {}, 0
  try:
    with tarfile.open(path if fileobj is None else None, mode='r|*',
                      fileobj=fileobj) as tar:
      for member in tar:
        if not member.isfile():
          continue
        k, ext = _split_name(member.name)
        if k.startswith('__') or os.path.basename(k).startswith('.'):
          continue  # tar metadata such as __index__ / ._mac files
        if k != key:
          if key is not None:
            yield key, files
            count += 1
          key, files = k, {}
        f = tar.extractfile(member)
        files[ext] = f.read() if f is not None else b''
  except (tarfile.TarError, OSError, EOFError) as e:
    where = f'after {_count(count, "example")}' if count else (
        'before any example')
    raise CorruptTarError(
        f'{path} is truncated or not a tar ({type(e).__name__}: '
        f'{" ".join(str(e).split()) or "no message"}, {where})') from e
  if key is not None:
    yield key, files


def _caption_from(files: dict[str, bytes]) -> tuple[Optional[str],
                                                     Optional[str]]:
  """(caption or None, error reason or None) from ``.txt`` else ``.json``."""
  if 'txt' in files:
    try:
      return files['txt'].decode('utf-8'), None
    except UnicodeDecodeError:
      return None, bad_records.BAD_CAPTION
  if 'json' in files:
    try:
      meta = json.loads(files['json'])
    except ValueError:
      return None, bad_records.BAD_CAPTION
    if not isinstance(meta, dict) or meta.get('caption') is None:
      return None, None
    if not isinstance(meta['caption'], str):
      return None, bad_records.BAD_CAPTION
    return meta['caption'], None
  return None, None


def example_record(key: str, files: dict[str, bytes],
                   max_record_bytes: int) -> tuple[Optional[bytes],
                                                   Optional[str]]:
  """(serialized record, None) or (None, skip reason) for one example of a
  tar, ``files`` as ``iter_tar_groups`` gives them: the one definition of a
  good webdataset record (``convert_tar`` and ``beam_convert`` use it)."""
  image = next((files[e] for e in IMAGE_EXTS if e in files), None)
  caption, bad = _caption_from(files)
  if bad:
    return None, bad
  return make_record(key, image, caption, max_record_bytes)


def write_tar_records(tar_path: str, writer, max_record_bytes: int,
                      fileobj=None) -> Counts:
  """Writes the good records of one tar to ``writer`` (``.write(bytes)``),
  in the tar's order; returns the tallies. Raises ``CorruptTarError`` for a
  tar that cannot be read to its end (the caller drops what was written)."""
  counts = Counts()
  for key, files in iter_tar_groups(tar_path, fileobj):
    counts.seen += 1
    data, reason = example_record(key, files, max_record_bytes)
    if reason:
      counts.skip(reason, key)
      continue
    writer.write(data)
    counts.written += 1
  return counts


def convert_tar(tar_path: str, out_path: str,
                max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict:
  """One webdataset tar -> one array_record shard plus its ``.done``.

  A tar that cannot be read to its end raises ``CorruptTarError`` and
  leaves neither the shard nor its marker (nor the half-written ``.tmp``).
  """
  writer = record_format.ShardWriter(out_path)
  try:
    counts = write_tar_records(tar_path, writer, max_record_bytes)
  except BaseException:
    writer.abort()
    raise
  writer.close()
  summary = counts.as_dict(input=tar_path, output=out_path)
  record_format.write_done_marker(out_path, summary)
  return summary


def failed_shard_summary(tar_path: str, out_path: str, error: Exception,
                         tb: Optional[str] = None) -> dict:
  """The summary of a tar that could not be converted: its error line (the
  user's error, or the bug with its traceback ``tb``)."""
  c = Counts()
  found = user_errors.user_error_of(error)
  if found is not None:  # the user's to fix (a corrupt tar, disk full)
    c.errors.append(user_errors.message(found))
  else:  # a bug: its traceback (from the worker process) goes with it
    c.errors.append(f'{tar_path}: failed: {type(error).__name__}: {error}')
  return c.as_dict(input=tar_path, output=out_path, failed=True,
                   user_error=found is not None,
                   traceback=None if found is not None else tb)


def _convert_tar_job(args) -> dict:
  tar_path, out_path, max_record_bytes = args
  try:
    return convert_tar(tar_path, out_path, max_record_bytes)
  except Exception as e:  # pylint: disable=broad-except
    # One shard does not stop the others: it is reported, with no marker, so
    # a re-run retries it, and the conversion fails once all have run.
    return failed_shard_summary(tar_path, out_path, e, traceback.format_exc())


def output_name(tar_path: str) -> str:
  base = os.path.basename(tar_path)
  for ext in ('.tar.gz', '.tgz', '.tar'):
    if base.endswith(ext):
      base = base[:-len(ext)]
      break
  return base + record_format.SUFFIX


def check_distinct_names(names: Sequence[str]):
  """Raises ``ConversionError`` when input shards share an output name."""
  dup = [n for n, c in collections.Counter(names).items() if c > 1]
  if dup:
    raise ConversionError(f'input shards share output names {dup[:5]}: give '
                          'them distinct file names')


def convert_webdataset(inputs: str | Sequence[str], output_dir: str,
                       workers: int = 1,
                       max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                       verbose: bool = False) -> dict:
  """webdataset tars (brace pattern / glob / list) -> array_record shards.

  Output ``OUT/NAME.array_record`` per input ``NAME.tar``. Shards whose
  output and ``.done`` marker exist are not redone (their stored summaries
  are merged in). ``workers`` > 1 converts shards in parallel processes.

  Every shard is tried; then ``ConversionError`` is raised (and no
  ``summary.json`` written) when a shard failed (a corrupt tar: no output
  shard, no marker; the others are kept and a re-run does only what is
  missing) or when no record was written at all.
  """
  if isinstance(inputs, str):
    inputs = [inputs]
  tars = []
  for pattern in inputs:
    if os.path.isdir(pattern):
      pattern = os.path.join(pattern, '*.tar')
    tars.extend(record_sources.expand_paths(pattern))
  names = [output_name(t) for t in tars]
  check_distinct_names(names)
  created = not os.path.exists(output_dir)
  os.makedirs(output_dir, exist_ok=True)
  try:
    return _convert_shards(tars, names, inputs, output_dir, workers,
                           max_record_bytes, verbose)
  except ConversionError:
    if created and not os.listdir(output_dir):
      os.rmdir(output_dir)  # ours, and nothing came of it
    raise


def _convert_shards(tars: list[str], names: list[str], inputs: Sequence[str],
                    output_dir: str, workers: int, max_record_bytes: int,
                    verbose: bool) -> dict:
  """The body of ``convert_webdataset`` once its inputs are known."""
  shards: dict[str, dict] = {}
  todo = []
  for tar_path, name in zip(tars, names):
    out = os.path.join(output_dir, name)
    done = record_format.read_done_marker(out)
    if done is not None:
      shards[name] = dict(done, resumed=True)
    else:
      todo.append((tar_path, out, max_record_bytes))
  def report(r):
    shards[os.path.basename(r['output'])] = r
    if verbose:
      print(f"[{len(shards)}/{len(tars)}] {r['input']}: "
            f"{r['records_written']} records, {r['skipped_total']} skipped"
            f"{' FAILED' if r.get('failed') else ''}", flush=True)

  if workers > 1 and len(todo) > 1:
    # spawn: workers import only this module (no JAX), safe with threads.
    ctx = multiprocessing.get_context('spawn')
    with ctx.Pool(min(workers, len(todo))) as pool:
      for r in pool.imap_unordered(_convert_tar_job, todo):
        report(r)
  else:
    for job in todo:
      report(_convert_tar_job(job))
  summary = webdataset_summary(shards, inputs, len(tars), len(todo))
  write_summary(output_dir, summary)
  return summary


def webdataset_summary(shards: dict[str, dict], inputs: Sequence[str],
                       total: int, converted: int) -> dict:
  """The summary of a webdataset conversion from its shards' summaries
  (keyed by output shard name; ``converted`` of the ``total`` were
  converted by this run, the others resumed). Raises as
  ``convert_webdataset`` does when a shard failed or no record was
  written."""
  shards = dict(sorted(shards.items()))
  summary = merge_summaries(
      shards, input_shards=total, shards_converted=converted,
      shards_resumed=total - converted,
      shards_failed=sum(bool(s.get('failed')) for s in shards.values()))
  _check_shards(shards, total)
  if summary['records_written'] == 0:
    raise ConversionError(
        f'no records from {", ".join(inputs)} '
        f'({_count(total, "tar shard")}): '
        f'{_why_none(summary, "they hold no image/caption example")}')
  return summary


def _check_shards(shards: dict[str, dict], total: int):
  """Raises for the shards that failed: ``RuntimeError`` with the worker's
  traceback when one failed through a bug, else ``ConversionError`` naming
  the first corrupt input."""
  failed = [s for s in shards.values() if s.get('failed')]
  if not failed:
    return
  bugs = [s for s in failed if not s.get('user_error')]
  if bugs:
    raise RuntimeError(f'{len(bugs)} of {total} input shards failed; the '
                       f'first, {bugs[0]["input"]}:\n{bugs[0]["traceback"]}')
  more = f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''
  raise ConversionError(
      f'{len(failed)} of {total} input shards not converted: '
      f'{failed[0]["errors"][0]}{more}; no output shard or '
      f'{record_format.DONE_SUFFIX} marker was written for '
      f'{"them" if len(failed) > 1 else "it"} (converted: '
      f'{_count(total - len(failed), "other shard")}); once that is fixed '
      '(or the input left out), the same command converts only what is '
      'missing')


def _why_none(summary: dict, empty: str) -> str:
  """Why a conversion wrote no record, in a few words; ``empty`` when it
  saw no example at all."""
  if not summary['examples_seen']:
    return empty
  reasons = ', '.join(f'{r} {n}' for r, n in summary['skipped'].items() if n)
  examples = next(iter(summary['skipped_examples'].values()), [])
  first = f'; e.g. {examples[0]!r}' if examples else ''
  seen = summary['examples_seen']
  return (f'{"all " if seen > 1 else ""}{_count(seen, "example")} skipped '
          f'({reasons}{first})')


def _count(n: int, noun: str) -> str:
  """``1 example``, ``2 examples``."""
  return f'{n} {noun}{"" if n == 1 else "s"}'


# ----------------------------------------------------------------------------
# Image folder + captions file.

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
  (``convert_folder`` and ``beam_convert`` use it). The image is decoded
  once, not once per caption."""
  image_reason = None
  for caption in captions:
    if caption is not None and not isinstance(caption, str):
      yield None, bad_records.BAD_CAPTION
      continue
    data, reason = make_record(rel, image, caption, max_record_bytes,
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
                   max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict:
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
  write_summary(output_dir, summary)
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
        f'{images_dir}: {_why_none(summary, "it lists no image")}')
  summary['shards'] = dict(sorted(shards.items()))
  return summary


def _missing_or(path: str, other: str) -> str:
  """'does not exist', or 'is {other}' for an input path of the wrong
  kind."""
  return f'is {other}' if os.path.exists(path) else 'does not exist'


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
