"""UniCLIP's projection heads (section 2.1) as Flax linen modules.

The image ENCODER is augmentation-agnostic: it sees only the augmented image
A(x) and gives h = f_I(A(x)). Only the image PROJECTION HEAD sees the
augmentation: z = g_I(h, f_A(A)), where f_A is an MLP embedding the
augmentation vector (``AUG_FIELDS``, 11 numbers: crop x, y, w, h;
brightness, contrast, saturation, hue factors; blur sigma; flip and
grayscale flags). Its layout is declared here, by the head that embeds it;
the data pipeline (``prolip_jax.data.transforms``) writes it in this order,
so models never import data. The paper's image head is three residual blocks
(Table 4a: best with the augmentation embedding); the text head is linear,
z = g_T(f_T(x)). Downstream (zero-shot, linear probe) the head and f_A are
dropped and h is used, or the head is fed ``identity_aug_vector()``.

The paper does not say where the augmentation embedding enters the head nor
the widths; here it is concatenated to h before the head's input projection,
and f_A is a 2-layer GELU MLP. Outputs are not normalised (the losses take
cosines).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array

# The augmentation vector of a view: what ``data.transforms`` draws for it.
AUG_FIELDS = ('crop_x', 'crop_y', 'crop_w', 'crop_h', 'brightness', 'contrast',
              'saturation', 'hue', 'blur_sigma', 'flip', 'grayscale')
AUG_DIM = len(AUG_FIELDS)

__all__ = ['AugmentationEncoder', 'ResidualBlock', 'AugAwareImageHead',
           'TextHead', 'AUG_DIM', 'AUG_FIELDS']


class AugmentationEncoder(nn.Module):
  """f_A: ``(..., AUG_DIM)`` augmentation vector -> ``(..., features)``.

  Dense(hidden) -> GELU -> Dense(features).
  """
  features: int = 128
  hidden: int = 128
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, aug: Array) -> Array:
    if aug.shape[-1] != AUG_DIM:
      raise ValueError(f'augmentation vectors must have {AUG_DIM} entries '
                       f'(AUG_FIELDS), got shape {aug.shape}')
    x = nn.Dense(self.hidden, dtype=self.dtype, name='fc1')(aug)
    x = nn.gelu(x, approximate=False)
    return nn.Dense(self.features, dtype=self.dtype, name='fc2')(x)


class ResidualBlock(nn.Module):
  """x + Dense(width)(GELU(Dense(hidden)(LayerNorm(x)))), pre-norm."""
  hidden: int
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    y = nn.LayerNorm(dtype=self.dtype, name='ln')(x)
    y = nn.Dense(self.hidden, dtype=self.dtype, name='fc1')(y)
    y = nn.gelu(y, approximate=False)
    y = nn.Dense(x.shape[-1], dtype=self.dtype, name='fc2')(y)
    return x + y


class AugAwareImageHead(nn.Module):
  """g_I: (h, aug) -> z, UniCLIP's augmentation-aware image projection head.

  z = Dense(embed_dim)(LN(ResBlock^num_blocks(Dense(width)([h, f_A(aug)])))).
  With ``use_aug=False`` the augmentation is ignored (``aug`` may be None):
  the plain residual head of Table 4a's ablation.

  Attributes:
    embed_dim: output (shared space) dimension.
    width: residual stream width (default: embed_dim).
    num_blocks: residual blocks (paper: 3).
    mlp_ratio: hidden width of each block relative to ``width``.
    aug_features, aug_hidden: f_A's output and hidden widths.
    use_aug: condition on the augmentation embedding.
  """
  embed_dim: int
  width: Optional[int] = None
  num_blocks: int = 3
  mlp_ratio: float = 2.0
  aug_features: int = 128
  aug_hidden: int = 128
  use_aug: bool = True
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, h: Array, aug: Optional[Array] = None) -> Array:
    """h: ``(B, d_h)`` encoder features; aug: ``(B, AUG_DIM)`` -> ``(B, E)``."""
    width = self.width or self.embed_dim
    x = jnp.asarray(h, self.dtype)
    if self.use_aug:
      if aug is None:
        raise ValueError('AugAwareImageHead(use_aug=True) needs aug vectors')
      a = AugmentationEncoder(self.aug_features, self.aug_hidden, self.dtype,
                              name='aug_encoder')(jnp.asarray(aug,
                                                              self.dtype))
      x = jnp.concatenate([x, a], axis=-1)
    x = nn.Dense(width, dtype=self.dtype, name='proj_in')(x)
    for k in range(self.num_blocks):
      x = ResidualBlock(int(width * self.mlp_ratio), self.dtype,
                        name=f'block{k}')(x)
    x = nn.LayerNorm(dtype=self.dtype, name='ln_out')(x)
    return nn.Dense(self.embed_dim, dtype=self.dtype, name='proj_out')(x)


class TextHead(nn.Module):
  """g_T: a linear layer ``(B, d_h) -> (B, embed_dim)`` (UniCLIP 2.1)."""
  embed_dim: int
  use_bias: bool = True
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, h: Array) -> Array:
    return nn.Dense(self.embed_dim, use_bias=self.use_bias, dtype=self.dtype,
                    name='proj')(h)
