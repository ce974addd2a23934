"""Training images decoded, cropped and resized by NVIDIA DALI
(``data.decode='dali'``, the optional extra ``pip install -e '.[dali]'``).

The host path (``pipeline.train_dataset``) decodes every JPEG on the CPU,
250-350 images/s per core on a GPU node (docs/performance.md). Here the
host keeps everything that decides *what* a batch is and hands DALI only
the pixels' work:

* the same record stream (``pipeline.record_stream``: seed, shuffle,
  mixture, ``process_index``'s contiguous rows of each global batch), the
  same per-element RNG and the same draws in the same order
  (``transforms.draw_view``: crop box, jitter factors and order,
  grayscale), the same caption draw and tokens. The crop box is drawn on
  the size the host path would have decoded (a JPEG at its reduced DCT
  scale, ``image_decode.header_size`` read from the header alone) and
  mapped to the full image;
* DALI decodes the crop's region only (``fn.decoders.image_slice``:
  ``device='mixed'``, nvJPEG, when JAX's first local device is a GPU;
  ``device='cpu'``, libjpeg-turbo, otherwise) and resizes it to ``s x s``
  (``fn.resize``, cubic, antialiased when shrinking);
* the colour jitter and grayscale run in the train step
  (``data/color.py``): ``data.decode='dali'`` implies
  ``data.color_on_device``.

So the augmentation distribution is the host path's, draw for draw; only
the resampling differs (DALI's cubic filter vs Pillow's antialiased
bicubic of ``transforms.resized_crop``, on the full-scale decode instead of
the reduced one): a bound stated in docs/data.md and checked by
``tests/test_dali_decode.py``. Element ``i`` of the dataset is still step
``i``'s local batch, a pure function of (seed, step, process): a resumed
run reads ``ds[step:]`` (exact resume). The batch comes back to host memory
and is put on the mesh as the host path's is (``sharding.host_to_global``).

Nothing imports DALI unless ``data.decode='dali'``: ``import_dali`` is the
one place, and its ``ConfigError`` says how to install it.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import grain
import numpy as np

from prolip_jax import errors
from prolip_jax.data import bad_records
from prolip_jax.data import mixture
from prolip_jax.data import pipeline
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer

HOST, DALI = 'host', 'dali'
DECODES = (HOST, DALI)
INSTALL = "pip install -e '.[dali]'"


def import_dali():
  """``(dali, fn, types)`` of NVIDIA DALI, or a one-line ``ConfigError``
  saying how to install it."""
  try:
    # pylint: disable=g-import-not-at-top
    from nvidia import dali
    from nvidia.dali import fn
    from nvidia.dali import types
  except ImportError as e:
    raise errors.ConfigError(
        f"data.decode='dali' needs NVIDIA DALI, which is not installed "
        f'({e}): {INSTALL} (or data.decode=host)') from None
  return dali, fn, types


def check_config(decode: str, own_batches: str = ''):
  """``ConfigError`` for a ``data.decode`` that is no decode, for 'dali'
  without DALI installed, or with an objective that builds batches of its
  own (``own_batches``: its name; ``Objective.wrap_dataset``, PC-CLIP's
  pairs, decodes on the host)."""
  if decode not in DECODES:
    raise errors.ConfigError(f'data.decode={decode!r}: use one of '
                             f'{", ".join(DECODES)}')
  if decode != DALI:
    return
  import_dali()
  if own_batches:
    raise errors.ConfigError(
        f"data.decode='dali' serves the plain training batches; objective "
        f'{own_batches!r} builds its own (wrap_dataset), decoded on the '
        'host: use data.decode=host')


def check_source(source: Any, name: str):
  """``ConfigError`` unless every record source of ``source`` is read
  checked (``bad_records.CheckedSource``: array_record, TFDS), whose
  images stay encoded: a bundled set (digits, emoji) holds arrays."""
  parts = source.sources if isinstance(source, mixture.Mixture) else (source,)
  for part in parts:
    if not isinstance(part, bad_records.CheckedSource):
      raise errors.ConfigError(
          f"data.decode='dali' decodes encoded image records (array_record, "
          f'TFDS); the source {name!r} holds decoded image arrays: use '
          'data.decode=host, or write its records to array_record shards '
          '(docs/data.md)')


def full_box(box: Sequence[int], scale: int, width: int, height: int
             ) -> tuple[int, int, int, int]:
  """The ``(left, top, w, h)`` box drawn on the image decoded at DCT scale
  ``1/scale`` as a box of the full ``width`` x ``height`` image: the full
  pixels its reduced pixels cover, clipped to the image."""
  left, top, w, h = (int(v) * scale for v in box)
  return left, top, min(w, width - left), min(h, height - top)


class PlanTransform(grain.transforms.RandomMap):
  """Checked record (``image`` bytes, ``image_size``) -> what DALI and the
  train step need: ``encoded`` (uint8 bytes), ``box`` ((4,) or (V, 4)
  int32, full-image ``(left, top, w, h)``), ``tokens``, ``aug``,
  ``color_order``; the draws of ``pipeline.TrainTransform``, in its
  order."""

  def __init__(self, tokenizer: Tokenizer,
               augment: transforms.AugmentConfig, num_views: int = 1):
    self.tokenizer = tokenizer
    self.augment = augment
    self.num_views = num_views

  def random_map(self, element, rng: np.random.Generator):
    width, height, scale = element['image_size']
    small = (-(-width // scale), -(-height // scale))
    draws = [transforms.draw_view(rng, *small, self.augment)
             for _ in range(self.num_views)]
    tokens = self.tokenizer(pipeline._caption(element, rng))[0]  # pylint: disable=protected-access
    boxes = np.asarray([full_box(d.box, scale, width, height)
                        for d in draws], np.int32)
    aug = np.stack([d.aug for d in draws])
    order = np.stack([d.order for d in draws])
    if self.num_views == 1:
      boxes, aug, order = boxes[0], aug[0], order[0]
    return {'encoded': np.frombuffer(bytes(element['image']), np.uint8),
            'box': boxes, 'tokens': tokens, 'aug': aug,
            'color_order': order}


def stack_plans(plans: Sequence[dict]) -> dict:
  """Grain's ``batch_fn``: every field stacked, ``encoded`` kept a list
  (the images' bytes differ in length)."""
  out = {k: np.stack([p[k] for p in plans]) for k in plans[0]
         if k != 'encoded'}
  out['encoded'] = [p['encoded'] for p in plans]
  return out


def default_device() -> tuple[str, Optional[int]]:
  """``('mixed', id)`` (nvJPEG on JAX's first local GPU) when there is
  one, else ``('cpu', None)`` (DALI's CPU backend)."""
  import jax  # pylint: disable=g-import-not-at-top
  first = jax.local_devices()[0]
  if first.platform == 'gpu':
    return 'mixed', int(getattr(first, 'local_hardware_id', 0) or 0)
  return 'cpu', None


class DaliDecode(grain.transforms.Map):
  """A batch of plans -> the batch of ``pipeline.train_dataset``: ``image``
  ``(b, s, s, 3)`` (``(b, V, s, s, 3)``) uint8 from DALI, the rest as
  planned. One DALI pipeline per process, built at its first batch (a copy
  pickled into a Grain worker builds its own), run by one thread at a
  time."""

  def __init__(self, image_size: int, num_threads: int = 2,
               device: Optional[tuple[str, Optional[int]]] = None):
    self.image_size = int(image_size)
    self.num_threads = int(num_threads)
    self.device = device
    self._pipes: dict[int, Any] = {}
    self._lock = threading.Lock()

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items()
            if k not in ('_pipes', '_lock')}

  def __setstate__(self, state):
    self.__dict__.update(state, _pipes={}, _lock=threading.Lock())

  def _pipe(self, samples: int):
    """The pipeline for ``samples`` images per run (built once)."""
    if samples not in self._pipes:
      device, device_id = self.device or default_device()
      self._pipes[samples] = build_pipeline(samples, self.image_size,
                                            device, device_id,
                                            self.num_threads)
    return self._pipes[samples]

  def map(self, element):
    batch = dict(element)
    encoded, boxes = batch.pop('encoded'), batch.pop('box')
    lead = boxes.shape[:-1]  # (b,) or (b, V)
    views = int(np.prod(lead[1:], dtype=int))
    data = [e for e in encoded for _ in range(views)]
    flat = boxes.reshape(-1, 4)
    with self._lock:
      pipe = self._pipe(len(data))
      pipe.feed_input('encoded', data)
      pipe.feed_input('anchor', list(flat[:, :2]))
      pipe.feed_input('shape', list(flat[:, 2:]))
      out, = pipe.run()
    images = as_numpy(out)
    batch['image'] = images.reshape(lead + images.shape[1:])
    return batch


