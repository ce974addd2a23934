"""Shared by training, inference and evaluation: image normalisation and
embedding in fixed-size batches, and the checks of inputs given to a loaded
model (``image_list``, ``as_uint8_image``, ``text_list``). Imports nothing
else of the package but the (self-contained) device colour jitter, image
decoder and error classes."""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax import errors
from prolip_jax.data import color
from prolip_jax.data import image_decode


class InputError(errors.UserError, ValueError):
  """An input of a loaded model that cannot be embedded as given: one line
  naming the item's index (``image N: ...``, ``text N: ...``), or saying how
  to pass a single item."""


class ImageNotFoundError(InputError, FileNotFoundError):
  """An image path that names no file (``image N: no such file ...``)."""


def normalize_images(images: jax.Array, mean, std) -> jax.Array:
  """uint8 ``(b, h, w, 3)`` -> float32 normalised with per-channel mean/std."""
  x = images.astype(jnp.float32) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def train_images(batch: dict, mean, std) -> jax.Array:
  """A train batch's views, normalised: ``normalize_images`` of
  ``batch['image']``, after the colour jitter the pipeline left to the
  device (``data.color_on_device``: the batch then carries
  ``color_order``)."""
  if 'color_order' not in batch:
    return normalize_images(batch['image'], mean, std)
  x = color.color_jitter(batch['image'], batch['aug'], batch['color_order'])
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)


def embed_in_batches(fn: Callable[[np.ndarray], tuple], inputs: np.ndarray,
                     batch_size: int,
                     progress: Optional[Callable[[int, int], None]] = None
                     ) -> tuple[np.ndarray, Optional[np.ndarray]]:
  """Runs ``fn`` over ``inputs`` in batches; pads the last batch (one shape).

  ``inputs`` may be an array or a tuple of arrays (``fn`` then gets the tuple
  of batch slices); ``progress(done, total)`` is called after each batch.
  """
  mus, logvars = [], []
  multi = isinstance(inputs, tuple)
  n = len(inputs[0]) if multi else len(inputs)

  def take(x, i, pad):
    chunk = x[i:i + batch_size]
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
    return chunk

  for i in range(0, n, batch_size):
    pad = batch_size - min(batch_size, n - i)
    chunk = (tuple(take(x, i, pad) for x in inputs) if multi
             else take(inputs, i, pad))
    mu, logvar = fn(chunk)
    mus.append(np.asarray(mu)[:batch_size - pad])
    if logvar is not None:
      logvars.append(np.asarray(logvar)[:batch_size - pad])
    if progress is not None:
      progress(min(i + batch_size, n), n)
  return (np.concatenate(mus),
          np.concatenate(logvars) if logvars else None)



