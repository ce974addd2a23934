"""Zero-shot classification and retrieval evaluation sets.

Metadata: class names and prompt templates ship as JSON package data in
``prolip_jax/data/assets/`` (``imagenet.json``: the 1,000 class names and 80
templates of OpenAI CLIP's ImageNet prompt-engineering notebook;
``cifar10.json`` / ``cifar100.json``: CLIP's ``data/prompts.md`` names and
18 templates). ``metadata('imagenet')`` returns ``{'classes', 'templates',
'wnids'}`` (``wnids``: the synset folder names of an ImageNet folder, in
label order).

``ZeroShotDataset`` = images + labels + class names + templates, from an
image folder with one subfolder per class (``zero_shot_folder``).
``TFDS_DATASETS`` names the TFDS sets whose class names and templates are
bundled.

``RetrievalDataset`` = images with several captions each, from array_record
shards (records sharing a ``key`` are one image's captions) or from an image
folder + JSONL (``{"image": "rel/path.jpg", "captions": [...]}``).

Images stay encoded (bytes or file paths) until ``batches`` decodes them
with the eval transform (shorter side to ``image_size``, centre crop), so a
50k-image set is not held decoded in memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.resources
import json
import os
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from prolip_jax.data import image_decode
from prolip_jax.data import record_format
from prolip_jax.data import record_sources
from prolip_jax.data import transforms

ASSETS = ('imagenet', 'cifar10', 'cifar100')
# TFDS dataset -> (asset, default split)
TFDS_DATASETS = {
    'imagenet2012': ('imagenet', 'validation'),
    'imagenet_v2': ('imagenet', 'test'),
    'cifar10': ('cifar10', 'test'),
    'cifar100': ('cifar100', 'test'),
}
IMAGE_EXTS = ('.jpg', '.jpeg', '.png', '.webp', '.bmp', '.gif', '.tif',
              '.tiff')


@functools.lru_cache(maxsize=None)
def metadata(name: str) -> dict:
  """``{'classes': tuple, 'templates': tuple, 'source': str}`` of an asset."""
  if name not in ASSETS:
    raise ValueError(f'no metadata for {name!r}; have {ASSETS}')
  text = importlib.resources.files('prolip_jax.data').joinpath(
      'assets', f'{name}.json').read_text(encoding='utf-8')
  data = json.loads(text)
  return {'classes': tuple(data['classes']),
          'templates': tuple(data['templates']), 'source': data['source'],
          'wnids': tuple(data.get('wnids', ()))}


def load_image(image: Any) -> np.ndarray:
  """HxWx3 uint8 from a file path, encoded bytes or an array."""
  if isinstance(image, (str, os.PathLike)):
    with open(image, 'rb') as f:
      image = f.read()
  return image_decode.decode_rgb(image)


def _eval_batches(get_image, n: int, batch_size: int, image_size: int,
                  num_threads: int, view: str, order: str
                  ) -> Iterator[tuple[np.ndarray, slice]]:
  fn = transforms.EVAL_VIEWS[view]
  decode = (image_decode.decode_keeping_mode
            if image_decode.check_order(order) == image_decode.RELEASE
            else load_image)

  def load(i):
    return fn(decode(get_image(i)), image_size)
  with concurrent.futures.ThreadPoolExecutor(max(1, num_threads)) as pool:
    for start in range(0, n, batch_size):
      idx = range(start, min(n, start + batch_size))
      yield np.stack(list(pool.map(load, idx))), slice(start, idx.stop)


@dataclasses.dataclass
class ZeroShotDataset:
  """A zero-shot classification set.

  ``images[i]`` is a file path, encoded bytes or an HxWx3 array (any random
  access sequence); ``labels[i]`` indexes
  ``class_names``; prompts are ``template.format(class_name)``.
  """
  images: Sequence[Any]
  labels: np.ndarray
  class_names: tuple[str, ...]
  templates: tuple[str, ...]
  name: str = ''

  def __post_init__(self):
    self.labels = np.asarray(self.labels, np.int32)
    if len(self.images) != len(self.labels):
      raise ValueError(f'{len(self.images)} images but {len(self.labels)} '
                       'labels')
    if len(self.labels) and not (
        0 <= self.labels.min() and self.labels.max() < len(self.class_names)):
      raise ValueError('labels outside [0, num_classes)')
    if not self.templates or any('{}' not in t for t in self.templates):
      raise ValueError('every template needs a {} for the class name')

  def __len__(self) -> int:
    return len(self.labels)

  @property
  def num_classes(self) -> int:
    return len(self.class_names)

  def prompts(self) -> list[str]:
    """Class-major: ``prompts()[c * T + t] = templates[t].format(names[c])``,
    i.e. reshape to ``(num_classes, num_templates)``."""
    return [t.format(c) for c in self.class_names for t in self.templates]

  def image(self, i: int) -> np.ndarray:
    return load_image(self.images[i])

  def batches(self, batch_size: int, image_size: int, num_threads: int = 8,
              view: str = 'default', order: str = 'rgb_first'
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(images (b, s, s, 3) uint8 eval views, labels (b,))`` in order; the
    last batch may be smaller. ``view`` / ``order``: the eval transform, as
    in ``pipeline.eval_images`` (a model's ``image_view`` /
    ``image_order``)."""
    for imgs, sl in _eval_batches(lambda i: self.images[i], len(self),
                                  batch_size, image_size, num_threads, view,
                                  order):
      yield imgs, self.labels[sl]


