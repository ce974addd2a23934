"""The input pipeline's remaining levers, measured one at a time.

python benchmarks/input_levers.py [--images 512] [--seconds 4]

On the realistic JPEGs of ``benchmarks/input_pipeline.py`` (run it pinned,
``taskset -c 0``, the other core busy, as that benchmark is):

* **simplejpeg's fast decode options** (``fastdct``: libjpeg-turbo's fast
  integer IDCT; ``fastupsample``: plain chroma upsampling): decode ms per
  image for each photo size at the DCT scale training decodes it at
  (best of 5 passes), and how far the final 224 px training view
  (``transforms.resized_crop`` of one random crop box per image) moves from
  the accurate decode's: mean, worst view's mean, 99.9th percentile and
  maximum absolute difference in levels of 255.
* **cheaper OpenCV resizes** than ``transforms.resized_crop`` (the
  stretched-kernel prefilter, ``cv2.sepFilter2D``, then ``INTER_CUBIC``):
  the same prefilter then ``INTER_LINEAR``, and ``INTER_AREA`` with no
  prefilter: ms per view (best of 3 passes over 200 decoded images) and the
  difference from Pillow's bicubic (``resized_crop_pil``), as above.
* **where ``ds[step]``'s time goes**: cProfile of the real training dataset
  (``color_on_device``, batch 32), each function's own time per image,
  summed by owner: libjpeg-turbo/OpenCV/sentencepiece/array_record calls
  (the C work), this project's Python (``prolip_jax``), Grain's Python, and
  the rest (numpy, jax tree utilities, the standard library).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

from benchmarks import input_pipeline

DECODE_OPTIONS = ((False, False), (True, False), (False, True), (True, True))
# C functions by the library that does the work (cProfile's names).
# simplejpeg (Cython) is charged to its caller, image_decode's
# _decode_jpeg_turbo, whose own Python is a few lines.
C_WORK = {'_decode_jpeg_turbo': 'JPEG decode (simplejpeg)',
          'sepFilter2D': 'crop-and-resize (OpenCV)',
          'resize': 'crop-and-resize (OpenCV)',
          'Encode': 'tokenise (sentencepiece)',
          'index_shuffle': 'Grain index_shuffle (the data order)',
          'read': 'array_record read'}


def decode_options(examples, min_pixels: int):
  """Prints decode ms per image and the 224 px view's difference for each
  ``(fastdct, fastupsample)`` against the accurate decode."""
  import simplejpeg
  from prolip_jax.data import image_decode
  from prolip_jax.data import transforms

  def decode(data, fastdct, fastupsample):
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    s = image_decode.jpeg_draft_scale(width, height, min_pixels)
    return simplejpeg.decode_jpeg(
        data, 'RGB', fastdct=fastdct, fastupsample=fastupsample,
        min_height=-(-height // s), min_width=-(-width // s), min_factor=s)

  print('simplejpeg decode options (fastdct, fastupsample): ms per image, '
        'best of 5 passes; 224 px view vs the accurate decode, levels:')
  for fastdct, fastupsample in DECODE_OPTIONS:
    times = []
    for size in (500, 800):
      data = [d for d, _ in examples
              if simplejpeg.decode_jpeg_header(d)[1] == size]
      best = float('inf')
      for _ in range(5):
        t0 = time.perf_counter()
        for d in data:
          decode(d, fastdct, fastupsample)
        best = min(best, (time.perf_counter() - t0) / len(data))
      times.append(f'{size}px wide {best * 1e3:.3f} ms')
    errors, per_view = [], []
    for k, (d, _) in enumerate(examples):
      exact = decode(d, False, False)
      box = transforms.random_resized_crop_box(
          np.random.default_rng(k), exact.shape[1], exact.shape[0],
          (0.8, 1.0), (3 / 4, 4 / 3))
      diff = np.abs(transforms.resized_crop(exact, box, 224).astype(int) -
                    transforms.resized_crop(decode(d, fastdct, fastupsample),
                                            box, 224))
      errors.append(diff.ravel())
      per_view.append(diff.mean())
    e = np.concatenate(errors)
    print(f'  fastdct={fastdct!s:5} fastupsample={fastupsample!s:5} '
          f'{", ".join(times)}; view mean {e.mean():.2f}, worst view '
          f'{max(per_view):.2f}, 99.9th pct {np.percentile(e, 99.9):.0f}, '
          f'max {e.max()}')


def _linear_after_prefilter(image, box, size):
  """``transforms.resized_crop`` with ``INTER_LINEAR`` for the sampling."""
  import cv2
  from prolip_jax.data import transforms
  return cv2.resize(transforms.prefiltered_crop(image, box, size),
                    (size, size), interpolation=cv2.INTER_LINEAR)


def _area(image, box, size):
  """OpenCV's ``INTER_AREA`` of the crop, no prefilter."""
  import cv2
  left, top, w, h = box
  return cv2.resize(image[top:top + h, left:left + w], (size, size),
                    interpolation=cv2.INTER_AREA)


