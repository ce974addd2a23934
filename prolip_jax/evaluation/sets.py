"""The data an evaluator reads, named by one string: ``'<source>:<rest>'``.

The source is one of ``prolip_jax/data/sources/`` (the registry training
reads too), the rest is its own:

=============================  ===============================================
``tfds:NAME[:SPLIT]``          a prepared TFDS data set, read at random
                               (array_record files): ``imagenet2012:validation``,
                               ``imagenet_v2:test``, ``cifar10:test``,
                               ``coco_captions:test`` (the Karpathy 5k test
                               split). Never downloads: a data set that is not
                               prepared is one line saying how to prepare it.
``folder:PATH``                zero-shot: ``PATH/<class folder>/*.jpg``; with
                               ``class_names='imagenet'`` the folders are
                               synsets (``n01440764``, ...: an ImageNet ``val``
                               folder), labelled in ILSVRC-2012 order.
``jsonl:PATH``                 retrieval: ``{"image": "rel/path.jpg",
                               "captions": [...]}`` lines; images relative to
                               ``images_dir`` (default: the file's folder).
``array_record:GLOB``          retrieval: our array_record shards (records
                               sharing a ``key`` are one image).
``digits[:SPLIT]``,            the bundled sets (``heldout``, ``val``, ...).
``emoji[:SPLIT]``
=============================  ===============================================

``zero_shot_set(cfg)`` gives an ``ImageSet`` whose labels come with the
images (TFDS labels are read by the hosts with the images, never in a
separate pass) plus class names and templates; ``retrieval_set(cfg)`` an
``ImageSet`` and every image's captions; ``bundled_data(cfg)`` a bundled
set held in memory. Each asks the source for its view
(``data/sources/base.py``).
"""

from __future__ import annotations

from typing import Any, Optional

from prolip_jax import errors
from prolip_jax.data import sources
from prolip_jax.data.sources import base
from prolip_jax.data.sources.views import EvalData
from prolip_jax.data.sources.views import RetrievalSet
from prolip_jax.data.sources.views import ZeroShotSet
from prolip_jax.storage import paths

def bundled() -> tuple[str, ...]:
  """The sources whose evaluation sets ship with the package and are held
  in memory (``digits``, ``emoji``)."""
  return sources.names('in_memory')


def parse(spec: str) -> tuple[str, str]:
  """``'tfds:imagenet2012:validation'`` -> ``('tfds', 'imagenet2012:validation')``."""
  name, _, rest = str(spec).partition(':')
  known = tuple(n for n in sources.names() if any(
      sources.get(n).serves(view) for view in base.EVAL_VIEWS))
  if name not in known:
    raise errors.ConfigError(
        f'evaluation data {spec!r}: expected one of '
        f'{", ".join(s + ":..." for s in known)}{errors.nearest(name, known)}')
  if sources.get(name).LOCAL_PATH:
    paths.require_local(rest, f'evaluation data {name}:')
  return name, rest


def _view(cfg: Any, view: str, lacks: str, reader: str) -> Any:
  """The ``view`` of the source an entry's ``data`` names; a source that
  does not serve it is a ``ConfigError`` saying what it ``lacks`` and
  which sources the ``reader`` reads."""
  name, rest = parse(cfg.data)
  source = sources.get(name)
  if not source.serves(view):
    raise errors.ConfigError(
        f'{cfg.data}: {name} data {lacks} ({reader} reads '
        f'{", ".join(n + ":" for n in sources.names(view))})')
  return getattr(source, base.METHODS[view])(rest, cfg)


def zero_shot_set(cfg) -> ZeroShotSet:
  """The zero-shot set of an evaluator config (``data``, ``data_dir``,
  ``templates``, ``class_names``)."""
  return _view(cfg, 'zero_shot', 'has no class labels', 'zero-shot')


def retrieval_set(cfg) -> RetrievalSet:
  """The retrieval set of an evaluator config (``data``, ``data_dir``,
  ``images_dir``, ``caption_key``)."""
  return _view(cfg, 'retrieval', 'has no captions', 'retrieval')


def bundled_data(cfg) -> EvalData:
  """The bundled set of an entry whose ``data`` is ``digits[:SPLIT]`` or
  ``emoji[:SPLIT]`` (default split ``heldout``), with its ``per_class``
  (digits), ``render_size`` (emoji) and ``phrasings``."""
  return _view(cfg, 'in_memory', 'is not a bundled set', 'this evaluator')


def available(cfg) -> Optional[str]:
  """None when the evaluator's data can be opened, else the one-line
  reason (a cheap check: TFDS's metadata, a folder or file existing)."""
  name, rest = parse(cfg.data)
  return sources.get(name).available(rest, cfg)