def image_list(images: Any) -> list[Any]:
  """The images of an ``encode_image`` argument, one per item.

  ``images`` is a sequence of images (a 1-D object array too) or a batch
  array ``(N, H, W, C)`` (numpy, JAX or anything with ``ndim``). A single
  image given without a list (a 2-D or 3-D array, a PIL image, a path or
  encoded bytes) would otherwise be taken as a sequence of its rows (or
  characters) and embed as that many wrong images: it raises ``InputError``
  saying to wrap it in a list.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top
  ndim = getattr(images, 'ndim', None)
  if isinstance(ndim, int) and not isinstance(images, Image.Image):
    if ndim in (1, 4):  # a sequence (object array, Series) or a batch
      return list(images)
    shape = tuple(getattr(images, 'shape', ()))
    if ndim in (2, 3):
      raise InputError(
          f'encode_image takes a list of images or an (N, H, W, C) batch; '
          f'got one {ndim}-D array of shape {shape}, which is one image: '
          'wrap it in a list ([image]); a batch of grey images (N, H, W) '
          'goes as x[..., None]')
    raise InputError(f'encode_image takes a list of images or an (N, H, W, '
                     f'C) batch; got a {ndim}-D array of shape {shape}')
  if isinstance(images, (str, bytes, bytearray, os.PathLike, Image.Image)):
    raise InputError(f'encode_image takes a list of images; got one '
                     f'{type(images).__name__}: wrap it in a list ([image])')
  return list(images)


def as_uint8_image(image: Any, index: int = 0, keep_mode: bool = False
                   ) -> Any:
  """One input image -> ``(h, w, 3)`` uint8 (or a PIL image: ``keep_mode``).

  ``keep_mode``: a file path, encoded bytes or PIL image comes back as a PIL
  image in the mode it was stored in (for the release's eval order,
  ``image_decode``), not converted to RGB.

  Accepts uint8 ``(h, w, 3)``/``(h, w)``/``(h, w, 1)``/``(h, w, 4)`` arrays
  (grey is repeated, alpha dropped), uint16 arrays (16-bit pixels: the high
  byte, ``x >> 8``), other integer arrays with values in 0..255, float arrays
  with values in [0, 1] (scaled by 255 and rounded, so ``x / 255`` gives back
  ``x``), PIL images, file paths and encoded bytes; 16-bit PIL images and
  files (modes 'I;16*', 'I') are scaled by ``>> 8`` too
  (``image_decode.to_8bit``). Raises ``InputError`` (a ``ValueError``; one
  line naming ``index``) for anything that would be silently wrong
  otherwise: bytes or files that do not decode, NaN/infinite or out-of-range
  values, channels-first ``(3, h, w)`` arrays, empty images;
  ``ImageNotFoundError`` (a ``FileNotFoundError``) for a missing file.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from PIL import UnidentifiedImageError  # pylint: disable=g-import-not-at-top
  where = f'image {index}'
  # What decoding a file or bytes can raise: Pillow's UnidentifiedImageError
  # and truncated data are OSErrors; odd headers ValueErrors; huge sizes
  # DecompressionBombError.
  bad_file = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
  if isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
    is_path = isinstance(image, (str, os.PathLike))
    what = (os.fspath(image) if is_path
            else f'the {len(image)} bytes given')
    try:
      with Image.open(image if is_path else io.BytesIO(image)) as img:
        img.load()
        img = image_decode.to_8bit(img)
        if img.width < 1 or img.height < 1:
          raise ValueError(f'empty image {img.size}')
        return img if keep_mode else np.asarray(img.convert('RGB'), np.uint8)
    except FileNotFoundError as e:
      raise ImageNotFoundError(f'{where}: no such file {what}') from e
    except bad_file as e:
      # Pillow's "cannot identify image file <_io.BytesIO ...>" says no more
      # than its type.
      why = (type(e).__name__ if isinstance(e, UnidentifiedImageError)
             else f'{type(e).__name__}: {_first_line(e)}')
      if is_path:
        raise InputError(f'{where}: {what} is not a readable image '
                         f'({why}).') from e
      raise InputError(f'{where}: cannot decode {what} as an image ({why}).'
                       ) from e
  if isinstance(image, Image.Image):
    if image.width < 1 or image.height < 1:
      raise InputError(f'{where}: a {image.width}x{image.height} PIL image is '
                       'empty.')
    try:
      image = image_decode.to_8bit(image)
    except ValueError as e:
      raise InputError(f'{where}: {e}') from e
    return image if keep_mode else np.asarray(image.convert('RGB'), np.uint8)
  x = np.asarray(image)
  if x.dtype == object or not (np.issubdtype(x.dtype, np.number)
                               or x.dtype == np.bool_):
    raise InputError(f'{where}: expected an image array, PIL image or path, '
                     f'got {type(image).__name__} of dtype {x.dtype}.')
  if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.complexfloating):
    raise InputError(f'{where}: dtype {x.dtype} is not an image dtype; pass '
                     'uint8 0..255 or float 0..1.')
  if x.ndim == 3 and x.shape[0] in (1, 3, 4) and x.shape[-1] not in (1, 3, 4):
    raise InputError(f'{where}: shape {x.shape} looks channels-first (C, H, '
                     'W); pass (H, W, C), e.g. np.transpose(x, (1, 2, 0)).')
  if x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[-1] not in (1, 3, 4)):
    raise InputError(f'{where}: shape {x.shape} is not an image; pass (H, W, '
                     '3), (H, W) or (H, W, 1).')
  if x.shape[0] == 0 or x.shape[1] == 0:
    raise InputError(f'{where}: shape {x.shape} is an empty image.')
  if np.issubdtype(x.dtype, np.floating):
    if not np.all(np.isfinite(x)):
      raise InputError(f'{where}: has NaN or infinite values.')
    lo, hi = float(x.min()), float(x.max())
    if lo < 0 or hi > 1:
      raise InputError(f'{where}: float values must lie in [0, 1], found '
                       f'{lo:g}..{hi:g}; pass uint8 0..255 or divide by 255.')
    x = np.rint(x.astype(np.float64) * 255.0).astype(np.uint8)
  elif x.dtype.kind == 'u' and x.dtype.itemsize == 2:
    x = image_decode.uint16_to_8bit(x)  # 16-bit pixels, whatever their range
  elif x.dtype != np.uint8:
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi > 255:
      hint = ('; 16-bit pixels go as uint16 (scaled by >> 8)'
              if 0 <= lo and hi <= 65535 else '')
      raise InputError(f'{where}: integer values must lie in 0..255, found '
                       f'{lo}..{hi}{hint}.')
    x = x.astype(np.uint8)
  if x.ndim == 2:
    x = x[:, :, None]
  if x.shape[-1] == 1:
    x = np.repeat(x, 3, axis=-1)
  return np.ascontiguousarray(x[..., :3])


def text_list(texts: Any) -> list[str]:
  """The captions of an ``encode_text`` argument: one ``str`` stands for
  itself, a sequence for its items. ``bytes`` items are UTF-8 text; any
  other item (None, a number, a nested list) raises ``InputError`` naming
  its index, as tokenizers would refuse it without one."""
  if isinstance(texts, (str, bytes)):
    texts = [texts]
  out = []
  for i, text in enumerate(texts):
    if isinstance(text, bytes):
      try:
        text = text.decode('utf-8')
      except UnicodeDecodeError as e:
        raise InputError(f'text {i}: bytes that are not UTF-8 ({e.reason} at '
                         f'byte {e.start}); pass str') from e
    if not isinstance(text, str):
      raise InputError(f'text {i}: expected a str, got '
                       f'{type(text).__name__} ({_short(text)})')
    out.append(text)
  return out


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + '...'


def _first_line(e: BaseException) -> str:
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  return lines[0][:200] if lines else 'no details'
