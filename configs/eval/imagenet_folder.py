"""ImageNet-1k zero-shot from an image folder with one subfolder per synset
(``n01440764/``, ...: the layout of ImageNet's ``val`` after the usual
preparation), 80 templates, CSD and cosine.

  python -m prolip_jax.evaluate --workdir DIR --config configs/eval/imagenet_folder.py \
      --config.evals.imagenet.data=folder:/data/imagenet/val

A folder holding some of the synsets is scored 1000-way all the same.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.evals = ml_collections.ConfigDict({'imagenet': {
      'kind': 'zero_shot',
      'data': 'folder:/data/imagenet/val',  # set on the command line
      'class_names': 'imagenet',  # folders are synsets, labels in ILSVRC order
      'templates': 'imagenet',  # the 80 CLIP templates
      'metrics': ('csd', 'cosine'), 'ks': (1, 5),
      'batch_size': 256}})
  return c