def build_pipeline(samples: int, image_size: int, device: str,
                   device_id: Optional[int], num_threads: int):
  """A built DALI pipeline: external ``encoded`` bytes and the boxes'
  ``anchor`` and ``shape`` ((x, y), (w, h), int32) -> the box's region
  decoded (``device``: 'mixed' or 'cpu', RGB, no EXIF rotation: the host
  path applies none) and resized to ``image_size`` squared by DALI's cubic
  filter, antialiased when shrinking."""
  dali, fn, types = import_dali()
  pipe = dali.Pipeline(batch_size=samples, num_threads=num_threads,
                       device_id=device_id, prefetch_queue_depth=1,
                       exec_async=False, exec_pipelined=False)
  # The GPU decoder's chroma upsampling as libjpeg-turbo's (the host path's).
  extra = {'jpeg_fancy_upsampling': True} if device == 'mixed' else {}
  with pipe:
    encoded = fn.external_source(name='encoded', dtype=types.UINT8, ndim=1)
    anchor = fn.external_source(name='anchor', dtype=types.INT32, ndim=1)
    shape = fn.external_source(name='shape', dtype=types.INT32, ndim=1)
    region = fn.decoders.image_slice(
        encoded, anchor, shape, device=device, output_type=types.RGB,
        adjust_orientation=False, axis_names='WH', **extra)
    pipe.set_outputs(fn.resize(region, size=[image_size, image_size],
                               interp_type=types.INTERP_CUBIC,
                               antialias=True))
  pipe.build()
  return pipe


