"""Shared by training, inference and evaluation: image normalisation and
embedding in fixed-size batches, and the checks of images given to a loaded
model (``as_uint8_image``). Imports nothing else of the package but
the (self-contained) device colour jitter."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax.data import color


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



def as_uint8_image(image: Any, index: int = 0, keep_mode: bool = False
                   ) -> Any:
  """One input image -> ``(h, w, 3)`` uint8 (or its encoded bytes as given).

  ``keep_mode``: a file path or PIL image comes back as a PIL image in the
  mode it was stored in (for the release's eval order, ``image_decode``),
  not converted to RGB.

  Accepts uint8 ``(h, w, 3)``/``(h, w)``/``(h, w, 1)``/``(h, w, 4)`` arrays
  (grey is repeated, alpha dropped), other integer arrays with values in
  0..255, float arrays with values in [0, 1] (scaled by 255 and rounded, so
  ``x / 255`` gives back ``x``), PIL images, file paths and encoded bytes.
  Raises ``ValueError`` (one sentence naming ``index``) for anything that
  would be silently wrong otherwise: NaN/infinite or out-of-range values,
  channels-first ``(3, h, w)`` arrays, empty images.
  """
  from PIL import Image  # pylint: disable=g-import-not-at-top
  where = f'image {index}'
  if isinstance(image, (bytes, bytearray)):
    return bytes(image)
  if isinstance(image, (str, os.PathLike)):
    try:
      with Image.open(image) as img:
        if keep_mode:
          img.load()
          return img
        return np.asarray(img.convert('RGB'), np.uint8)
    except FileNotFoundError:
      raise
    except (OSError, ValueError) as e:
      raise ValueError(f'{where}: {os.fspath(image)} is not a readable '
                       f'image ({type(e).__name__}).') from e
  if isinstance(image, Image.Image):
    if image.width < 1 or image.height < 1:
      raise ValueError(f'{where}: a {image.width}x{image.height} PIL image is '
                       'empty.')
    return image if keep_mode else np.asarray(image.convert('RGB'), np.uint8)
  x = np.asarray(image)
  if x.dtype == object or not (np.issubdtype(x.dtype, np.number)
                               or x.dtype == np.bool_):
    raise ValueError(f'{where}: expected an image array, PIL image or path, '
                     f'got {type(image).__name__} of dtype {x.dtype}.')
  if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.complexfloating):
    raise ValueError(f'{where}: dtype {x.dtype} is not an image dtype; pass '
                     'uint8 0..255 or float 0..1.')
  if x.ndim == 3 and x.shape[0] in (1, 3, 4) and x.shape[-1] not in (1, 3, 4):
    raise ValueError(f'{where}: shape {x.shape} looks channels-first (C, H, '
                     'W); pass (H, W, C), e.g. np.transpose(x, (1, 2, 0)).')
  if x.ndim not in (2, 3) or (x.ndim == 3 and x.shape[-1] not in (1, 3, 4)):
    raise ValueError(f'{where}: shape {x.shape} is not an image; pass (H, W, '
                     '3), (H, W) or (H, W, 1).')
  if x.shape[0] == 0 or x.shape[1] == 0:
    raise ValueError(f'{where}: shape {x.shape} is an empty image.')
  if np.issubdtype(x.dtype, np.floating):
    if not np.all(np.isfinite(x)):
      raise ValueError(f'{where}: has NaN or infinite values.')
    lo, hi = float(x.min()), float(x.max())
    if lo < 0 or hi > 1:
      raise ValueError(f'{where}: float values must lie in [0, 1], found '
                       f'{lo:g}..{hi:g}; pass uint8 0..255 or divide by 255.')
    x = np.rint(x.astype(np.float64) * 255.0).astype(np.uint8)
  elif x.dtype != np.uint8:
    lo, hi = int(x.min()), int(x.max())
    if lo < 0 or hi > 255:
      raise ValueError(f'{where}: integer values must lie in 0..255, found '
                       f'{lo}..{hi}.')
    x = x.astype(np.uint8)
  if x.ndim == 2:
    x = x[:, :, None]
  if x.shape[-1] == 1:
    x = np.repeat(x, 3, axis=-1)
  return np.ascontiguousarray(x[..., :3])
