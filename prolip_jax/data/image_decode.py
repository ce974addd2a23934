"""Decoding images for the pipelines, in one of two orders.

``decode_rgb`` converts to RGB as it decodes: every later step (training
crops, our eval view) sees RGB pixels. It is the decoder of training and of
our own models' evaluation.

``decode_keeping_mode`` leaves the image in the mode it was stored in (1-bit
'1', palette 'P', 'L', 'LA', 'RGB', 'RGBA', 'CMYK', ...) for the eval views to
resize and crop in that mode and convert to RGB last, the order of open_clip's
eval transform (torchvision ``Resize`` -> ``CenterCrop`` -> ``convert('RGB')``)
and so of the ProLIP release. The two orders give the same pixels for RGB and
L files; they differ where Pillow resizes the stored mode differently from
RGB: '1' and 'P' with nearest neighbour, 'LA'/'RGBA' with premultiplied
alpha, CMYK before its conversion (``pipeline.eval_images``'s ``order``;
docs/interop.md).
"""

from __future__ import annotations

import io
import os
from typing import Any, Sequence

import numpy as np
from PIL import Image

RGB_FIRST = 'rgb_first'
RELEASE = 'release'
ORDERS = (RGB_FIRST, RELEASE)


def decode_rgb(image: Any, min_pixels: int = 0) -> np.ndarray:
  """HxWx3 uint8 RGB from encoded image bytes or an HxW / HxWx{1,3,4} array
  (alpha dropped, grey repeated): the decoder of training and of the data
  pipeline.

  ``min_pixels > 0``: a JPEG is decoded at the smallest of libjpeg's DCT
  scales (1, 1/2, 1/4, 1/8) that still leaves at least ``min_pixels``
  pixels, several times cheaper than decoding at full size and then
  shrinking (``train_min_pixels`` says how many the training crop needs).
  """
  if isinstance(image, (bytes, bytearray, memoryview)):
    with Image.open(io.BytesIO(image)) as img:
      width, height = img.size
      if min_pixels and img.format == 'JPEG' and (
          width * height >= 4 * min_pixels):
        k = (min_pixels / (width * height)) ** 0.5
        img.draft('RGB', (int(np.ceil(width * k)), int(np.ceil(height * k))))
      out = np.asarray(img.convert('RGB'), np.uint8)
  else:
    out = np.asarray(image)
    if out.ndim == 2:
      out = np.repeat(out[..., None], 3, -1)
    if out.ndim != 3 or out.shape[-1] not in (1, 3, 4):
      raise ValueError(f'image array of shape {out.shape}')
    out = np.asarray(out[..., :3] if out.shape[-1] != 1 else
                     np.repeat(out, 3, -1), np.uint8)
  if out.shape[0] < 1 or out.shape[1] < 1:
    raise ValueError(f'empty image {out.shape}')
  return out


def decode_keeping_mode(image: Any) -> Image.Image | np.ndarray:
  """A PIL image in its stored mode, fully read, from encoded bytes or a file
  path; a PIL image as it is; an array as ``decode_rgb`` gives it (an array
  has no stored mode: it is taken as RGB pixels)."""
  if isinstance(image, Image.Image):
    return image
  if isinstance(image, (str, os.PathLike)):
    with Image.open(image) as img:
      img.load()
      return img
  if isinstance(image, (bytes, bytearray, memoryview)):
    with Image.open(io.BytesIO(image)) as img:
      img.load()
      if img.width < 1 or img.height < 1:
        raise ValueError(f'empty image {img.size}')
      return img
  return decode_rgb(image)


def check_order(order: str) -> str:
  """``order`` if it names an order, else ``ValueError`` listing them."""
  if order not in ORDERS:
    raise ValueError(f'unknown eval image order {order!r}; use one of '
                     f'{", ".join(ORDERS)}')
  return order


def train_min_pixels(image_size: int, crop_scale: Sequence[float],
                     crop_ratio: Sequence[float]) -> int:
  """Pixels an image needs so that every random resized crop of it
  (area >= ``crop_scale[0]``, aspect ratio in ``crop_ratio``) is at least
  ``image_size`` pixels on each side: the narrow side of such a crop is
  sqrt(scale * area * min(ratio, 1/ratio))."""
  narrow = min(min(r, 1 / r) for r in crop_ratio)
  return int(np.ceil(image_size**2 / (crop_scale[0] * narrow)))