def as_numpy(out) -> np.ndarray:
  """A DALI output batch (CPU or GPU) as one ``(n, ...)`` numpy array."""
  if hasattr(out, 'as_cpu'):
    out = out.as_cpu()
  return np.asarray(out.as_array())


def train_dataset(source: Sequence[dict] | mixture.Mixture, *,
                  tokenizer: Tokenizer, image_size: int,
                  global_batch_size: int, seed: int,
                  augment: transforms.AugmentConfig = transforms.AugmentConfig(),
                  process_index: int = 0, process_count: int = 1,
                  num_views: int = 1, num_threads: int = 2,
                  device: Optional[tuple[str, Optional[int]]] = None
                  ) -> grain.MapDataset:
  """``pipeline.train_dataset``'s batches with the images from DALI:
  element ``i`` is step ``i``'s local batch (the same records, draws,
  tokens, ``aug`` and ``color_order``; ``image`` within the stated bound
  of the host path's cropped view). ``source``'s records must carry
  ``image_size`` (``bad_records.HEADER``). ``device``: ``(backend,
  device_id)``; None picks ``default_device()`` at the first batch. The
  colour jitter and grayscale are always the train step's here, whatever
  ``augment.color_on_device`` says: only their draws are made."""
  ds = pipeline.record_stream(source, seed, global_batch_size,
                              process_index, process_count)
  local = pipeline.local_batch_size(global_batch_size, process_count)
  ds = ds.random_map(PlanTransform(tokenizer, augment, num_views))
  ds = ds.batch(local, drop_remainder=True, batch_fn=stack_plans)
  return ds[process_index::process_count].map(
      DaliDecode(image_size, num_threads, device))
