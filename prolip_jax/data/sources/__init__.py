"""The data sources, one module each, found by name: the one registry that
training and evaluation read.

=================  ============================  ============================
source             training (``data.name=``)     evaluation (entry ``data=``)
=================  ============================  ============================
``digits``         the bundled MNIST demo        ``digits[:SPLIT]`` in memory
``emoji``          the bundled emoji (OpenMoji)  ``emoji[:SPLIT]`` in memory
``array_record``   shards (``data.path``)        ``array_record:GLOB``
                                                 (retrieval)
``tfds``           ``data.tfds_name`` ...        ``tfds:NAME[:SPLIT]``
                                                 (zero-shot, retrieval)
``folder``         --                            ``folder:PATH`` (zero-shot)
``jsonl``          --                            ``jsonl:PATH`` (retrieval)
``mixture``        ``data.sources``: a weighted  --
                   mixture of the others
=================  ============================  ============================

Each is a module here holding one subclass of ``base.Source`` (the
protocol: the ``data.*`` keys it declares, its training records, its
evaluation views); it is registered by being here (a folder appended to
``__path__`` adds its modules too). A module's name may not be one of this
module's own names (``get``, ``names``, ``errors``...): importing it sets
that name on the package. ``train_source(config)`` gives a run's
training records; ``evaluation/sets.py`` asks ``get(name)`` for the views
an evaluator entry names.

Adding a source: write ``sources/<name>.py`` with a subclass of
``base.Source`` (``name``, ``KEYS``, and the methods of the views it
serves), then select it in a config (docs/architecture.md).

The real-data sources come wrapped in ``bad_records.CheckedSource``: bad
records are replaced deterministically and counted (``bad_record_stats``),
and more than ``data.max_bad_fraction`` of them (after
``data.bad_record_warmup`` reads) stops training with an error naming the
shard.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import types
from typing import Any, Callable, Mapping, Optional, Sequence

from prolip_jax import errors
from prolip_jax.data import paraphrases
from prolip_jax.data.sources.base import Source
from prolip_jax.data.sources.base import value


# Cached per ``__path__``: a folder appended to it makes another registry.
@functools.lru_cache(maxsize=None)
def _discover(path: tuple[str, ...]) -> Mapping[str, Source]:
  found: dict[str, Source] = {}
  for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
    module = importlib.import_module(f'{__name__}.{info.name}')
    for _, cls in inspect.getmembers(module, inspect.isclass):
      if (issubclass(cls, Source) and cls.__module__ == module.__name__
          and cls.name):
        if cls.name in found:
          raise ImportError(f'two sources named {cls.name!r}')
        found[cls.name] = cls()
  return types.MappingProxyType(dict(sorted(found.items())))


def registry() -> Mapping[str, Source]:
  """``{name: instance}`` of the ``Source`` subclass each module of this
  package defines (a class a module imports belongs to its own)."""
  return _discover(tuple(__path__))


def names(view: Optional[str] = None) -> tuple[str, ...]:
  """The sources (in name order) that serve ``view`` (``'train'``,
  ``'zero_shot'``, ``'retrieval'``, ``'in_memory'``), or all of them."""
  return tuple(name for name, source in registry().items()
               if view is None or source.serves(view))


def get(name: str, where: str = 'data.name') -> Source:
  """The source called ``name``; an unknown one is a ``ConfigError``
  naming the known ones (``where`` says which key named it)."""
  found = registry().get(name)
  if found is None:
    known = names()
    raise errors.ConfigError(f'unknown {where} {name!r}'
                             f'{errors.nearest(str(name), known)}; have '
                             f'{", ".join(known)}')
  return found


def train_records(config: Any, data: Any, where: str = 'data'
                  ) -> tuple[Sequence[dict], Callable[[], list]]:
  """The records and caption corpus of the source that ``data`` (the
  ``data`` config, or one ``data.sources`` entry laid over it) names;
  ``where`` names it in errors."""
  captions = value(data, 'captions')
  if captions not in paraphrases.CAPTION_MODES:
    raise errors.ConfigError(
        f'{where}.captions must be one of {paraphrases.CAPTION_MODES}, got '
        f'{captions!r}')
  name = data.get('name')
  source = get(name, f'{where}.name')
  if not source.serves('train'):
    raise errors.ConfigError(
        f'{where}.name={name!r} is evaluation data only; training reads '
        f'{", ".join(names("train"))}')
  if captions != 'templates' and 'captions' not in source.KEYS:
    raise errors.ConfigError(
        f'{where}.captions={captions!r} needs a bundled source ('
        f'{", ".join(n for n in names("train") if "captions" in get(n).KEYS)}'
        f'): {name!r} records bring their own captions')
  return source.train_records(config, data, where)


def train_source(config) -> tuple[Any, Optional[Callable[[], list]]]:
  """The training records and a caption corpus for the tokenizer (or None).

  The records are a random-access sequence, or with ``data.sources`` set a
  ``mixture.Mixture`` of several (``pipeline.train_dataset`` takes both).
  """
  if value(config.data, 'sources'):
    return get('mixture').train_records(config, config.data, 'data')
  return train_records(config, config.data)


def bad_record_stats(source: Any) -> Optional[dict]:
  """``{'seen', 'bad', 'bad_fraction', 'by_reason', 'by_shard'}`` of a
  source from ``train_source`` (None for sources without checking, e.g.
  digits). Cheap enough to call at every log step."""
  stats = getattr(source, 'stats', None)
  return stats() if callable(stats) else None
