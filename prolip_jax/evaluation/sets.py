"""The data an evaluator reads, named by one string.

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
``ImageSet`` and every image's captions.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence

import ml_collections
import numpy as np

from prolip_jax import errors
from prolip_jax.storage import paths
from prolip_jax.data import eval_data
from prolip_jax.data import record_format
from prolip_jax.data import record_sources
from prolip_jax.evaluation import bundled
from prolip_jax.evaluation.encoders import ImageSet

SCHEMES = ('tfds', 'folder', 'jsonl', 'array_record', 'digits', 'emoji')
# The sets that ship with the package (held in memory: ``bundled.EvalData``).
BUNDLED = ('digits', 'emoji')

# TFDS retrieval sets: name -> (image feature, caption feature, default split).
TFDS_RETRIEVAL = {'coco_captions': ('image', 'captions/text', 'test')}


def parse(spec: str) -> tuple[str, str]:
  """``'tfds:imagenet2012:validation'`` -> ``('tfds', 'imagenet2012:validation')``."""
  scheme, _, rest = str(spec).partition(':')
  if scheme not in SCHEMES:
    raise errors.ConfigError(
        f'evaluation data {spec!r}: expected one of '
        f'{", ".join(s + ":..." for s in SCHEMES)}{errors.nearest(scheme, SCHEMES)}')
  if scheme in ('folder', 'jsonl', 'array_record'):
    paths.require_local(rest, f'evaluation data {scheme}:')
  return scheme, rest


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


def _tfds_parts(rest: str) -> tuple[str, str]:
  """``'coco_captions'`` -> ``('coco_captions', 'test')``: the name and the
  split, by default the one the bundled metadata names."""
  name, _, split = rest.partition(':')
  default = (TFDS_RETRIEVAL[name][2] if name in TFDS_RETRIEVAL
             else eval_data.TFDS_DATASETS.get(name, (None, 'test'))[1])
  return name, split or default


def _template_choice(value: Any, default: Sequence[str]) -> tuple[str, ...]:
  """``()``/'' -> ``default``; an asset name -> its templates; else the
  strings themselves."""
  if not value:
    return tuple(default)
  if isinstance(value, str):
    if value in eval_data.ASSETS:
      return eval_data.metadata(value)['templates']
    return (value,)
  return tuple(value)


def zero_shot_set(cfg) -> ZeroShotSet:
  """The zero-shot set of an evaluator config (``data``, ``data_dir``,
  ``templates``, ``class_names``)."""
  scheme, rest = parse(cfg.data)
  templates = cfg.get('templates', ())
  names = cfg.get('class_names', ())
  if scheme == 'tfds':
    name, split = _tfds_parts(rest)
    asset = eval_data.TFDS_DATASETS.get(name, (None, None))[0]
    if asset is None and not (names and templates):
      raise errors.ConfigError(
          f'{cfg.data}: no bundled class names for TFDS {name!r}: set '
          f'class_names and templates (bundled: '
          f'{", ".join(sorted(eval_data.TFDS_DATASETS))})')
    meta = eval_data.metadata(asset) if asset else {'templates': (),
                                                    'classes': ()}
    source = record_sources.open_tfds(name, split, cfg.get('data_dir', ''))

    def get(i):
      record = source[i]
      return record['image'], int(record['label'])

    if isinstance(names, str):
      names = eval_data.metadata(names)['classes']
    return ZeroShotSet(ImageSet(f'{name}:{split}', len(source), get),
                       tuple(names or meta['classes']),
                       _template_choice(templates, meta['templates']))
  if scheme == 'folder':
    if not os.path.isdir(rest):
      raise errors.DatasetUnavailableError(f'{cfg.data}: no folder {rest}')
    if isinstance(names, str) and names:
      return _synset_folder(rest, names, _template_choice(
          templates, eval_data.metadata(names)['templates']))
    ds = eval_data.zero_shot_folder(
        rest, _template_choice(templates, ('a photo of a {}.',)),
        class_names=names or None)
    return ZeroShotSet(
        ImageSet(ds.name, len(ds), lambda i: (ds.images[i],
                                              int(ds.labels[i]))),
        ds.class_names, ds.templates)
  if scheme in BUNDLED:
    data = bundled_data(cfg)
    return ZeroShotSet(
        ImageSet(data.name, len(data.images),
                 lambda i: (data.images[i], int(data.labels[i]))),
        tuple(data.class_names), _template_choice(templates, data.templates))
  raise errors.ConfigError(f'{cfg.data}: {scheme} data has no class labels '
                           '(zero-shot reads tfds:, folder:, digits, emoji)')


def _synset_folder(root: str, asset: str, templates: tuple[str, ...]
                   ) -> ZeroShotSet:
  """An ImageNet-style folder: subfolders named by WordNet id (``n01440764``
  ...), labelled by the id's position in the asset's label order, scored
  against all of the asset's classes (a folder holding a subset of the
  synsets is still a 1000-way classification)."""
  meta = eval_data.metadata(asset)
  if not meta['wnids']:
    raise errors.ConfigError(f'class_names={asset!r} has no WordNet ids: '
                             'use a list of names or leave it empty')
  index = {w: i for i, w in enumerate(meta['wnids'])}
  folders = sorted(d for d in os.listdir(root)
                   if os.path.isdir(os.path.join(root, d)))
  unknown = [f for f in folders if f not in index]
  if not folders or unknown:
    raise errors.DatasetUnavailableError(
        f'{root}: expected one folder per {asset} synset (n01440764, ...), '
        f'found {", ".join(unknown[:3]) or "none"}')
  files, labels = [], []
  for folder in folders:
    for dirpath, _, names in sorted(os.walk(os.path.join(root, folder))):
      for name in sorted(names):
        if name.lower().endswith(eval_data.IMAGE_EXTS):
          files.append(os.path.join(dirpath, name))
          labels.append(index[folder])
  return ZeroShotSet(
      ImageSet(os.path.basename(os.path.normpath(root)), len(files),
               lambda i: (files[i], labels[i])),
      meta['classes'], templates)


def retrieval_set(cfg) -> RetrievalSet:
  """The retrieval set of an evaluator config (``data``, ``data_dir``,
  ``images_dir``, ``caption_key``)."""
  scheme, rest = parse(cfg.data)
  if scheme == 'tfds':
    name, split = _tfds_parts(rest)
    image_key, caption_key, _ = TFDS_RETRIEVAL.get(
        name, ('image', 'caption', 'test'))
    caption_key = cfg.get('caption_key', '') or caption_key
    source = record_sources.tfds_source(name, split, cfg.get('data_dir', ''),
                                        image_key, caption_key)
    # The captions are needed on every host (all of them are ranked against
    # every image); read once here, images later by the hosts' workers.
    captions, owner = [], []
    for i in range(len(source)):
      caps = record_format.record_captions(source[i])
      captions += caps
      owner += [i] * len(caps)
    return RetrievalSet(
        ImageSet(f'{name}:{split}', len(source),
                 lambda i: (source[i]['image'], -1)),
        captions, np.asarray(owner, np.int32))
  if scheme in ('jsonl', 'array_record'):
    if scheme == 'jsonl':
      if not os.path.isfile(rest):
        raise errors.DatasetUnavailableError(f'{cfg.data}: no file {rest}')
      ds = eval_data.retrieval_jsonl(
          cfg.get('images_dir', '') or os.path.dirname(os.path.abspath(rest)),
          rest)
    else:
      ds = eval_data.retrieval_array_record(rest)
    return RetrievalSet(
        ImageSet(os.path.basename(rest), len(ds),
                 lambda i: (ds.images[i], -1)),
        list(ds.captions), ds.image_of_text)
  if scheme in BUNDLED:
    data = bundled_data(cfg)
    captions, owner = [], []
    for i, caps in enumerate(data.captions):
      captions += caps
      owner += [i] * len(caps)
    return RetrievalSet(
        ImageSet(data.name, len(data.images), lambda i: (data.images[i], -1)),
        captions, np.asarray(owner, np.int32))
  raise errors.ConfigError(f'{cfg.data}: {scheme} data has no captions '
                           '(retrieval reads tfds:, jsonl:, array_record:, '
                           'digits, emoji)')


def bundled_data(cfg) -> bundled.EvalData:
  """The bundled set of an entry whose ``data`` is ``digits[:SPLIT]`` or
  ``emoji[:SPLIT]`` (default split ``heldout``), with its ``per_class``
  (digits), ``render_size`` (emoji) and ``phrasings``."""
  scheme, split = parse(cfg.data)
  if scheme not in BUNDLED:
    raise errors.ConfigError(f'{cfg.data}: this evaluator reads the bundled '
                             f'sets only ({", ".join(BUNDLED)})')
  return bundled.load_data(ml_collections.ConfigDict({
      'dataset': scheme, 'split': split or 'heldout',
      'per_class': cfg.get('per_class', 0),
      'render_size': cfg.get('render_size', 64),
      'phrasings': cfg.get('phrasings', 'templates')}))


def available(cfg) -> Optional[str]:
  """None when the evaluator's data can be opened, else the one-line
  reason (a cheap check: TFDS's metadata, a folder or file existing)."""
  scheme, rest = parse(cfg.data)
  try:
    if scheme == 'tfds':
      name, split = _tfds_parts(rest)
      record_sources.open_tfds(name, split, cfg.get('data_dir', ''))
    elif scheme in ('folder',) and not os.path.isdir(rest):
      return f'{cfg.data}: no folder {rest}'
    elif scheme == 'jsonl' and not os.path.isfile(rest):
      return f'{cfg.data}: no file {rest}'
  except errors.DatasetUnavailableError as e:
    return str(e)
  return None
