"""Weighted mixtures of training sources (``config.data.sources``).

``data.sources`` is a mapping ``{label: {name, weight, ...}}``: each entry is
one training source of ``data/sources/`` with its own ``data.*`` source
fields (``path``, ``split``, ``tfds_name``, ...: the keys the sources
declare; the ones it omits are ``data``'s) and a positive ``weight``
(``sources/mixture.py`` builds the ``Mixture``). The sources are mixed with Grain's own mixing,
``grain.MapDataset.mix``, whose interleave is deterministic arithmetic on
the mixed index (no random draws): with integer proportions ``p`` (Grain
scales the weights so that the smallest is 100 and truncates, e.g. 0.7 and
0.3 mix 233:100), the first ``n`` mixed records hold exactly
``records_drawn(weights, n)`` records of each source, interleaved as evenly
as the proportions allow. Each source is shuffled on its own (reshuffled
every epoch, with a seed of its own derived from ``config.seed`` and its
label) and repeated before mixing, so the mixture is infinite and the
proportions hold at every step, not only on average; then the records of
each global batch are permuted (``mixed_records``), which keeps each
batch's counts and moves the sources off fixed batch positions. Record ``k``
of the mixture is a pure function of (seed, weights, batch size, k), which
keeps ``pipeline.train_dataset``'s exact resumption and host independence.

The entries are taken in the order of their sorted labels, so the order a
config file or a stored JSON config lists them in does not change the data.

The weights may change on resume (``continue_history``): the stream is then
mixed in segments, each with its weights over every source's stream from
the record that source had reached, so no source re-reads or skips records.
The checkpoint keeps the segments (``history_meta``), and record ``k`` is a
pure function of (seed, weight history, batch size, k).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import zlib
from typing import Any, Mapping, Optional, Sequence

import grain
import numpy as np

from prolip_jax import errors
from prolip_jax.data import bad_records

# Grain's rounding of float weights to integer proportions
# (grain/_src/python/dataset/transformations/mix.py, _float_to_int_proportions):
# the smallest weight becomes this, the others scale with it and truncate.
GRAIN_SCALE_MIN_TO = 100


@dataclasses.dataclass(frozen=True)
class Mixture:
  """The sources of ``data.sources``: ``labels`` (sorted), their record
  ``sources`` (random-access sequences, real data wrapped in
  ``bad_records.CheckedSource``) and ``weights`` (positive floats)."""
  labels: tuple[str, ...]
  sources: tuple[Sequence[dict], ...]
  weights: tuple[float, ...]
  # ((first record, weights), ...) of a run whose weights changed on resume
  # (``continue_history``); empty: ``weights`` from record 0.
  history: tuple[tuple[int, tuple[float, ...]], ...] = ()

  def segments(self) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """``((first record, weights), ...)``: the weights each stretch of the
    stream was mixed with, the last one open-ended."""
    return self.history or ((0, tuple(self.weights)),)

  def source_stats(self) -> dict[str, dict]:
    """``{label: bad-record stats}`` of the sources that check their
    records (``bad_records.CheckedSource.stats``)."""
    out = {}
    for label, source in zip(self.labels, self.sources):
      stats = getattr(source, 'stats', None)
      if callable(stats):
        out[label] = stats()
    return out

  def stats(self) -> Optional[dict]:
    """The bad-record stats of all checked sources together (the shape of
    ``CheckedSource.stats``), None when no source checks its records."""
    per_source = self.source_stats()
    return bad_records.sum_stats(per_source.values()) if per_source else None


def check_weights(labels: Sequence[str], weights: Sequence[Any]) -> None:
  """Raises ``ConfigError`` unless every weight is a finite number > 0."""
  for label, weight in zip(labels, weights):
    ok = isinstance(weight, (int, float)) and not isinstance(weight, bool)
    if not ok or not math.isfinite(weight) or weight <= 0:
      raise errors.ConfigError(
          f'data.sources.{label}.weight must be a number > 0, got '
          f'{weight!r}')


def proportions(weights: Sequence[float]) -> tuple[int, ...]:
  """The integer proportions Grain mixes ``weights`` with: scaled so the
  smallest is ``GRAIN_SCALE_MIN_TO``, then truncated (``(0.7, 0.3)`` ->
  ``(233, 100)``)."""
  scale = GRAIN_SCALE_MIN_TO / min(weights)
  return tuple(int(w * scale) for w in weights)


def records_drawn(weights: Sequence[float], n: int) -> np.ndarray:
  """``(len(weights),)`` int64: how many of the first ``n`` records of the
  mixture come from each source.

  Grain's interleave (``_dataset_and_key_of_next_element``) gives source 0
  the records where ``k - floor(k (P - p0) / P)`` steps up (``P`` the sum of
  the proportions), hands the other ``floor(n (P - p0) / P)`` records to
  the remaining sources in the same way, and so on: the counts are that
  recursion in closed form, exact for any ``n`` (tests compare them with
  the records of ``grain.MapDataset.mix`` itself).
  """
  props = proportions(weights)
  counts = np.zeros(len(props), np.int64)
  remaining, left = sum(props), int(n)
  for i, p in enumerate(props):
    rest = left * (remaining - p) // remaining
    counts[i] = left - rest
    remaining -= p
    left = rest
  return counts


def segment_offsets(segments) -> list[np.ndarray]:
  """Per segment of ``Mixture.segments()``, the ``(n_sources,)`` records of
  each source read before it: each source continues where it stopped."""
  offsets = [np.zeros(len(segments[0][1]), np.int64)]
  for (start, weights), (end, _) in zip(segments, segments[1:]):
    offsets.append(offsets[-1] + records_drawn(weights, end - start))
  return offsets


def drawn_so_far(mixture: Mixture, n: int) -> np.ndarray:
  """``(n_sources,)``: records of each source among the first ``n`` of the
  stream, across every weight change (``records_drawn`` per segment)."""
  segments = mixture.segments()
  offsets = segment_offsets(segments)
  j = max(i for i, (start, _) in enumerate(segments) if start <= n)
  start, weights = segments[j]
  return offsets[j] + records_drawn(weights, n - start)


def continue_history(stored: Any, labels: Sequence[str],
                     weights: Sequence[float], records: int
                     ) -> tuple[tuple[int, tuple[float, ...]], ...]:
  """The mixing history of a run resumed after ``records`` records with
  ``weights``: the stored one (``Mixture.history`` as a checkpoint keeps
  it: ``{'labels', 'segments'}``), plus a segment from ``records`` when the
  weights differ from its last. ``ConfigError`` when the stored history
  mixed other sources (drift rules refuse that first)."""
  weights = tuple(float(w) for w in weights)
  if not stored:
    return ((0, weights),)
  if list(stored['labels']) != list(labels):
    raise errors.ConfigError(
        f'the checkpoint mixed the sources {stored["labels"]}, this config '
        f'{list(labels)}: start a new --workdir to mix others')
  segments = tuple((int(start), tuple(float(w) for w in ws))
                   for start, ws in stored['segments'])
  segments = tuple(seg for seg in segments if seg[0] <= records)
  if segments[-1][1] == weights:
    return segments
  if segments[-1][0] == records:  # changed again before any new record
    segments = segments[:-1]
  return segments + ((int(records), weights),)


def history_meta(mixture: Mixture) -> dict:
  """What a checkpoint keeps of a mixture for ``continue_history``."""
  return {'labels': list(mixture.labels),
          'segments': [[start, list(w)] for start, w in mixture.segments()]}


def source_seed(seed: int, label: str) -> int:
  """The shuffle seed of source ``label`` (uint32): derived from the run's
  ``seed`` and the label, so sources never share a permutation and adding
  or renaming one leaves the others' orders as they were."""
  sequence = np.random.SeedSequence([int(seed), zlib.crc32(label.encode())])
  return int(sequence.generate_state(1, dtype=np.uint32)[0])


