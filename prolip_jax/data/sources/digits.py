"""``digits``: the bundled MNIST demo (``data/digits.py``).

Training (``data.name='digits'``): ``data.split`` picks ``'train'``
(default), ``'fit'`` or ``'val'``; ``data.captions`` ``'templates'``
(default: each level in its own wording) or ``'paraphrases'`` (each level
worded with the same pool of training phrasings, one drawn per example).
Evaluation (``data='digits[:SPLIT]'``, default split ``heldout``): the
split held in memory with all eight captions per image (``per_class`` > 0
keeps the first k of each class; ``phrasings='heldout'`` words them with
the validation phrasings training never uses).
"""

from __future__ import annotations

import numpy as np

from prolip_jax.data import digits
from prolip_jax.data import paraphrases
from prolip_jax.data.sources import base
from prolip_jax.data.sources.views import EvalData

LEVEL_NAMES = (
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
      captions=caps, level_names=LEVEL_NAMES)


class BundledDigits(base.BundledSource):
  """The bundled MNIST digits, trained on and evaluated."""

  name = 'digits'
  KEYS = base.declared('split', 'captions')

  def train_records(self, config, data, where):
    captions = self.value(data, 'captions')
    return (digits.records(self.value(data, 'split'), captions),
            lambda: digits.tokenizer_corpus(captions))

  def in_memory(self, rest, cfg):
    return digits_data(rest or 'heldout', cfg.get('per_class', 0),
                       self.phrasings(cfg))
