"""The converters of ``webdataset`` and ``image_folder`` as Apache Beam
pipelines.

The same inputs (webdataset tars; an image folder plus a CSV / JSONL
captions file), the same array_record shards, the same per-reason skip
counts and the same ``summary.json`` as ``webdataset.convert_webdataset``
and ``image_folder.convert_folder``, on any Beam runner: the DirectRunner on
one machine, Dataflow, Flink or Spark on many (flags in docs/data.md). A
record is judged by the same functions (``webdataset.example_record``,
``image_folder.entry_records``), so there is one definition of a good record.

Determinism: the output is a pure function of the input, never of worker
scheduling or retries.

* Tars: one output shard per input tar (``webdataset.output_name``), its
  records in the tar's order, as the one-machine converter writes them. A
  tar is the unit of work (a bundle element): at web scale there are far
  more tars than workers (DataComp-1B: ~128k tars of 10k pairs), and moving
  whole records through the runner's shuffle would cost more than it saves.
* Folder: record ``r`` of the captions file's good records (file order,
  then caption order) goes to shard ``r // shard_size``. Entries are checked
  in parallel, grouped in blocks of ``_BLOCK`` entries, and each block's good
  records are ranked after the good records of the blocks before it.

Retries: every shard is written whole by one step, first to a staging name
under ``OUT/.beam-staging-<uuid>/`` (a local file for remote outputs, copied
up), then renamed onto its final name, then its ``.done`` marker; a retried
bundle (Beam retries failed ones; Dataflow four times) writes it again and
the rename overwrites, so no record is duplicated or lost. The driver
removes the staging folders and writes ``summary.json`` once the pipeline
has finished. A re-run of a tar conversion skips the tars whose shard and
``.done`` marker exist, as ``convert_webdataset`` does.

Paths go through Beam's own file systems (``FileSystems``): local disk,
``gs://`` (``apache-beam[gcp]``), ``s3://`` (``apache-beam[aws]``). The
folder layout's captions file is read by the driver and must be local; its
images may be remote.

Beam is optional (``pip install 'prolip_jax[beam]'``) and imported here
only when a pipeline is built (``require_beam``).
"""

from __future__ import annotations

import contextlib
import glob as glob_lib
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Optional, Sequence

from prolip_jax import errors
from prolip_jax.conversion import common
from prolip_jax.conversion import image_folder
from prolip_jax.conversion import webdataset
from prolip_jax.data import record_format
from prolip_jax.data import record_sources

STAGING_PREFIX = '.beam-staging-'
_PENDING_PREFIX = '.beam-summary-'
_BLOCK = 1000  # captions-file entries ranked together (folder layout)
INSTALL_HINT = "pip install 'prolip_jax[beam]'"


class BeamMissingError(errors.UserError, ImportError):
  """apache-beam is not installed."""


def require_beam():
  """The ``apache_beam`` module, or ``BeamMissingError`` naming the
  install command."""
  try:
    import apache_beam  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise BeamMissingError(
        f'apache-beam is not installed: {INSTALL_HINT} (docs/data.md: '
        'beside the pinned reference versions it needs its own venv)'
    ) from e
  return apache_beam


def _filesystems():
  from apache_beam.io.filesystems import FileSystems  # pylint: disable=g-import-not-at-top
  return FileSystems


def _is_local(path: str) -> bool:
  return '://' not in path


def _join(folder: str, name: str) -> str:
  return _filesystems().join(folder, name)


# ----------------------------------------------------------------------------
# Writing a file whole, whatever the file system.


def _write_bytes(path: str, data: bytes):
  """``data`` at ``path``, whole: a staged copy renamed onto it."""
  fs = _filesystems()
  folder, name = fs.split(path)
  staged = _join(_join(folder, STAGING_PREFIX + uuid.uuid4().hex), name)
  if _is_local(path):
    os.makedirs(os.path.dirname(staged), exist_ok=True)
  with fs.create(staged, mime_type='application/octet-stream') as f:
    f.write(data)
  fs.rename([staged], [path])
  _remove_staging(fs.split(staged)[0])


def _write_json(path: str, obj: Any):
  _write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def _read_json(path: str) -> Any:
  with _filesystems().open(path) as f:
    return json.loads(f.read())


def _remove_staging(folder: str):
  if _is_local(folder):
    shutil.rmtree(folder, ignore_errors=True)
    return
  fs = _filesystems()
  found = fs.match([folder + '/**'])[0].metadata_list
  if found:
    fs.delete([m.path for m in found])