def resize_options(examples, min_pixels: int):
  """Prints ms per view and the difference from Pillow's bicubic for
  ``resized_crop`` and two cheaper OpenCV resizes."""
  from prolip_jax.data import image_decode
  from prolip_jax.data import transforms
  images = [image_decode.decode_rgb(d, min_pixels) for d, _ in examples[:200]]
  rng = np.random.default_rng(0)
  boxes = [transforms.random_resized_crop_box(
      rng, im.shape[1], im.shape[0], (0.8, 1.0), (3 / 4, 4 / 3))
           for im in images]
  refs = [transforms.resized_crop_pil(im, b, 224)
          for im, b in zip(images, boxes)]
  print('\nCrop-and-resize to 224 px: ms per view, best of 3 passes; vs '
        "Pillow's bicubic, levels:")
  for name, fn in (('resized_crop (prefilter + INTER_CUBIC)',
                    transforms.resized_crop),
                   ('prefilter + INTER_LINEAR', _linear_after_prefilter),
                   ('INTER_AREA, no prefilter', _area)):
    best = float('inf')
    for _ in range(3):
      t0 = time.perf_counter()
      views = [fn(im, b, 224) for im, b in zip(images, boxes)]
      best = min(best, (time.perf_counter() - t0) / len(images))
    diffs = [np.abs(v.astype(int) - r) for v, r in zip(views, refs)]
    e = np.concatenate([d.ravel() for d in diffs])
    print(f'  {name:40s} {best * 1e3:.3f} ms; view mean {e.mean():.2f}, '
          f'worst view {max(d.mean() for d in diffs):.2f}, 99.9th pct '
          f'{np.percentile(e, 99.9):.0f}, max {e.max()}')


def _owner(filename: str, function: str) -> str:
  """Who a profiled function's own time is charged to."""
  if function == '_decode_jpeg_turbo':
    return C_WORK[function]
  if filename == '~':  # a C function: charged to its library's work
    words = re.split(r'[^A-Za-z0-9_]+', function)
    return next((owner for name, owner in C_WORK.items() if name in words),
                'other C calls')
  if f'{os.sep}prolip_jax{os.sep}' in filename:
    return 'prolip_jax Python'
  if f'{os.sep}grain{os.sep}' in filename:
    return 'Grain Python'
  if f'{os.sep}sentencepiece{os.sep}' in filename:
    return 'tokenise (sentencepiece)'
  return 'numpy, jax tree_util, stdlib'


def profile_steps(pattern: str, tokenizer_path: str, min_pixels: int,
                  steps: int):
  """Prints ``ds[step]``'s own time per image by owner (cProfile over
  ``steps`` batches of 32) and the unprofiled images/s."""
  from prolip_jax.data import bad_records
  from prolip_jax.data import pipeline
  from prolip_jax.data import record_sources
  from prolip_jax.data import transforms
  from prolip_jax.data.tokenizer import Tokenizer
  src = bad_records.CheckedSource(record_sources.ArrayRecordSource(pattern),
                                  min_pixels=min_pixels)
  ds = pipeline.train_dataset(
      src, tokenizer=Tokenizer(tokenizer_path, 64), image_size=224,
      global_batch_size=32, seed=0,
      augment=transforms.AugmentConfig(color_on_device=True))
  ds[0]  # warm up
  t0 = time.perf_counter()
  for i in range(1, steps + 1):
    ds[i]
  plain = steps * 32 / (time.perf_counter() - t0)
  profiler = cProfile.Profile()
  profiler.enable()
  for i in range(steps + 1, 2 * steps + 1):
    ds[i]
  profiler.disable()
  by_owner = {}
  for (filename, _, function), row in pstats.Stats(profiler).stats.items():
    owner = _owner(filename, function)
    by_owner[owner] = by_owner.get(owner, 0.0) + row[2]  # own time
  total = sum(by_owner.values())
  print(f'\nds[step] unprofiled: {plain:.0f} images/s ({1e3 / plain:.2f} ms '
        f'per image); profiled, own time per image ({steps} batches of 32):')
  for owner, seconds in sorted(by_owner.items(), key=lambda kv: -kv[1]):
    per = seconds / (steps * 32) * 1e3
    print(f'  {owner:40s} {per:.3f} ms  {seconds / total:5.1%}')


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--images', type=int, default=512)
  parser.add_argument('--steps', type=int, default=8)
  args = parser.parse_args(argv)
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  from prolip_jax.data import image_decode
  from prolip_jax.data.tokenizer import train_tokenizer
  tmp = tempfile.mkdtemp(prefix='prolip_levers_')
  examples = input_pipeline.make_jpegs(args.images)
  pattern = input_pipeline.write_shards(examples, tmp)
  tok_path = train_tokenizer([c for _, c in examples],
                             os.path.join(tmp, 'tok.model'), 256)
  min_pixels = image_decode.train_min_pixels(224, (0.8, 1.0), (3 / 4, 4 / 3))
  print(f'{len(examples)} JPEGs (500x375 decoded at 1/1, 800x600 at 1/2); '
        f'cpus visible: {os.cpu_count()}')
  decode_options(examples, min_pixels)
  resize_options(examples, min_pixels)
  profile_steps(pattern, tok_path, min_pixels, args.steps)


if __name__ == '__main__':
  main()
