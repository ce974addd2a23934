"""Paraphrase pools: captions whose hierarchy level cannot be read from their
form.

The template captions of the bundled datasets give each level its own
wording ("an animal mammal emoji" against a bare "giraffe"), so a model can
order text uncertainty by the template instead of by how general the words
are. Here every level of a concept is worded with the same phrasings: a
caption is ``phrasing.format(content)``, where ``content`` holds the level's
words ("animal mammal", "giraffe"; for the digits "seven", "wide seven with
thin strokes") and the phrasing ("a picture of {}") is drawn from a pool
that is the same at every level. Stripping the content words thus leaves the
same set of strings at every level: only the content says how general a
caption is.

Each pool is split, once and for all, into ``TRAINING`` phrasings (drawn at
random per example when ``data.captions = 'paraphrases'``, and in the
tokenizer's corpus) and ``VALIDATION`` phrasings that training never uses
(``--config.data.phrasings=heldout`` of ``configs/eval/{digits,emoji}.py``
builds the hierarchy captions from them). No validation phrasing is a
training phrasing or a zero-shot prompt of either dataset.
"""

from __future__ import annotations

from typing import Sequence

# Every phrasing is shared by every level of both datasets (12 per level).
TRAINING = ('{}', 'a picture of {}', 'this shows {}', 'an image of {}',
            'a drawing of {}', 'an icon of {}', 'here is {}', 'it is {}')
VALIDATION = ('a sketch of {}', 'depicted here: {}', 'what you see is {}',
              'an example of {}')
PHRASINGS = {'training': TRAINING, 'validation': VALIDATION}
# Values of the training key ``data.captions`` and of the eval key
# ``data.phrasings``.
CAPTION_MODES = ('templates', 'paraphrases')
EVAL_PHRASINGS = ('templates', 'heldout')


def check_captions(mode: str) -> str:
  """``mode`` if it is a valid ``data.captions``, else a ``ValueError``."""
  if mode not in CAPTION_MODES:
    raise ValueError(f'data.captions must be one of {CAPTION_MODES}, got '
                     f'{mode!r}')
  return mode


def check_phrasings(mode: str) -> str:
  """``mode`` if it is a valid eval ``data.phrasings``, else a
  ``ValueError``."""
  if mode not in EVAL_PHRASINGS:
    raise ValueError(f'data.phrasings must be one of {EVAL_PHRASINGS}, got '
                     f'{mode!r}')
  return mode


def pool(content: str, which: str = 'training') -> tuple[str, ...]:
  """Every phrasing of ``which`` (``'training'`` | ``'validation'``) applied
  to a level's ``content`` words."""
  return tuple(p.format(content) for p in PHRASINGS[which])


def level_pools(contents: Sequence[str],
                which: str = 'training') -> list[tuple[str, ...]]:
  """One pool per level: ``level_pools(('an emoji', 'animals and nature',
  ...))[level][k]`` is the k-th phrasing of that level."""
  return [pool(c, which) for c in contents]


def heldout_caption(content: str, k: int) -> str:
  """The ``k``-th validation phrasing (cyclic) of ``content``: evaluation
  gives all levels of one image the same phrasing, so that only the content
  words differ between the captions it compares."""
  return VALIDATION[k % len(VALIDATION)].format(content)