@contextlib.contextmanager
def _staged_shard(dest: str):
  """A ``ShardWriter`` whose shard becomes ``dest`` when the block exits
  without error (renamed onto it, overwriting a shard an earlier attempt
  left); on error nothing reaches ``dest``."""
  fs = _filesystems()
  folder, name = fs.split(dest)
  staging = _join(folder, STAGING_PREFIX + uuid.uuid4().hex)
  local_dir = staging if _is_local(dest) else tempfile.mkdtemp(
      prefix='prolip_beam_')
  writer = record_format.ShardWriter(os.path.join(local_dir, name))
  try:
    try:
      yield writer
    except BaseException:
      writer.abort()
      raise
    writer.close()
    staged = _join(staging, name)
    if not _is_local(dest):  # copy the finished shard up, then rename
      with open(writer.path, 'rb') as src, fs.create(
          staged, mime_type='application/octet-stream') as dst:
        shutil.copyfileobj(src, dst, 4 << 20)
    fs.rename([staged], [dest])
  finally:
    shutil.rmtree(local_dir, ignore_errors=True)
    if not _is_local(dest):
      _remove_staging(staging)


class FailOnce:
  """A fault for tests: the first attempt of each tar (or folder shard)
  that reaches ``stage`` (``'writing'``: mid-shard; ``'committed'``: shard
  renamed, no ``.done`` yet; ``'done'``: all written, result not yet
  returned) fails, by an exception (``kill=False``: the runner retries the
  bundle) or by ending the worker process (``kill=True``). A marker file in
  ``marker_dir`` per item remembers the first attempt across processes."""

  def __init__(self, marker_dir: str, stage: str, kill: bool = False):
    self.marker_dir = marker_dir
    self.stage = stage
    self.kill = kill

  def __call__(self, stage: str, item: str):
    if stage != self.stage:
      return
    marker = os.path.join(self.marker_dir,
                          f'{stage}-{os.path.basename(item)}.failed')
    try:
      with open(marker, 'x'):
        pass
    except FileExistsError:
      return  # failed once already: this is the retry
    if self.kill:
      os._exit(3)  # pylint: disable=protected-access
    raise RuntimeError(f'planted fault at {stage} of {item}')


class _FaultyWriter:
  """Calls ``fault('writing', item)`` after the first record is written."""

  def __init__(self, writer, fault, item):
    self._writer, self._fault, self._item = writer, fault, item

  def write(self, data: bytes):
    self._writer.write(data)
    if self._writer.count == 1:
      self._fault('writing', self._item)


def _no_fault(stage: str, item: str):
  del stage, item


# ----------------------------------------------------------------------------
# Webdataset tars.


def expand_inputs(inputs: Sequence[str]) -> list[str]:
  """Tar paths from brace patterns, globs and folders (their ``*.tar``),
  local or remote, each pattern's matches sorted."""
  fs = _filesystems()
  tars = []
  for pattern in inputs:
    for path in record_sources.expand_braces(pattern):
      if _is_local(path):
        path = os.path.expanduser(path)
        if os.path.isdir(path):
          path = os.path.join(path, '*.tar')
      elif path.endswith('/'):
        path += '*.tar'
      if glob_lib.has_magic(path):
        found = sorted(m.path for m in fs.match([path])[0].metadata_list)
        if not found:
          raise common.ConversionError(f'no tar shards match {path!r}')
        tars.extend(found)
      elif fs.exists(path):
        tars.append(path)
      else:
        raise common.ConversionError(f'no such tar shard: {path}')
  return tars


def _existing_names(folder: str) -> set[str]:
  fs = _filesystems()
  if _is_local(folder):
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()
  found = fs.match([_join(folder, '*')])[0].metadata_list
  return {fs.split(m.path)[1] for m in found}


def _resumed_summary(out_path: str) -> dict:
  return dict(_read_json(out_path + record_format.DONE_SUFFIX), resumed=True)


