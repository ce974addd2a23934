"""PC-CLIP's difference pairs: (image i, image j, difference text T_ij).

Sam et al., "Finetuning CLIP to Reason about Pairwise Differences": eq. 1
aligns g(I_i) - g(I_j) with f(T_ij), where an LLM wrote T_ij from the two
captions. Here T_ij comes from structured attributes of the records
(``records[k]['attributes']``, e.g. the digits' value, thickness, width and
position) through ``iter_difference_pairs`` and a schema of phrases
(``DIGIT_SCHEMA`` for the bundled digits), so every text is true of its two
images by construction.

Like ``pipeline.train_dataset``, ``difference_pair_dataset`` is a random-access
``grain.MapDataset`` whose element ``step`` is that step's local batch of
pairs: pair ``k`` of the global stream is drawn with an RNG seeded by
``(seed, k)`` only, so a resumed run (``ds[step:]``) sees exactly the pairs of
an uninterrupted one. ``with_difference_pairs`` merges it into the ordinary
image-caption batches, step by step.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any, Iterator, Mapping, Optional, Sequence

import grain
import numpy as np

from prolip_jax.data import pipeline
from prolip_jax.data import image_decode
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer

# Mixed into the pair RNG seed so that the pair stream is not correlated with
# the main stream (which Grain seeds with the bare ``seed``).
_PAIR_SALT = 0x9C11


@dataclasses.dataclass(frozen=True)
class Attribute:
  """How one attribute compares across a pair of images.

  ``levels`` orders the values of an ordinal attribute (None: numeric, values
  compared directly, or categorical when ``more``/``less`` are None).
  ``more`` / ``less`` describe the FIRST image having the higher / lower
  value; ``categorical`` is a template with ``{a}`` (first) and ``{b}``
  (second) for unordered values.
  """
  name: str
  levels: Optional[tuple[Any, ...]] = None
  more: Optional[str] = None
  less: Optional[str] = None
  categorical: Optional[str] = None

  def compare(self, a: Any, b: Any) -> Optional[str]:
    """The phrase for (first = a, second = b), or None when equal."""
    if a == b:
      return None
    if self.more is None:
      return self.categorical.format(a=a, b=b)
    if self.levels is not None:
      a, b = self.levels.index(a), self.levels.index(b)
    return self.more if a > b else self.less


# The bundled digits: the value and the thickness / width / position words
# that ``prolip_jax.data.digits`` measures on each image.
DIGIT_SCHEMA: tuple[Attribute, ...] = (
    Attribute('digit', None,
              'the first digit is larger than the second',
              'the first digit is smaller than the second'),
    Attribute('thickness', ('thin', 'medium', 'thick'),
              'the first is drawn with thicker strokes',
              'the first is drawn with thinner strokes'),
    Attribute('width', ('narrow', 'regular', 'wide'),
              'the first digit is wider than the second',
              'the first digit is narrower than the second'),
    Attribute('position', ('left', 'center', 'right'),
              'the first digit sits further to the right',
              'the first digit sits further to the left'),
)


def difference_texts(attrs_first: Mapping[str, Any],
                     attrs_second: Mapping[str, Any],
                     schema: Sequence[Attribute] = DIGIT_SCHEMA) -> list[str]:
  """One phrase per attribute that differs, in schema order.

  Attributes missing from either mapping are skipped. E.g. for digits
  ``{'digit': 7, 'thickness': 'thick', ...}`` vs ``{'digit': 2, 'thickness':
  'thin', ...}`` -> ['the first digit is larger than the second', 'the first
  is drawn with thicker strokes', ...].
  """
  out = []
  for attr in schema:
    if attr.name in attrs_first and attr.name in attrs_second:
      phrase = attr.compare(attrs_first[attr.name], attrs_second[attr.name])
      if phrase is not None:
        out.append(phrase)
  return out


def difference_text(attrs_first: Mapping[str, Any],
                    attrs_second: Mapping[str, Any],
                    schema: Sequence[Attribute] = DIGIT_SCHEMA,
                    max_phrases: Optional[int] = None) -> Optional[str]:
  """The difference phrases joined into one caption T_ij ('; ' then ' and '),
  or None when the two images do not differ in any schema attribute."""
  phrases = difference_texts(attrs_first, attrs_second, schema)
  if max_phrases is not None:
    phrases = phrases[:max_phrases]
  if not phrases:
    return None
  if len(phrases) == 1:
    return phrases[0]
  return ', '.join(phrases[:-1]) + ' and ' + phrases[-1]


def iter_difference_pairs(attributes: Sequence[Mapping[str, Any]],
                          seed: int = 0,
                          schema: Sequence[Attribute] = DIGIT_SCHEMA,
                          max_phrases: Optional[int] = None,
                          max_tries: int = 100
                          ) -> Iterator[tuple[int, int, str]]:
  """Endless stream of ``(i, j, T_ij)``: random ordered pairs i != j of
  differing items with their difference caption.

  Args:
    attributes: per-item attribute mappings (e.g. digit records' attributes
      plus ``'digit': label``).
    seed: seed of the Python RNG drawing the pairs (deterministic stream).
    schema, max_phrases: see ``difference_text``.
    max_tries: give up (StopIteration) after this many consecutive draws of
      identical pairs, e.g. when every item is the same.
  """
  rng = random.Random(seed)
  n = len(attributes)
  if n < 2:
    return
  misses = 0
  while misses < max_tries:
    i, j = rng.sample(range(n), 2)
    text = difference_text(attributes[i], attributes[j], schema, max_phrases)
    if text is None:
      misses += 1
      continue
    misses = 0
    yield i, j, text


def draw_difference_pair(attributes: Sequence[Mapping[str, Any]], seed: int,
                         index: int,
                         schema: Sequence[Attribute] = DIGIT_SCHEMA,
                         max_phrases: int = 0) -> tuple[int, int, str]:
  """Pair ``index`` of the stream ``seed``: ``(i, j, T_ij)``, a pure function.

  The pair is the first of ``iter_difference_pairs`` seeded from ``(seed,
  index)``. The schema order is shuffled by the same RNG before
  ``max_phrases`` truncates the phrase list: truncating in schema order would
  almost always keep only the digit-value phrase (90% of pairs differ in
  value), and the other attributes would never be described alone.

  Args:
    attributes: per-record attribute mappings (schema names -> values).
    seed: the run's seed.
    index: position of the pair in the global stream (step * B + row).
    schema: the attributes and their phrases.
    max_phrases: keep at most this many differing attributes in T_ij (0: all
      of them, as the paper's LLM texts describe every difference it sees).

  Returns:
    record indices ``i != j`` and the text saying how i differs from j.
  """
  rng = np.random.default_rng([_PAIR_SALT, seed, index])
  order = rng.permutation(len(schema))
  shuffled = [schema[o] for o in order]
  stream = iter_difference_pairs(
      attributes, seed=int(rng.integers(2**62)), schema=shuffled,
      max_phrases=max_phrases or None)
  try:
    return next(stream)
  except StopIteration:
    raise ValueError('no two records differ in any attribute of the schema; '
                     'PC-CLIP has no difference pairs to train on') from None


class _PairBuilder:
  """Global pair index -> ``{'pair_image_i', 'pair_image_j',
  'pair_tokens'}``; a class (not a closure) so Grain workers can pickle it."""

  def __init__(self, source: Sequence[dict], attributes, seed: int,
               tokenizer: Tokenizer, image_size: int, schema, max_phrases):
    self.source = source
    self.attributes = attributes
    self.seed = seed
    self.tokenizer = tokenizer
    self.image_size = image_size
    self.schema = tuple(schema)
    self.max_phrases = max_phrases

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    i, j, text = draw_difference_pair(self.attributes, self.seed, int(index),
                                      self.schema, self.max_phrases)
    # Eval view, no augmentation: the attribute words were measured on the
    # whole image, and a random crop can move or rescale the digit (changing
    # its true position/width relative to the text).
    view = lambda k: transforms.eval_view(
        image_decode.decode_rgb(self.source[k]['image']), self.image_size)
    return {'pair_image_i': view(i), 'pair_image_j': view(j),
            'pair_tokens': self.tokenizer(text)[0]}


def record_attributes(source: Sequence[dict]) -> list[Mapping[str, Any]]:
  """``source[k]['attributes']`` for every record, with a clear error."""
  out = []
  for k in range(len(source)):
    attrs = source[k].get('attributes')
    if attrs is None:
      raise ValueError(f'record {k} has no "attributes": PC-CLIP builds its '
                       'difference texts from per-record attributes (the '
                       "bundled digits have them: data.name='digits')")
    out.append(attrs)
  return out


def difference_pair_dataset(source: Sequence[dict], *, tokenizer: Tokenizer,
                            image_size: int, global_batch_size: int,
                            seed: int,
                            schema: Sequence[Attribute] = DIGIT_SCHEMA,
                            max_phrases: int = 0,
                            attributes: Optional[Sequence[Mapping]] = None,
                            process_index: int = 0, process_count: int = 1
                            ) -> grain.MapDataset:
  """Infinite dataset of local pair batches; element ``s`` is step ``s``'s.

  Element ``s`` is ``{'pair_image_i': (b, size, size, 3) uint8,
  'pair_image_j': (b, size, size, 3) uint8, 'pair_tokens': (b, L) int32}``
  with ``b = global_batch_size / process_count``: rows ``[s*B, (s+1)*B)`` of
  the global pair stream (``draw_difference_pair``), process p reading its
  contiguous ``b`` rows, as in ``pipeline.train_dataset``.

  Args:
    source: random-access records with ``image`` and ``attributes``.
    tokenizer: encodes T_ij.
    image_size: side of the (eval-view) pair images.
    global_batch_size: pairs per step over all processes.
    seed: the run's seed.
    schema, max_phrases: see ``draw_difference_pair``.
    attributes: the records' attributes if already at hand (else read).
    process_index, process_count: this host's share.
  """
  if attributes is None:
    attributes = record_attributes(source)
  local = pipeline.local_batch_size(global_batch_size, process_count)
  builder = _PairBuilder(source, attributes, seed, tokenizer, image_size,
                         schema, max_phrases)
  ds = grain.MapDataset.range(0, sys.maxsize).map(builder)
  return ds.batch(local, drop_remainder=True)[process_index::process_count]


class _MergeStep:
  """(step, batch) -> batch plus that step's pairs (picklable)."""

  def __init__(self, pairs: grain.MapDataset):
    self.pairs = pairs

  def __call__(self, step: int, batch: dict) -> dict:
    return dict(batch, **self.pairs[step])


def with_difference_pairs(dataset: grain.MapDataset,
                          pairs: grain.MapDataset) -> grain.MapDataset:
  """Element ``s`` = ``dataset[s]`` merged with ``pairs[s]`` (one dict).

  Both are indexed by step, so the merged dataset stays random-access and
  ``ds[step:]`` resumes exactly.
  """
  return dataset.map_with_index(_MergeStep(pairs))


def pcclip_train_dataset(config, dataset: grain.MapDataset,
                         source: Sequence[dict], tokenizer: Tokenizer,
                         image_size: int, process_index: int = 0,
                         process_count: int = 1) -> grain.MapDataset:
  """``dataset`` (``pipeline.train_dataset``) with PC-CLIP's pairs merged in.

  Pairs per step = ``config.batch_size``; ``config.loss.pcclip_max_phrases``
  caps the phrases per difference text.
  """
  pairs = difference_pair_dataset(
      source, tokenizer=tokenizer, image_size=image_size,
      global_batch_size=config.batch_size, seed=config.seed,
      max_phrases=int(config.loss.pcclip_max_phrases),
      process_index=process_index, process_count=process_count)
  return with_difference_pairs(dataset, pairs)


def difference_corpus(schema: Sequence[Attribute] = DIGIT_SCHEMA,
                      repeats: int = 50) -> list[str]:
  """Every phrase of ``schema`` (``repeats`` times, so sentencepiece gives
  their words pieces of their own): added to the tokenizer's training corpus
  for PC-CLIP runs."""
  phrases = []
  for attr in schema:
    phrases += [p for p in (attr.more, attr.less) if p]
  return phrases * repeats


def difference_eval_pairs(attributes: Sequence[Mapping[str, Any]],
                          attribute: Attribute, num_pairs: int,
                          seed: int = 0) -> tuple[np.ndarray, np.ndarray,
                                                  np.ndarray]:
  """Held-out pairs for eq. 2 on one ordered attribute.

  Random ordered pairs (i, j) whose values of ``attribute`` differ, and
  whether the FIRST has more of it (the truth of ``attribute.more``). Random
  order makes the labels balanced in expectation, so chance is 50%.

  Returns:
    ``i``, ``j`` (num_pairs,) int arrays and ``first_has_more`` (num_pairs,)
    bool; all empty when every item has the same value.
  """
  rng = np.random.default_rng([_PAIR_SALT, seed, 1])
  values = [a[attribute.name] for a in attributes]
  rank = (np.asarray([attribute.levels.index(v) for v in values])
          if attribute.levels is not None else np.asarray(values))
  n = len(values)
  if len(np.unique(rank)) < 2:  # e.g. the digits' position: all 'center'
    empty = np.zeros((0,), np.int64)
    return empty, empty, np.zeros((0,), bool)
  ii, jj = [], []
  while len(ii) < num_pairs:
    i, j = rng.integers(n, size=(2, 4 * num_pairs))
    keep = rank[i] != rank[j]
    ii.extend(i[keep])
    jj.extend(j[keep])
  i, j = np.asarray(ii[:num_pairs]), np.asarray(jj[:num_pairs])
  return i, j, rank[i] > rank[j]
