"""Shared by training, inference and evaluation: image normalisation and
embedding in fixed-size batches. Imports nothing else of the package but
the (self-contained) device colour jitter."""

from __future__ import annotations

from typing import Callable, Optional

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

