"""The source protocol: what one module of ``data/sources/`` defines.

A source is a subclass of ``Source`` with a ``name``: the one spelling by
which training (``data.name='<name>'``, or ``name`` in an entry of
``data.sources``) and evaluation (an entry's ``data='<name>:<rest>'``)
select it. It declares the ``data.*`` keys its training records read
(``KEYS``: field -> ``config.keys.Key``, its default and meaning) and
serves what it can of:

* ``train_records(config, data, where)``: ``(records, corpus)``, the
  training records (a random-access sequence of record dicts, see
  ``pipeline``) and a function giving captions for training a tokenizer;
* ``zero_shot_set(rest, cfg)``, ``retrieval_set(rest, cfg)``: its
  evaluation views (``views.py``) for an evaluator entry ``cfg`` whose
  ``data`` is ``'<name>:<rest>'``;
* ``in_memory(rest, cfg)``: a bundled set held in memory (``EvalData``),
  from which ``BundledSource`` reads its zero-shot and retrieval views;
* ``available(rest, cfg)``: None when the evaluation data can be opened,
  else the one-line reason (a cheap check).

A method it does not override is a view it does not serve: the registry
(``sources/__init__.py``) asks ``serves`` and names the sources that do in
its errors. ``RecordSource`` is the base of the sources of record files
(their records checked and counted by ``bad_records.CheckedSource``),
``BundledSource`` that of the sets that ship with the package.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from prolip_jax import errors
from prolip_jax.config import keys as config_keys
from prolip_jax.data import bad_records
from prolip_jax.data import dali_decode
from prolip_jax.data import eval_data
from prolip_jax.data import image_decode
from prolip_jax.data import paraphrases
from prolip_jax.data import record_sources
from prolip_jax.data import transforms
from prolip_jax.data.sources import views

# A view -> the method that serves it.
METHODS = {'train': 'train_records', 'zero_shot': 'zero_shot_set',
           'retrieval': 'retrieval_set', 'in_memory': 'in_memory'}
# The views an evaluator reads.
EVAL_VIEWS = ('zero_shot', 'retrieval', 'in_memory')


def declared(*fields: str) -> dict[str, config_keys.Key]:
  """``{field: declaration}`` of ``data.<field>`` keys that
  ``config/keys.py`` declares (a source's ``KEYS`` built from them)."""
  return {f: config_keys.KEYS[f'data.{f}'] for f in fields}


def value(data: Any, field: str,
          keys: Optional[Mapping[str, config_keys.Key]] = None) -> Any:
  """``data``'s value of ``field``, or its declared default (``keys``'s
  declaration, else ``data.<field>``'s): a data-only config, or one stored
  by an older version, may lack it."""
  if field in data:
    return data[field]
  declaration = (keys or {}).get(field) or config_keys.KEYS[f'data.{field}']
  return declaration.default


class Source:
  """One source. Subclasses set ``name`` and ``KEYS`` and override the
  methods of the views they serve (module docstring)."""

  name: str = ''
  # The data.* fields its training records read: field -> Key (default,
  # meaning, fixed on resume).
  KEYS: Mapping[str, config_keys.Key] = {}
  # Whether the ``rest`` of an evaluation spec is a local path (gs:// and
  # s3:// are refused naming the mount route: storage/paths.py).
  LOCAL_PATH = False

  def serves(self, view: str) -> bool:
    """Whether the source serves ``view`` (a key of ``METHODS``)."""
    method = METHODS[view]
    return getattr(type(self), method) is not getattr(Source, method)

  def value(self, data: Any, field: str) -> Any:
    """``data``'s value of ``field`` or its declared default."""
    return value(data, field, self.KEYS)

  def train_records(self, config: Any, data: Any, where: str
                    ) -> tuple[Sequence[dict], Callable[[], list]]:
    """The records and caption corpus of ``data`` (the ``data`` config,
    or a ``data.sources`` entry laid over it; ``where`` names it in
    errors); ``config`` is the whole run config."""
    raise NotImplementedError

  def zero_shot_set(self, rest: str, cfg: Any) -> views.ZeroShotSet:
    """The zero-shot view of ``'<name>:<rest>'`` for the evaluator entry
    ``cfg`` (its ``templates``, ``class_names``, ``data_dir``...)."""
    raise NotImplementedError

  def retrieval_set(self, rest: str, cfg: Any) -> views.RetrievalSet:
    """The retrieval view of ``'<name>:<rest>'`` for the entry ``cfg``."""
    raise NotImplementedError

  def in_memory(self, rest: str, cfg: Any) -> views.EvalData:
    """The set held in memory of ``'<name>:<rest>'`` for the entry
    ``cfg``."""
    raise NotImplementedError

  def available(self, rest: str, cfg: Any) -> Optional[str]:
    """None when the evaluation data can be opened, else why not."""
    del rest, cfg
    return None


def checked(source: Sequence[dict], config: Any, data: Any
            ) -> bad_records.CheckedSource:
  """``source`` with its bad records replaced and counted (``data``'s
  ``max_bad_fraction`` and ``bad_record_warmup``)."""
  # Decode JPEGs no larger than every training crop needs (see
  # image_decode.train_min_pixels): the crop is then drawn on the smaller image.
  # A config without the image size (a data-only config) decodes in full.
  image_size = config.get('model', {}).get('vision', {}).get('image_size')
  defaults = transforms.AugmentConfig()
  min_pixels = image_decode.train_min_pixels(
      image_size, tuple(value(data, 'crop_scale')),
      defaults.crop_ratio) if image_size else 0
  return bad_records.CheckedSource(
      source, max_bad_fraction=float(value(data, 'max_bad_fraction')),
      warmup=int(value(data, 'bad_record_warmup')), min_pixels=min_pixels,
      # data.decode='dali': the header here, the pixels in DALI.
      decode=(bad_records.HEADER if config_keys.get(config, 'data.decode')
              == dali_decode.DALI else True))


class RecordSource(Source):
  """A source of record files: ``open_records`` gives the raw records;
  training reads them checked (``checked``) and samples a tokenizer's
  corpus from their captions."""

  KEYS = declared('max_bad_fraction', 'bad_record_warmup',
                  'tokenizer_max_sentences')

  def open_records(self, data: Any, where: str) -> Sequence[dict]:
    """The raw records ``data`` names (``where`` names it in errors)."""
    raise NotImplementedError

  def train_records(self, config, data, where):
    max_sentences = int(self.value(data, 'tokenizer_max_sentences'))
    raw = self.open_records(data, where)
    return checked(raw, config, data), lambda: record_sources.caption_corpus(
        raw, max_sentences)


def template_choice(choice: Any, default: Sequence[str]) -> tuple[str, ...]:
  """An entry's ``templates``: ``()``/'' -> ``default``; an asset name ->
  its templates; else the strings themselves."""
  if not choice:
    return tuple(default)
  if isinstance(choice, str):
    if choice in eval_data.ASSETS:
      return eval_data.metadata(choice)['templates']
    return (choice,)
  return tuple(choice)


class BundledSource(Source):
  """A set that ships with the package: its evaluation set is held in
  memory (``in_memory``; the evaluator keys ``per_class``, ``render_size``
  and ``phrasings`` are its), and its zero-shot and retrieval views are
  read from that."""

  def zero_shot_set(self, rest, cfg):
    data = self.in_memory(rest, cfg)
    return views.zero_shot_in_memory(
        data, template_choice(cfg.get('templates', ()), data.templates))

  def retrieval_set(self, rest, cfg):
    return views.retrieval_in_memory(self.in_memory(rest, cfg))

  @staticmethod
  def phrasings(cfg: Any) -> str:
    """The entry's ``phrasings`` (``paraphrases.EVAL_PHRASINGS``)."""
    phrasings = cfg.get('phrasings', 'templates')
    if phrasings not in paraphrases.EVAL_PHRASINGS:
      raise errors.ConfigError(f'data.phrasings must be one of '
                               f'{paraphrases.EVAL_PHRASINGS}, got '
                               f'{phrasings!r}')
    return phrasings