def mixed_records(mixture: Mixture, seed: int,
                  batch_size: int = 1) -> grain.MapDataset:
  """The infinite, random-access stream of mixed records: each source
  shuffled (every epoch anew) and repeated, ``grain.MapDataset.mix`` with
  ``mixture.weights``, then the records of each window of ``batch_size``
  (a global batch) permuted.

  The permutation keeps every batch's records (and so each source's count
  in it) and breaks the interleave's period: without it, weights 3:1 put
  the second source at every 4th position of every batch, so the rows a
  batch position selects (ProLIP's masked copies take every 8th row, each
  host and device its contiguous rows) would come from one source only.
  """
  children = []
  for label, source in zip(mixture.labels, mixture.sources):
    if not len(source):
      raise errors.ConfigError(f'data.sources.{label} has no records')
    children.append(grain.MapDataset.source(source).seed(
        source_seed(seed, label)).shuffle().repeat(None))
  segments = mixture.segments()
  if len(segments) == 1:
    mixed = grain.MapDataset.mix(children, list(segments[0][1]))
  else:  # each source continues where the previous weights left it
    parts = []
    ends = [start for start, _ in segments[1:]] + [sys.maxsize - 1]
    for (start, weights), end, offsets in zip(
        segments, ends, segment_offsets(segments)):
      part = grain.MapDataset.mix(
          [child[int(off):] for child, off in zip(children, offsets)],
          list(weights))
      parts.append(part[:end - start])
    mixed = grain.MapDataset.concatenate(parts)
  if batch_size == 1:
    return mixed
  # Grain adds the window's index to this seed and needs < 2**32: keep
  # 2**31 windows of headroom.
  window_seed = source_seed(seed, '') % 2**31
  return grain.experimental.WindowShuffleMapDataset(
      mixed, window_size=batch_size, seed=window_seed)


