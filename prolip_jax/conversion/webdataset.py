"""webdataset / img2dataset tar shards -> array_record shards (format in
``data.record_format``): one output shard per input shard, streamed,
parallel over shards, resumable.

A tar that cannot be read to its end (cut inside a member, or on a member
boundary: no end-of-archive marker) is a ``CorruptTarError``: its output
shard is not written and gets no ``.done`` marker; the other tars are
converted, then the conversion fails naming it, and a re-run converts only
what is missing. Inputs that give no record at all are a ``ConversionError``
too. Records are judged, counted and summarised as ``common`` says. The
command line is ``tools/convert_webdataset.py``.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import tarfile
import traceback
from typing import Iterator, Optional, Sequence

from prolip_jax import errors as user_errors
from prolip_jax.conversion import common
from prolip_jax.conversion.common import ConversionError
from prolip_jax.conversion.common import Counts
from prolip_jax.data import bad_records
from prolip_jax.data import record_format
from prolip_jax.data import record_sources

IMAGE_EXTS = ('jpg', 'jpeg', 'png', 'webp')


class CorruptTarError(ConversionError):
  """A tar shard that cannot be read to its end (truncated, not a tar)."""


def _split_name(name: str) -> tuple[str, str]:
  """webdataset convention: key = path up to the basename's first dot."""
  d, base = os.path.split(name)
  stem, dot, ext = base.partition('.')
  return (os.path.join(d, stem) if d else stem), ext.lower() if dot else ''


def _end_watching_tarinfo() -> type:
  """A ``TarInfo`` class that remembers how the last header read ended
  (``last_error``: None for a member, else tarfile's ``HeaderError``).

  tarfile ends an archive quietly at a zero block (the end-of-archive
  marker), but also at no block at all, a block cut short or a block of
  garbage: a tar cut on a member boundary reads as a whole one. Only the
  header that ended it tells them apart."""

  class EndWatchingTarInfo(tarfile.TarInfo):
    last_error: Optional[Exception] = None

    @classmethod
    def fromtarfile(cls, tar):
      try:
        info = super().fromtarfile(tar)
      except tarfile.HeaderError as e:
        EndWatchingTarInfo.last_error = e
        raise
      EndWatchingTarInfo.last_error = None
      return info

  return EndWatchingTarInfo


def _check_end_marker(watched: type):
  """Raises ``tarfile.ReadError`` unless the archive that ``watched``
  (``_end_watching_tarinfo``) read ended at its end-of-archive marker. One
  zero block is enough (tarfile and GNU tar stop there; every member before
  it is whole), though writers add two."""
  last = watched.last_error
  if isinstance(last, tarfile.EOFHeaderError):
    return
  if last is None or isinstance(last, (tarfile.EmptyHeaderError,
                                       tarfile.TruncatedHeaderError)):
    raise tarfile.ReadError('no end-of-archive marker: cut short after a '
                            'member or inside the next header')
  raise tarfile.ReadError(f'{last} where the next member or the '
                          'end-of-archive marker should be')


def iter_tar_groups(path: str, fileobj=None
                    ) -> Iterator[tuple[str, dict[str, bytes]]]:
  """(key, {extension: bytes}) per example of a tar, streamed (``r|*``).

  Files of one example are consecutive, as webdataset writes them. A tar
  that cannot be read to its end (truncated, corrupt, not a tar), or that
  ends without its end-of-archive marker (cut on a member boundary), raises
  ``CorruptTarError`` after the examples read before the damage: its shard
  is incomplete, so the caller writes none of it. ``fileobj``, when given,
  is read instead of opening ``path`` (a stream from another file system;
  ``path`` then only names it).
  """
  key, files, count = None, {}, 0
  watched = _end_watching_tarinfo()
  try:
    with tarfile.open(path if fileobj is None else None, mode='r|*',
                      fileobj=fileobj, tarinfo=watched) as tar:
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
      _check_end_marker(watched)
  except (tarfile.TarError, OSError, EOFError) as e:
    where = f'after {common.plural(count, "example")}' if count else (
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
  good webdataset record (``convert_tar`` and ``beam`` use it)."""
  image = next((files[e] for e in IMAGE_EXTS if e in files), None)
  caption, bad = _caption_from(files)
  if bad:
    return None, bad
  return common.make_record(key, image, caption, max_record_bytes)


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
                max_record_bytes: int = common.DEFAULT_MAX_RECORD_BYTES
                ) -> dict:
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
                       max_record_bytes: int = common.DEFAULT_MAX_RECORD_BYTES,
                       verbose: bool = False) -> dict:
  """webdataset tars (brace pattern / glob / list) -> array_record shards.

  Output ``OUT/NAME.array_record`` per input ``NAME.tar``. Shards whose
  output and ``.done`` marker exist are not redone (their stored summaries
  are merged in). ``workers`` > 1 converts shards in parallel processes.

  Every shard is tried; then ``ConversionError`` is raised (and no
  ``summary.json`` written) when a shard failed (a corrupt tar: no output
  shard, no marker; the others are kept and a re-run does only what is
  missing) or when no record was written at all. A failed conversion
  keeps no shard that holds no record (``empty_shards``), and removes the
  output folder when it made it and left it empty.
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
  except BaseException:
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
  try:
    summary = webdataset_summary(shards, inputs, len(tars), len(todo))
  except Exception:
    for name in empty_shards(shards):
      out = os.path.join(output_dir, name)
      os.remove(out + record_format.DONE_SUFFIX)  # the marker first
      os.remove(out)
    raise
  common.write_summary(output_dir, summary)
  return summary


def empty_shards(shards: dict[str, dict]) -> list[str]:
  """The names of the shards (converted or resumed) that hold no record:
  a conversion that fails removes them and their ``.done`` markers, so that
  a re-run converts their inputs again (likely the ones being fixed)
  instead of resuming them as done. Shards with records stay done."""
  return [name for name, s in shards.items()
          if not s.get('failed') and not s['records_written']]


def webdataset_summary(shards: dict[str, dict], inputs: Sequence[str],
                       total: int, converted: int) -> dict:
  """The summary of a webdataset conversion from its shards' summaries
  (keyed by output shard name; ``converted`` of the ``total`` were
  converted by this run, the others resumed). Raises as
  ``convert_webdataset`` does when a shard failed or no record was
  written."""
  shards = dict(sorted(shards.items()))
  summary = common.merge_summaries(
      shards, input_shards=total, shards_converted=converted,
      shards_resumed=total - converted,
      shards_failed=sum(bool(s.get('failed')) for s in shards.values()))
  _check_shards(shards, total)
  if summary['records_written'] == 0:
    raise ConversionError(
        f'no records from {", ".join(inputs)} '
        f'({common.plural(total, "tar shard")}): '
        f'{common.why_none(summary, "they hold no image/caption example")}')
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
      f'{common.plural(total - len(failed), "other shard")}); once that is '
      'fixed (or the input left out), the same command converts only what '
      'is missing')
