"""Evaluation sets held in memory (``EvalData``) and their loaders."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from prolip_jax import errors
from prolip_jax.data import digits
from prolip_jax.data import emoji
from prolip_jax.data import paraphrases


@dataclasses.dataclass
class EvalData:
  """An evaluation set held in memory.

  ``images``: ``(n, h, w, 3)`` uint8; ``labels``/``class_names``/``templates``
  for zero-shot (optional); ``captions[i]``: image i's captions, ordered from
  the most general to the most specific when they form a hierarchy;
  ``level_names`` names those positions; ``label_sets`` for multi-label
  zero-shot; ``keys`` name the images.
  """
  name: str
  images: np.ndarray
  keys: list[str]
  labels: Optional[np.ndarray] = None
  class_names: Optional[Sequence[str]] = None
  templates: Optional[Sequence[str]] = None
  captions: Optional[list[list[str]]] = None
  level_names: Optional[Sequence[str]] = None
  label_sets: Optional[list[list[int]]] = None


DIGITS_LEVEL_NAMES = (
    'name', 'numeral', "'a' + name", 'handwritten digit', '1 attribute',
    '2 attributes', '3 attributes', '3 attributes, long')


def _suffix(phrasings: str) -> str:
  # The default keeps today's name; held-out phrasings are told apart.
  return '' if paraphrases.check_phrasings(phrasings) == 'templates' else (
      '-heldout-phrasings')


def digits_data(split: str = 'heldout', per_class: int = 0,
                phrasings: str = 'templates') -> EvalData:
  """The bundled MNIST digits with all eight captions per image
  (``digits.captions_for``; ``per_class`` > 0 keeps the first k of each
  class). ``phrasings='heldout'``: the same eight positions and levels
  worded with the validation phrasings that training never uses
  (``digits.heldout_captions_for``)."""
  images, labels = digits.split(split)
  if per_class:
    idx = np.concatenate([np.flatnonzero(labels == c)[:per_class]
                          for c in range(len(digits.CLASS_NAMES))])
    images, labels = images[idx], labels[idx]
  else:
    idx = np.arange(len(labels))
  suffix = _suffix(phrasings)
  caps = (digits.heldout_captions_for(images, labels) if suffix
          else digits.captions_for(images, labels))
  return EvalData(
      name=f'digits-{split}{suffix}', images=np.repeat(images[..., None], 3, -1),
      keys=[f'{split}-{i:05d}' for i in idx], labels=labels,
      class_names=digits.CLASS_NAMES, templates=digits.EVAL_TEMPLATES,
      captions=caps, level_names=DIGITS_LEVEL_NAMES)


def emoji_data(split: str = 'heldout', size: int = 64,
               phrasings: str = 'templates') -> EvalData:
  """The bundled emoji of a split (``emoji.split``), one image per concept:
  zero-shot over the split's names (``emoji.EVAL_TEMPLATES``), the five
  captions of ``emoji.captions_for`` (levels 1-3: group, subgroup, name).
  ``phrasings='heldout'``: the same five positions and levels worded with
  the validation phrasings that training never uses
  (``emoji.heldout_captions_for``); the zero-shot prompts stay."""
  items = emoji.split(split)
  suffix = _suffix(phrasings)
  caps = (emoji.heldout_captions_for(items) if suffix
          else emoji.captions_for(items))
  return EvalData(
      name=f'emoji-{split}{suffix}', images=emoji.images(split, size),
      keys=[c.name for c in items],
      labels=np.arange(len(items), dtype=np.int32),
      class_names=[emoji.class_name(c) for c in items],
      templates=emoji.EVAL_TEMPLATES, captions=caps,
      level_names=emoji.LEVEL_NAMES)


def load_data(cfg) -> EvalData:
  """The ``EvalData`` of an eval config's ``data`` (``dataset``, ``split``,
  ``per_class`` (digits), ``render_size`` (emoji), ``phrasings``)."""
  phrasings = cfg.get('phrasings', 'templates')
  if phrasings not in paraphrases.EVAL_PHRASINGS:
    raise errors.ConfigError(f'data.phrasings must be one of '
                             f'{paraphrases.EVAL_PHRASINGS}, got '
                             f'{phrasings!r}')
  if cfg.dataset == 'digits':
    return digits_data(cfg.get('split', 'heldout'), cfg.get('per_class', 0),
                       phrasings)
  if cfg.dataset == 'emoji':
    return emoji_data(cfg.get('split', 'heldout'), cfg.get('render_size', 64),
                      phrasings)
  raise ValueError(f'unknown eval dataset {cfg.dataset!r} (known: digits, '
                   'emoji)')

