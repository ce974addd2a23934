"""Colour jitter and grayscale on the accelerator, inside the train step.

The paper's augmentation (B.1) jitters brightness, contrast, saturation and
hue in a random order with probability 0.8, then turns 20% of the views
grey. On the host (``transforms.train_view``) that is two thirds of a 224 px
view's cost, mostly PIL's RGB<->HSV conversions. With
``data.color_on_device`` the host still draws every random number, in the
same order (so the crops, the factors and exact resumption are unchanged),
but leaves the pixels alone; it sends the factors (in the augmentation
vector) and the order, and this module applies them on device, batched.

The operations follow PIL's ``ImageEnhance`` and the HSV hue shift of
``transforms._shift_hue`` (what torchvision's ColorJitter does on PIL images)
in float32 instead of uint8: the results differ only by PIL's rounding to
integers between operations and its 8-bit HSV (on average about 1 level of
255, 99.9% of pixels within about 9; ``tests/test_data.py`` bounds it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Indices into the augmentation vector (models.heads.AUG_FIELDS).
_FACTORS = slice(4, 8)  # brightness, contrast, saturation, hue
_GRAYSCALE = 10
_LUMA = (0.299, 0.587, 0.114)  # PIL's "L" conversion (ITU-R 601-2)


def _gray(x: jax.Array) -> jax.Array:
  """``(..., h, w, 1)`` luma of ``(..., h, w, 3)`` RGB in [0, 1]."""
  return jnp.sum(x * jnp.asarray(_LUMA, x.dtype), -1, keepdims=True)


def _blend(degenerate, x, factor):
  """PIL's ``Image.blend(degenerate, x, factor)``, clipped to [0, 1]."""
  return jnp.clip(degenerate + factor * (x - degenerate), 0.0, 1.0)


def _shift_hue(x: jax.Array, shift: jax.Array) -> jax.Array:
  """RGB -> HSV, hue += shift (in turns), -> RGB, for ``(h, w, 3)``."""
  r, g, b = x[..., 0], x[..., 1], x[..., 2]
  v = jnp.max(x, -1)
  c = v - jnp.min(x, -1)
  safe_c = jnp.where(c > 0, c, 1.0)
  hue = jnp.where(v == r, (g - b) / safe_c,
                  jnp.where(v == g, 2.0 + (b - r) / safe_c,
                            4.0 + (r - g) / safe_c))
  hue = jnp.where(c > 0, hue / 6.0, 0.0)
  hue = jnp.mod(hue + shift, 1.0)
  s = jnp.where(v > 0, c / jnp.where(v > 0, v, 1.0), 0.0)
  # HSV -> RGB by the standard closed form: channel n of (5, 3, 1).
  def channel(n):
    k = jnp.mod(n + hue * 6.0, 6.0)
    return v - v * s * jnp.clip(jnp.minimum(k, 4.0 - k), 0.0, 1.0)
  return jnp.stack([channel(5.0), channel(3.0), channel(1.0)], -1)


def _jitter_one(x: jax.Array, aug: jax.Array, order: jax.Array
                ) -> jax.Array:
  """One ``(h, w, 3)`` view in [0, 1]: the four operations in ``order``
  (indices 0 brightness, 1 contrast, 2 saturation, 3 hue), then grayscale."""
  bright, contrast, sat, hue = (aug[_FACTORS][k] for k in range(4))
  ops = (
      lambda y: jnp.clip(y * bright, 0.0, 1.0),
      lambda y: _blend(jnp.mean(_gray(y)), y, contrast),
      lambda y: _blend(_gray(y), y, sat),
      lambda y: _shift_hue(y, hue),
  )
  for position in range(4):
    x = jax.lax.switch(order[position], ops, x)
  gray = jnp.broadcast_to(_gray(x), x.shape)
  return jnp.where(aug[_GRAYSCALE] > 0, gray, x)


def color_jitter(images: jax.Array, aug: jax.Array, order: jax.Array
                 ) -> jax.Array:
  """Colour jitter and grayscale of uint8 views, as float32 in [0, 1].

  Args:
    images: ``(..., h, w, 3)`` uint8 views (crops already applied).
    aug: ``(..., AUG_DIM)`` their augmentation vectors (factors, grayscale).
    order: ``(..., 4)`` int order of the four jitter operations (a view
      without jitter has identity factors: the order does not matter).
  Returns:
    ``(..., h, w, 3)`` float32 in [0, 1].
  """
  lead = images.shape[:-3]
  x = images.reshape((-1,) + images.shape[-3:]).astype(jnp.float32) / 255.0
  out = jax.vmap(_jitter_one)(x, aug.reshape(-1, aug.shape[-1]),
                              order.reshape(-1, 4).astype(jnp.int32))
  return out.reshape(lead + images.shape[-3:])
