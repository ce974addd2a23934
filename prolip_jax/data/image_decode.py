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

16-bit images are brought to 8 bits by keeping each value's high byte
(``value >> 8``) wherever they come from (``to_8bit``): Pillow's own
``convert('RGB')`` of a 16-bit greyscale image clips every value above 255 to
white, while it opens a 16-bit RGB(A) PNG as 8-bit RGB(A) by keeping the
high byte; ``>> 8`` makes every 16-bit input agree with the latter.

JPEGs are decoded by simplejpeg (libjpeg-turbo, no PIL image object, header
parsed in C) when it is installed and the file is a plain YCbCr/RGB/grey
JPEG; anything else, or anything simplejpeg rejects, goes through Pillow.
Both use libjpeg-turbo with the same settings (accurate integer IDCT, fancy
upsampling) at the same DCT scale, so the pixels are the same
(``tests/test_fast_input.py``); simplejpeg is 1.25-1.45x faster per
image (docs/performance.md, Input pipeline).
"""

from __future__ import annotations

import io
import os
from typing import Any, Sequence

import numpy as np
from PIL import Image

try:
  import simplejpeg
except ImportError:  # optional speed-up: Pillow decodes every JPEG then
  simplejpeg = None

RGB_FIRST = 'rgb_first'
RELEASE = 'release'
ORDERS = (RGB_FIRST, RELEASE)
# Pillow's modes of one 16-bit channel ('I;16' and its byte orders), and 'I'
# (32-bit integers), the mode Pillow before 10 opened 16-bit PNGs in.
SIXTEEN_BIT_MODES = ('I;16', 'I;16L', 'I;16B', 'I;16N', 'I')


def to_8bit(img: Image.Image) -> Image.Image:
  """``img`` with 8-bit channels: a 16-bit greyscale image (a mode of
  ``SIXTEEN_BIT_MODES``; in mode 'I' its values must lie in 0..65535) becomes
  an 'L' image of ``value >> 8``; any other mode comes back as it is.

  Raises ``ValueError`` for a mode 'I' image with values outside 0..65535
  (not 16-bit pixels: no scale is right for them).
  """
  if img.mode not in SIXTEEN_BIT_MODES:
    return img
  x = np.asarray(img)  # uint16 of either byte order, or int32 for 'I'
  if img.mode == 'I' and x.size:
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi > 65535:
      raise ValueError(f"a mode 'I' image with values {lo}..{hi} is not "
                       '16-bit pixels (0..65535)')
  return Image.fromarray((x.astype(np.uint32) >> 8).astype(np.uint8))


def uint16_to_8bit(x: np.ndarray) -> np.ndarray:
  """A uint16 array (either byte order) as uint8 ``x >> 8``; other arrays
  as they are."""
  if x.dtype.kind == 'u' and x.dtype.itemsize == 2:
    return (x.astype(np.uint16) >> 8).astype(np.uint8)
  return x


def decode_rgb(image: Any, min_pixels: int = 0) -> np.ndarray:
  """HxWx3 uint8 RGB from encoded image bytes or an HxW / HxWx{1,3,4} array
  (alpha dropped, grey repeated; 16-bit images and uint16 arrays scaled by
  ``>> 8``): the decoder of training and of the data pipeline.

  ``min_pixels > 0``: a JPEG is decoded at the smallest of libjpeg's DCT
  scales (1, 1/2, 1/4, 1/8) that still leaves at least ``min_pixels``
  pixels, several times cheaper than decoding at full size and then
  shrinking (``train_min_pixels`` says how many the training crop needs).
  """
  if isinstance(image, (bytes, bytearray, memoryview)):
    out = _decode_jpeg_turbo(image, min_pixels)
    if out is None:
      out = _decode_pil(image, min_pixels)
  else:
    out = uint16_to_8bit(np.asarray(image))
    if out.ndim == 2:
      out = np.repeat(out[..., None], 3, -1)
    if out.ndim != 3 or out.shape[-1] not in (1, 3, 4):
      raise ValueError(f'image array of shape {out.shape}')
    out = np.asarray(out[..., :3] if out.shape[-1] != 1 else
                     np.repeat(out, 3, -1), np.uint8)
  if out.shape[0] < 1 or out.shape[1] < 1:
    raise ValueError(f'empty image {out.shape}')
  return out


def jpeg_draft_scale(width: int, height: int, min_pixels: int) -> int:
  """The DCT scale denominator (1, 2, 4 or 8) at which a ``width`` x
  ``height`` JPEG is decoded to keep ``min_pixels``: the one Pillow's
  ``Image.draft`` picks for the target size ``decode_rgb`` asks it for."""
  if not min_pixels or width * height < 4 * min_pixels:
    return 1
  k = (min_pixels / (width * height)) ** 0.5
  target_w, target_h = int(np.ceil(width * k)), int(np.ceil(height * k))
  most = min(width // target_w, height // target_h)
  return next(s for s in (8, 4, 2, 1) if most >= s)


def header_size(data, min_pixels: int = 0) -> tuple[int, int, int]:
  """``(width, height, scale)`` of encoded image bytes, read from the header
  alone (no pixel decoded): the full size and the DCT scale denominator
  ``decode_rgb(data, min_pixels)`` decodes a JPEG at (``jpeg_draft_scale``;
  1 for any other format), so that ``decode_rgb`` gives ``ceil(width /
  scale)`` x ``ceil(height / scale)`` pixels. The DALI path
  (``data/dali_decode.py``) draws the crop on that size, as the host path
  draws it on the image it decoded. Raises what Pillow raises for bytes it
  cannot identify."""
  with Image.open(io.BytesIO(data)) as img:
    (width, height), jpeg = img.size, img.format == 'JPEG'
  if width < 1 or height < 1:
    raise ValueError(f'empty image {(height, width)}')
  return width, height, (jpeg_draft_scale(width, height, min_pixels)
                         if jpeg else 1)


def _decode_pil(data, min_pixels: int) -> np.ndarray:
  """``decode_rgb`` of encoded bytes by Pillow (any format)."""
  with Image.open(io.BytesIO(data)) as img:
    width, height = img.size
    if min_pixels and img.format == 'JPEG' and (
        width * height >= 4 * min_pixels):
      k = (min_pixels / (width * height)) ** 0.5
      img.draft('RGB', (int(np.ceil(width * k)), int(np.ceil(height * k))))
    return np.asarray(to_8bit(img).convert('RGB'), np.uint8)


# The JPEG colour spaces simplejpeg converts to RGB as Pillow does; Adobe
# CMYK/YCCK files go to Pillow (it inverts their channels).
_TURBO_COLORSPACES = ('YCbCr', 'RGB', 'Gray')


def _decode_jpeg_turbo(data, min_pixels: int) -> np.ndarray | None:
  """``decode_rgb`` of a JPEG by simplejpeg at Pillow's DCT scale, or None
  for Pillow to decode (not a JPEG, an unusual one, simplejpeg missing or
  rejecting it: Pillow then decides whether the record is corrupt)."""
  if simplejpeg is None or bytes(data[:2]) != b'\xff\xd8':
    return None
  try:
    height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    if (colorspace not in _TURBO_COLORSPACES or
        width * height > Image.MAX_IMAGE_PIXELS):  # Pillow's bomb check
      return None
    s = jpeg_draft_scale(width, height, min_pixels)
    out = simplejpeg.decode_jpeg(data, 'RGB', min_height=-(-height // s),
                                 min_width=-(-width // s), min_factor=s)
  except ValueError:
    return None
  if out.shape[:2] != (-(-height // s), -(-width // s)):
    return None  # another scale than Pillow's: let Pillow decode it
  return out


def decode_keeping_mode(image: Any) -> Image.Image | np.ndarray:
  """A PIL image in its stored mode, fully read, from encoded bytes or a file
  path; a PIL image as it is; an array as ``decode_rgb`` gives it (an array
  has no stored mode: it is taken as RGB pixels). A 16-bit greyscale image
  comes back as 'L' (``to_8bit``)."""
  if isinstance(image, Image.Image):
    return to_8bit(image)
  if isinstance(image, (str, os.PathLike)):
    with Image.open(image) as img:
      img.load()
      return to_8bit(img)
  if isinstance(image, (bytes, bytearray, memoryview)):
    with Image.open(io.BytesIO(image)) as img:
      img.load()
      if img.width < 1 or img.height < 1:
        raise ValueError(f'empty image {img.size}')
      return to_8bit(img)
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
