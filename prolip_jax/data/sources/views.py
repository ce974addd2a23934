"""What an evaluator reads from a source: its evaluation views.

* ``ImageSet``: images to embed, read at random (``get(i)`` -> image,
  label); ``evaluation/encoders.py`` embeds any of them.
* ``ZeroShotSet``: an ``ImageSet`` whose labels come with the images, the
  class names and the prompt templates (the ``zero_shot`` kind).
* ``RetrievalSet``: an ``ImageSet`` and every image's captions (the
  ``retrieval`` and ``uncertainty`` kinds).
* ``EvalData``: a bundled set held in memory (images, labels, captions
  ordered by hierarchy level; the kinds of ``evaluation/in_memory.py``).

A source (``sources/base.py``) serves the views it can; they live here, in
``data``, because the sources that build them sit below ``evaluation``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np


@dataclasses.dataclass
class ImageSet:
  """Images to embed, read at random: ``get(i)`` -> (image, label).

  The image is a file path, encoded bytes or an ``(h, w, 3)`` uint8 array;
  the label an int (``-1`` when the set has none). ``get`` runs on Grain's
  threads, so it must be safe to call from several threads.
  """
  name: str
  size: int
  get: Callable[[int], tuple[Any, int]]


@dataclasses.dataclass
class ZeroShotSet:
  """Images with labels, the class names and the prompt templates."""
  images: ImageSet
  class_names: tuple[str, ...]
  templates: tuple[str, ...]


@dataclasses.dataclass
class RetrievalSet:
  """Images and their captions: ``captions[j]`` belongs to image
  ``image_of_text[j]``."""
  images: ImageSet
  captions: list[str]
  image_of_text: np.ndarray


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


def flat_captions(captions_of_images: Sequence[Sequence[str]]
                  ) -> tuple[list[str], np.ndarray]:
  """``[[a, b], [c]]`` -> ``([a, b, c], [0, 0, 1])``: every caption and
  the index of its image (``RetrievalSet``'s layout)."""
  captions, owner = [], []
  for i, caps in enumerate(captions_of_images):
    captions += caps
    owner += [i] * len(caps)
  return captions, np.asarray(owner, np.int32)


def zero_shot_in_memory(data: EvalData, templates: Sequence[str]
                        ) -> ZeroShotSet:
  """The zero-shot view of a set held in memory, with ``templates``."""
  return ZeroShotSet(
      ImageSet(data.name, len(data.images),
               lambda i: (data.images[i], int(data.labels[i]))),
      tuple(data.class_names), tuple(templates))


def retrieval_in_memory(data: EvalData) -> RetrievalSet:
  """The retrieval view of a set held in memory: every caption of every
  image."""
  captions, owner = flat_captions(data.captions)
  return RetrievalSet(
      ImageSet(data.name, len(data.images), lambda i: (data.images[i], -1)),
      captions, owner)
