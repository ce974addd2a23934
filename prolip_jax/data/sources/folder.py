"""``folder``: an image folder with one subfolder per class, for zero-shot.

Evaluation (``data='folder:PATH'``): ``PATH/<class folder>/*.jpg``,
classes in sorted folder order named after the folders (or the entry's
``class_names``); with ``class_names='imagenet'`` the folders are synsets
(``n01440764``, ...: an ImageNet ``val`` folder), labelled in ILSVRC-2012
order.
"""

from __future__ import annotations

import os

from prolip_jax import errors
from prolip_jax.data import eval_data
from prolip_jax.data.sources import base
from prolip_jax.data.sources import views


class ClassFolders(base.Source):
  """Class folders of images (evaluation only)."""

  name = 'folder'
  LOCAL_PATH = True

  def zero_shot_set(self, rest, cfg):
    if not os.path.isdir(rest):
      raise errors.DatasetUnavailableError(f'{cfg.data}: no folder {rest}')
    templates = cfg.get('templates', ())
    names = cfg.get('class_names', ())
    if isinstance(names, str) and names:
      return synset_folder(rest, names, base.template_choice(
          templates, eval_data.metadata(names)['templates']))
    ds = eval_data.zero_shot_folder(
        rest, base.template_choice(templates, ('a photo of a {}.',)),
        class_names=names or None)
    return views.ZeroShotSet(
        views.ImageSet(ds.name, len(ds), lambda i: (ds.images[i],
                                                    int(ds.labels[i]))),
        ds.class_names, ds.templates)

  def available(self, rest, cfg):
    return None if os.path.isdir(rest) else f'{cfg.data}: no folder {rest}'


def synset_folder(root: str, asset: str, templates: tuple[str, ...]
                  ) -> views.ZeroShotSet:
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
  return views.ZeroShotSet(
      views.ImageSet(os.path.basename(os.path.normpath(root)), len(files),
                     lambda i: (files[i], labels[i])),
      meta['classes'], templates)