class _ConvertTar:
  """tar path -> its shard written whole, plus ``.done``; yields the shard's
  summary (``webdataset.convert_tar``'s, or its failure's for a tar that
  cannot be read to its end). Wrapped in a ``beam.DoFn`` by
  ``_convert_tar_fn``."""

  def __init__(self, output_dir: str, max_record_bytes: int,
               fault: Optional[Callable[[str, str], None]]):
    self.output_dir = output_dir
    self.max_record_bytes = max_record_bytes
    self.fault = fault or _no_fault

  def __call__(self, tar_path: str) -> dict:
    fs = _filesystems()
    from apache_beam.io.filesystem import CompressionTypes  # pylint: disable=g-import-not-at-top
    out = _join(self.output_dir, webdataset.output_name(tar_path))
    try:
      with _staged_shard(out) as writer:
        # Raw bytes: tarfile's 'r|*' undoes a .tar.gz's compression itself.
        with fs.open(tar_path,
                     compression_type=CompressionTypes.UNCOMPRESSED) as f:
          counts = webdataset.write_tar_records(
              tar_path, _FaultyWriter(writer, self.fault, tar_path),
              self.max_record_bytes, fileobj=f)
    except webdataset.CorruptTarError as e:
      # The user's to fix: reported in the summary (no shard, no marker) and
      # the conversion fails once every tar has run. Anything else (a bug,
      # a transient I/O error) raises, and the runner retries the bundle.
      return webdataset.failed_shard_summary(tar_path, out, e)
    self.fault('committed', tar_path)
    summary = counts.as_dict(input=tar_path, output=out)
    _write_json(out + record_format.DONE_SUFFIX, summary)
    self.fault('done', tar_path)
    return summary


def _write_results(results: list, path: str):
  _write_json(path, results)


def _pipeline(pipeline_args: Sequence[str]):
  """An empty ``beam.Pipeline`` of Beam's options ``pipeline_args``, made
  before any output: Beam checks the options (the runner's name, the
  options that runner needs) here, and its refusal is a ``ConfigError``."""
  beam = require_beam()
  from apache_beam.options.pipeline_options import PipelineOptions  # pylint: disable=g-import-not-at-top
  try:
    return beam.Pipeline(options=PipelineOptions(list(pipeline_args)))
  except ValueError as e:
    raise errors.ConfigError(
        f'Beam options {" ".join(pipeline_args) or "(none)"}: '
        f'{" ".join(str(e).split())}') from e


def _run(pipeline, build: Callable[[Any], None]):
  """Builds ``pipeline`` (``_pipeline``) with ``build(pipeline)`` and runs
  it to its end."""
  with pipeline:
    build(pipeline)


def _collect(path: str) -> Any:
  """The results the pipeline left at ``path``, then removes it and every
  staging folder beside it (a failed attempt's leftovers)."""
  fs = _filesystems()
  try:
    return _read_json(path)
  finally:
    folder = fs.split(path)[0]
    if fs.exists(path):
      fs.delete([path])
    for name in _existing_names(folder):
      if name.startswith(STAGING_PREFIX):
        _remove_staging(_join(folder, name))


def convert_webdataset(inputs: str | Sequence[str], output_dir: str,
                       max_record_bytes: int = (
                           common.DEFAULT_MAX_RECORD_BYTES),
                       pipeline_args: Sequence[str] = (),
                       fault: Optional[Callable[[str, str], None]] = None
                       ) -> dict:
  """``webdataset.convert_webdataset`` on Beam: the same shards, markers,
  summary and errors. ``pipeline_args``: Beam's options (``--runner``,
  ``--direct_num_workers``, ...). ``fault``: a test hook (``FailOnce``)."""
  beam = require_beam()
  pipeline = _pipeline(pipeline_args)
  if isinstance(inputs, str):
    inputs = [inputs]
  tars = expand_inputs(inputs)
  names = [webdataset.output_name(t) for t in tars]
  webdataset.check_distinct_names(names)
  created = _is_local(output_dir) and not os.path.exists(output_dir)
  if _is_local(output_dir):
    os.makedirs(output_dir, exist_ok=True)
  have = _existing_names(output_dir)
  finished = [n in have and n + record_format.DONE_SUFFIX in have
              for n in names]
  todo = [t for t, done in zip(tars, finished) if not done]
  resumed = [_join(output_dir, n) for n, done in zip(names, finished)
             if done]
  pending = _join(output_dir, f'{_PENDING_PREFIX}{uuid.uuid4().hex}.json')
  convert = _ConvertTar(output_dir, max_record_bytes, fault)

  def build(p):
    converted = (p | 'Tars' >> beam.Create(todo)
                 # One tar per element, spread over the workers.
                 | 'SpreadTars' >> beam.Reshuffle()
                 | 'ConvertTar' >> beam.Map(convert))
    stored = (p | 'Converted' >> beam.Create(resumed)
              | 'SpreadMarkers' >> beam.Reshuffle()
              | 'ReadMarker' >> beam.Map(_resumed_summary))
    _ = ((converted, stored) | beam.Flatten()
         | beam.combiners.ToList()
         | 'WriteResults' >> beam.Map(_write_results, pending))

  try:
    _run(pipeline, build)
    shards = {_filesystems().split(s['output'])[1]: s
              for s in _collect(pending)}
    try:
      summary = webdataset.webdataset_summary(shards, inputs, len(tars),
                                              len(todo))
    except Exception:
      for name in webdataset.empty_shards(shards):
        out = _join(output_dir, name)
        # The marker first: a shard left without one is converted again.
        _filesystems().delete([out + record_format.DONE_SUFFIX])
        _filesystems().delete([out])
      raise
  except BaseException:
    _remove_if_made_empty(output_dir, created)
    raise
  _write_json(_join(output_dir, common.SUMMARY_FILE), summary)
  return summary