def entries(sources: Mapping[str, Any]) -> list[tuple[str, dict]]:
  """``[(label, entry dict)]`` of ``data.sources`` in sorted-label order;
  ``ConfigError`` for an entry that is not a mapping."""
  out = []
  for label in sorted(sources):
    entry = sources[label]
    if hasattr(entry, 'to_dict'):
      entry = entry.to_dict()
    if not isinstance(entry, Mapping):
      raise errors.ConfigError(
          f'data.sources.{label} must be a dict such as '
          f"dict(name='digits', weight=1.0), got {entry!r}")
    out.append((str(label), dict(entry)))
  return out


def describe(sources: Mapping[str, Any]) -> str:
  """``data.sources`` in words: each source's share as Grain mixes it,
  e.g. ``a mixture of digits 30.03% (100/333), web 69.97% (233/333)``."""
  pairs = entries(sources)
  props = proportions([entry['weight'] for _, entry in pairs])
  total = sum(props)
  return 'a mixture of ' + ', '.join(
      f'{label} {100 * p / total:.2f}% ({p}/{total})'
      for (label, _), p in zip(pairs, props))


def metrics_row(mixture: Mixture, records: int) -> dict[str, float]:
  """``metrics.jsonl`` entries of a mixture after ``records`` records of
  the global stream (``step * batch_size``): ``data/source_count/<label>``,
  the records drawn from each source so far by all hosts together (the
  mixing arithmetic, so no host exchange), and for each checked source its
  own ``data/bad_records/<label>`` and ``data/records_seen/<label>`` (this
  host's reads, as the totals are)."""
  row = {f'data/source_count/{label}': float(count) for label, count in
         zip(mixture.labels, drawn_so_far(mixture, records))}
  for label, stats in mixture.source_stats().items():
    row[f'data/bad_records/{label}'] = stats['bad']
    row[f'data/records_seen/{label}'] = stats['seen']
  return row
