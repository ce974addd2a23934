"""Grain input pipelines: record source -> shuffled, augmented, tokenised batches.

A training dataset is a random-access ``grain.MapDataset`` whose element
``step`` is the local batch of that step. That makes resumption exact with no
iterator state beyond the step itself: a resumed run reads ``ds[step:]``.
Records are dicts with ``image`` (HxWx3 uint8 array, or encoded bytes) and
``caption`` (str) or ``captions`` (list of str, one drawn per record; an
entry may be a list of phrasings of one level, then one of them is drawn).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import grain
import numpy as np

from prolip_jax.data import image_decode
from prolip_jax.data import mixture
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer


def _caption(record: dict, rng: Optional[np.random.Generator]) -> str:
  """The record's caption: one of ``captions`` drawn with ``rng`` (the
  first without one); an entry that is itself a list (a pool of phrasings
  of one level, ``data.captions = 'paraphrases'``) is a second draw."""
  if 'captions' not in record:
    return record['caption']
  caps = record['captions']
  cap = caps[int(rng.integers(len(caps)))] if rng is not None else caps[0]
  if not isinstance(cap, (list, tuple)):  # a flat list: one draw, as always
    return cap
  return cap[int(rng.integers(len(cap)))] if rng is not None else cap[0]


class TrainTransform(grain.transforms.RandomMap):
  """Record -> ``{'image': (s, s, 3) uint8, 'tokens': (L,) int32, 'aug'}``.

  ``aug`` is the view's ``(AUG_DIM,)`` augmentation vector; with
  ``augment.color_on_device`` the view is only cropped and ``color_order``
  ``(4,)`` (the jitter order) goes with it to the train step. With
  ``num_views = V > 1`` (multi-view objectives: UniCLIP), the record gives V
  independently augmented views of its image: ``image (V, s, s, 3)`` and
  ``aug (V, AUG_DIM)``, one caption.
  """

  def __init__(self, tokenizer: Tokenizer, image_size: int,
               augment: transforms.AugmentConfig, num_views: int = 1):
    if num_views < 1:
      raise ValueError(f'num_views must be >= 1, got {num_views}')
    self.tokenizer = tokenizer
    self.image_size = image_size
    self.augment = augment
    self.num_views = num_views

  def random_map(self, element, rng: np.random.Generator):
    image = image_decode.decode_rgb(element['image'])
    # Views draw from the one per-element RNG in turn, then the caption: for
    # V = 1 the draws (and the output) are exactly the single-view ones.
    views = [transforms.train_view_and_order(image, self.image_size, rng,
                                             self.augment)
             for _ in range(self.num_views)]
    tokens = self.tokenizer(_caption(element, rng))[0]
    if self.num_views == 1:
      image, aug, order = views[0]
    else:
      image, aug, order = (np.stack(parts) for parts in zip(*views))
    out = {'image': image, 'tokens': tokens, 'aug': aug}
    if self.augment.color_on_device:  # colour_jitter in the train step
      out['color_order'] = order
    return out


def local_batch_size(global_batch_size: int, process_count: int) -> int:
  """Rows each host reads per step; the global batch must divide evenly."""
  if global_batch_size % process_count:
    raise ValueError(f'batch_size {global_batch_size} is not divisible by the '
                     f'{process_count} processes')
  return global_batch_size // process_count


def train_dataset(source: Sequence[dict] | mixture.Mixture, *,
                  tokenizer: Tokenizer, image_size: int,
                  global_batch_size: int, seed: int,
                  augment: transforms.AugmentConfig = transforms.AugmentConfig(),
                  process_index: int = 0, process_count: int = 1,
                  num_views: int = 1) -> grain.MapDataset:
  """Infinite dataset of local batches; element ``i`` is step ``i``'s batch.

  The global batch of step i is elements ``[i*B, (i+1)*B)`` of one shuffled
  stream (reshuffled every epoch with ``seed``), and process p reads its
  contiguous ``B / process_count`` rows of it. So the global batch does not
  depend on how many hosts read it, hosts never read the same record in an
  epoch, and each host decodes only its own rows (Grain datasets are lazy).
  Augmentation draws from a per-element RNG derived from ``seed``, so any
  element can be recomputed exactly. ``source`` may be a
  ``mixture.Mixture`` (``data.sources``): the stream is then the sources'
  weighted mix (``mixture.mixed_records``, each batch's records permuted),
  batched the same way, so the first ``i*B`` records hold
  ``mixture.records_drawn(weights, i*B)`` of each source.
  ``num_views > 1``: ``image`` is ``(b, V, s, s, 3)`` and ``aug``
  ``(b, V, AUG_DIM)`` (see ``TrainTransform``).
  """
  ds = record_stream(source, seed, global_batch_size, process_index,
                     process_count)
  local = local_batch_size(global_batch_size, process_count)
  ds = ds.random_map(TrainTransform(tokenizer, image_size, augment,
                                    num_views))
  return ds.batch(local, drop_remainder=True)[process_index::process_count]


def record_stream(source: Sequence[dict] | mixture.Mixture, seed: int,
                  global_batch_size: int, process_index: int = 0,
                  process_count: int = 1) -> grain.MapDataset:
  """The infinite shuffled (or mixed) record stream of ``train_dataset``,
  seeded by ``seed``, before any transform: the one stream of the host
  path and of the DALI path (``data/dali_decode.py``)."""
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index {process_index} outside [0, '
                     f'{process_count})')
  if isinstance(source, mixture.Mixture):
    return mixture.mixed_records(source, seed, global_batch_size)
  if len(source) < global_batch_size:
    raise ValueError(f'the dataset has {len(source)} records, fewer than '
                     f'one batch of {global_batch_size}')
  return grain.MapDataset.source(source).seed(seed).shuffle().repeat(None)


def iterate_from(ds: grain.MapDataset, start_step: int, num_workers: int = 0,
                 num_threads: int = 4, prefetch: int = 8) -> Iterator[Any]:
  """Iterator over ``ds[start_step:]`` with thread (and process) prefetch."""
  it = ds[start_step:].to_iter_dataset(grain.ReadOptions(
      num_threads=num_threads, prefetch_buffer_size=prefetch))
  if num_workers > 0:
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return iter(it)


def eval_images(images: Sequence[Any], image_size: int,
                view: str = 'default',
                order: str = image_decode.RGB_FIRST) -> np.ndarray:
  """Eval transform of a list of images -> ``(n, s, s, 3)`` uint8.

  ``view``: 'default' (``transforms.eval_view``) or 'release' (open_clip's
  torchvision resize + centre crop, ``transforms.release_eval_view``).
  ``order``: 'rgb_first' converts every image to RGB before resizing (our
  models' eval transform); 'release' resizes and crops encoded bytes, file
  paths and PIL images in the mode they were stored in and converts to RGB
  after the crop, as open_clip does (``image_decode``). Arrays are RGB
  pixels in both orders.
  """
  fn = transforms.EVAL_VIEWS[view]
  decode = (image_decode.decode_keeping_mode
            if image_decode.check_order(order) == image_decode.RELEASE
            else image_decode.decode_rgb)
  return np.stack([fn(decode(x), image_size) for x in images])