def _remove_if_made_empty(output_dir: str, created: bool):
  """Removes the local ``output_dir`` of a failed conversion when this run
  made it and nothing came of it."""
  if created and os.path.isdir(output_dir) and not os.listdir(output_dir):
    os.rmdir(output_dir)


# ----------------------------------------------------------------------------
# An image folder plus a captions file.


class _EntryPositions(common.Counts):
  """``common.Counts`` that also notes where in the captions file each
  skipped line was (before entry ``entries``), so the Beam conversion can
  list skipped examples in file order as ``convert_folder`` does."""

  def __init__(self):
    super().__init__()
    self.entries = 0
    self.line_skips: list[tuple[tuple[int, int], str, str]] = []

  def skip(self, reason: str, key: str):
    self.line_skips.append(((self.entries, -1), reason, key))


def _read_entries(captions_path: str) -> tuple[list, _EntryPositions]:
  """[(entry index, image path, captions)] of a captions file, and its
  malformed lines (``image_folder.read_captions_file``)."""
  tally = _EntryPositions()
  entries = []
  for rel, captions in image_folder.read_captions_file(captions_path, tally):
    entries.append((len(entries), rel, list(captions)))
    tally.entries = len(entries)
  return entries, tally


class _CheckEntry:
  """(entry index, image path, captions) -> per caption ``(block, (entry,
  caption index, record or None, skip reason or None, image path))``."""

  def __init__(self, images_dir: str, max_record_bytes: int, block: int):
    self.images_dir = images_dir
    self.max_record_bytes = max_record_bytes
    self.block = block

  def _image(self, rel: str) -> Optional[bytes]:
    """The image's bytes, None when missing or outside the images folder
    (as ``convert_folder``: a captions file naming an absolute or ../ path
    does not get to read the rest of the disk)."""
    fs = _filesystems()
    if _is_local(self.images_dir):
      root = os.path.realpath(self.images_dir)
      path = os.path.realpath(os.path.join(root, str(rel)))
      if os.path.commonpath([root, path]) != root:
        return None
    else:
      norm = os.path.normpath(str(rel))
      if os.path.isabs(norm) or norm.split(os.sep)[0] == '..':
        return None
      path = _join(self.images_dir, norm)
    try:
      with fs.open(path) as f:
        return f.read()
    except (OSError, IOError, ValueError):
      return None  # missing: counted as missing_image, as convert_folder

  def __call__(self, entry):
    index, rel, captions = entry
    image = self._image(rel)
    verdicts = image_folder.entry_records(rel, image, captions,
                                        self.max_record_bytes)
    return [(index // self.block, (index, j, data, reason, rel))
            for j, (data, reason) in enumerate(verdicts)]


def _good_per_block(kv) -> tuple[int, int]:
  block, checked = kv
  return block, sum(1 for c in checked if c[2] is not None)


class _RankBlock:
  """A block's good records -> ``(shard, (rank, record))``: rank counts the
  good records of every earlier block first, then file order."""

  def __init__(self, shard_size: int):
    self.shard_size = shard_size
    self._counts = None  # the side input the prefix sums were made from
    self._before: dict[int, int] = {}

  def rank(self, kv, good_per_block: dict) -> list:
    if self._counts is not good_per_block:
      running = 0
      self._before = {}
      for b in sorted(good_per_block):
        self._before[b] = running
        running += good_per_block[b]
      self._counts = good_per_block
    block, checked = kv
    good = sorted((c for c in checked if c[2] is not None),
                  key=lambda c: (c[0], c[1]))
    first = self._before[block]
    return [((first + r) // self.shard_size, (first + r, c[2]))
            for r, c in enumerate(good)]


class _WriteFolderShard:
  """(shard index, [(rank, record)]) -> the shard written whole, plus
  ``.done``; yields ``(name, {'records_written': n})``."""

  def __init__(self, output_dir: str,
               fault: Optional[Callable[[str, str], None]]):
    self.output_dir = output_dir
    self.fault = fault or _no_fault

  def __call__(self, kv) -> tuple[str, dict]:
    index, ranked = kv
    name = image_folder.shard_name(index)
    out = _join(self.output_dir, name)
    with _staged_shard(out) as writer:
      faulty = _FaultyWriter(writer, self.fault, name)
      for _, data in sorted(ranked, key=lambda r: r[0]):
        faulty.write(data)
      count = writer.count
    self.fault('committed', name)
    shard = {'records_written': count}
    _write_json(out + record_format.DONE_SUFFIX, shard)
    self.fault('done', name)
    return name, shard


def _skip_of(kv) -> tuple[tuple[int, int], str, str]:
  _, (index, j, _, reason, rel) = kv
  return (index, j), reason, rel


def _write_folder_results(_, skips: list, shards: list, path: str):
  _write_json(path, {'skips': skips, 'shards': shards})


def convert_folder(images_dir: str, captions_path: str, output_dir: str,
                   shard_size: int = 10000,
                   max_record_bytes: int = (
                       common.DEFAULT_MAX_RECORD_BYTES),
                   pipeline_args: Sequence[str] = (),
                   fault: Optional[Callable[[str, str], None]] = None
                   ) -> dict:
  """``image_folder.convert_folder`` on Beam: the same shards, markers,
  summary and errors. The captions file is read here (local); the images
  are read and checked by the workers. ``fault``: a test hook."""
  beam = require_beam()
  pipeline = _pipeline(pipeline_args)
  if shard_size <= 0:
    raise errors.ConfigError(f'shard_size must be positive, not {shard_size}')
  if not os.path.isfile(captions_path):
    raise common.ConversionError(
        f'captions file {captions_path} '
        f'{"is a folder" if os.path.exists(captions_path) else "does not exist"}')
  if _is_local(images_dir) and not os.path.isdir(images_dir):
    raise common.ConversionError(
        f'images folder {images_dir} '
        f'{"is a file" if os.path.exists(images_dir) else "does not exist"}')
  entries, tally = _read_entries(captions_path)
  pending = _join(output_dir, f'{_PENDING_PREFIX}{uuid.uuid4().hex}.json')
  check = _CheckEntry(images_dir, max_record_bytes, _BLOCK)
  write = _WriteFolderShard(output_dir, fault)

  def build(p):
    checked = (p | 'Entries' >> beam.Create(entries)
               | 'SpreadEntries' >> beam.Reshuffle()
               | 'CheckEntry' >> beam.FlatMap(check))
    skips = (checked | 'Skipped' >> beam.Filter(lambda kv: kv[1][3])
             | 'SkipOf' >> beam.Map(_skip_of)
             | 'AllSkips' >> beam.combiners.ToList())
    good = checked | 'Good' >> beam.Filter(lambda kv: kv[1][2] is not None)
    blocks = good | 'Blocks' >> beam.GroupByKey()
    counts = blocks | 'CountBlock' >> beam.Map(_good_per_block)
    shards = (blocks
              # A bound method: Beam calls other callable objects with the
              # element alone, without the side input.
              | 'Rank' >> beam.FlatMap(_RankBlock(shard_size).rank,
                                       beam.pvalue.AsDict(counts))
              | 'Shards' >> beam.GroupByKey()
              | 'WriteShard' >> beam.Map(write)
              | 'AllShards' >> beam.combiners.ToList())
    _ = (p | 'Once' >> beam.Create([None])
         | 'WriteResults' >> beam.Map(
             _write_folder_results, beam.pvalue.AsSingleton(skips),
             beam.pvalue.AsSingleton(shards), pending))

  created = _is_local(output_dir) and not os.path.exists(output_dir)
  if _is_local(output_dir):
    os.makedirs(output_dir, exist_ok=True)
  try:
    _run(pipeline, build)
    results = _collect(pending)
  except BaseException:
    _remove_if_made_empty(output_dir, created)
    raise
  if not results['shards']:
    _remove_if_made_empty(output_dir, created)  # nothing came of it
  counts = common.Counts()
  counts.seen = tally.seen + sum(len(c) for _, _, c in entries)
  skipped = sorted([tuple(s[0]), s[1], s[2]] for s in results['skips'])
  for _, reason, key in sorted(skipped + [list(s) for s in tally.line_skips]):
    counts.skip(reason, key)
  shards = dict(results['shards'])
  counts.written = sum(s['records_written'] for s in shards.values())
  summary = image_folder.folder_summary(counts, images_dir, captions_path,
                                      shards)
  _write_json(_join(output_dir, common.SUMMARY_FILE), summary)
  return summary
