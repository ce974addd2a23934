"""``tfds``: a prepared TFDS data set, read at random (array_record files;
needs ``pip install tensorflow-datasets``). Never downloads: a data set
that is not prepared is one line saying how to prepare it.

Training (``data.name='tfds'``): ``tfds.data_source(data.tfds_name,
split=data.tfds_split, data_dir=data.tfds_data_dir)`` with the features
``data.tfds_image_key`` and ``data.tfds_caption_key``.
Evaluation (``data='tfds:NAME[:SPLIT]'``, the entry's ``data_dir``):
zero-shot (``imagenet2012:validation``, ``imagenet_v2:test``,
``cifar10:test``: class names and templates bundled, ``TFDS_DATASETS``;
labels read by the hosts with the images, never in a separate pass) and
retrieval (``coco_captions:test``, the Karpathy 5k test split).
"""

from __future__ import annotations

from prolip_jax import errors
from prolip_jax.data import eval_data
from prolip_jax.data import record_format
from prolip_jax.data import record_sources
from prolip_jax.data.sources import base
from prolip_jax.data.sources import views

# TFDS retrieval sets: name -> (image feature, caption feature, default split).
TFDS_RETRIEVAL = {'coco_captions': ('image', 'captions/text', 'test')}


def name_and_split(rest: str) -> tuple[str, str]:
  """``'coco_captions'`` -> ``('coco_captions', 'test')``: the name and the
  split, by default the one the bundled metadata names."""
  name, _, split = rest.partition(':')
  default = (TFDS_RETRIEVAL[name][2] if name in TFDS_RETRIEVAL
             else eval_data.TFDS_DATASETS.get(name, (None, 'test'))[1])
  return name, split or default


class TfdsDataset(base.RecordSource):
  """A prepared TFDS data set, trained on or evaluated."""

  name = 'tfds'
  KEYS = {**base.RecordSource.KEYS, **base.declared(
      'tfds_name', 'tfds_split', 'tfds_data_dir', 'tfds_image_key',
      'tfds_caption_key')}

  def open_records(self, data, where):
    tfds_name = self.value(data, 'tfds_name')
    if not tfds_name:
      raise ValueError(f"{where}.name='tfds' needs {where}.tfds_name")
    return record_sources.tfds_source(
        tfds_name, split=self.value(data, 'tfds_split'),
        data_dir=self.value(data, 'tfds_data_dir') or None,
        image_key=self.value(data, 'tfds_image_key'),
        caption_key=self.value(data, 'tfds_caption_key'))

  def zero_shot_set(self, rest, cfg):
    name, split = name_and_split(rest)
    templates = cfg.get('templates', ())
    names = cfg.get('class_names', ())
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
    return views.ZeroShotSet(
        views.ImageSet(f'{name}:{split}', len(source), get),
        tuple(names or meta['classes']),
        base.template_choice(templates, meta['templates']))

  def retrieval_set(self, rest, cfg):
    name, split = name_and_split(rest)
    image_key, caption_key, _ = TFDS_RETRIEVAL.get(
        name, ('image', 'caption', 'test'))
    caption_key = cfg.get('caption_key', '') or caption_key
    source = record_sources.tfds_source(name, split, cfg.get('data_dir', ''),
                                        image_key, caption_key)
    # The captions are needed on every host (all of them are ranked against
    # every image); read once here, images later by the hosts' workers.
    captions, owner = views.flat_captions(
        [record_format.record_captions(source[i])
         for i in range(len(source))])
    return views.RetrievalSet(
        views.ImageSet(f'{name}:{split}', len(source),
                       lambda i: (source[i]['image'], -1)),
        captions, owner)

  def available(self, rest, cfg):
    name, split = name_and_split(rest)
    try:
      record_sources.open_tfds(name, split, cfg.get('data_dir', ''))
    except errors.DatasetUnavailableError as e:
      return str(e)
    return None