def zero_shot_folder(root: str,
                     templates: Sequence[str] = ('a photo of a {}.',),
                     class_names: Optional[Sequence[str] | dict] = None,
                     name: str = '') -> ZeroShotDataset:
  """``root/<class folder>/*.jpg`` -> a ZeroShotDataset.

  Classes are the subfolders in sorted order. Their names are the folder
  names with ``_`` as spaces, unless ``class_names`` is given: a list in
  sorted-folder order or a ``{folder: name}`` dict. ``templates`` may be an
  asset name (``'imagenet'``) to use its templates.
  """
  if isinstance(templates, str):
    templates = metadata(templates)['templates']
  folders = sorted(d for d in os.listdir(root)
                   if os.path.isdir(os.path.join(root, d)))
  if not folders:
    raise ValueError(f'{root} has no class subfolders')
  if class_names is None:
    names = tuple(f.replace('_', ' ') for f in folders)
  elif isinstance(class_names, dict):
    names = tuple(class_names[f] for f in folders)
  else:
    names = tuple(class_names)
    if len(names) != len(folders):
      raise ValueError(f'{len(names)} class names for {len(folders)} folders')
  images, labels = [], []
  for label, folder in enumerate(folders):
    for dirpath, _, files in sorted(os.walk(os.path.join(root, folder))):
      for f in sorted(files):
        if f.lower().endswith(IMAGE_EXTS):
          images.append(os.path.join(dirpath, f))
          labels.append(label)
  return ZeroShotDataset(images, np.asarray(labels), names, tuple(templates),
                         name=name or os.path.basename(os.path.normpath(root)))


@dataclasses.dataclass
class RetrievalDataset:
  """Images with several captions each.

  ``captions`` is flat; ``image_of_text[j]`` is the index of caption ``j``'s
  image (the layout ``evaluate.retrieval_recall`` takes); ``keys[i]`` names
  image ``i``.
  """
  images: Sequence[Any]
  captions: list[str]
  image_of_text: np.ndarray
  keys: list[str]

  def __post_init__(self):
    self.image_of_text = np.asarray(self.image_of_text, np.int32)
    if len(self.captions) != len(self.image_of_text):
      raise ValueError('captions and image_of_text differ in length')

  def __len__(self) -> int:
    return len(self.images)

  def captions_of(self, i: int) -> list[str]:
    return [c for c, j in zip(self.captions, self.image_of_text) if j == i]

  def batches(self, batch_size: int, image_size: int, num_threads: int = 8,
              view: str = 'default', order: str = 'rgb_first'
              ) -> Iterator[np.ndarray]:
    """Eval views ``(b, s, s, 3)`` uint8 of the images, in order (``view`` /
    ``order``: as ``ZeroShotDataset.batches``)."""
    for imgs, _ in _eval_batches(lambda i: self.images[i], len(self),
                                 batch_size, image_size, num_threads, view,
                                 order):
      yield imgs


def _group(items) -> RetrievalDataset:
  """(key, image, [captions]) in order -> RetrievalDataset, merging keys."""
  index: dict[str, int] = {}
  images, keys, captions, owner = [], [], [], []
  for key, image, caps in items:
    if key not in index:
      index[key] = len(images)
      images.append(image)
      keys.append(key)
    for c in caps:
      if isinstance(c, str) and c.strip():
        captions.append(c.strip())
        owner.append(index[key])
  return RetrievalDataset(images, captions, np.asarray(owner, np.int32), keys)


def retrieval_array_record(paths_or_glob: str | Sequence[str]
                           ) -> RetrievalDataset:
  """Retrieval set from array_record shards: records sharing ``key`` are one
  image (its bytes taken from the first such record) and its captions."""
  src = record_sources.ArrayRecordSource(paths_or_glob)
  return _group((r['key'], r['image'], record_format.record_captions(r))
                for r in (src[i] for i in range(len(src))))


def retrieval_jsonl(images_dir: str, jsonl_path: str) -> RetrievalDataset:
  """Retrieval set from ``{"image": "rel/path", "captions": [...]}`` lines
  (``"caption": str`` works too); paths are relative to ``images_dir``."""
  def items():
    with open(jsonl_path, encoding='utf-8') as f:
      for line in f:
        if not line.strip():
          continue
        obj = json.loads(line)
        rel = obj['image']
        caps = obj.get('captions', obj.get('caption', []))
        caps = [caps] if isinstance(caps, str) else caps
        yield rel, (rel if os.path.isabs(rel)
                    else os.path.join(images_dir, rel)), caps
  return _group(items())
