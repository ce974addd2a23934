"""Image and text towers with ProLIP's [CLS] and [UNC] tokens.

Each tower maps its input to a diagonal Gaussian: mean ``mu`` (L2-normalised
projection of the [CLS] output) and ``logvar`` = log sigma^2 (linear projection
of the [UNC] output, bias initialised to -10). With ``use_unc=False`` the same
towers are the deterministic CLIP/SigLIP encoders and ``logvar`` is None.

``release_compat`` reproduces three places where the public PyTorch release
differs from the paper (docs/objectives.md, "Paper vs release"): the image
[CLS] passes ``ln_post`` twice; text [UNC]/[CLS] sit after the whole padded
context and padding is attended to; text log sigma^2 comes from the
projected [CLS].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from prolip_jax.config import presets
from prolip_jax.models.transformer import Encoder
from prolip_jax.models.transformer import StackOptions

Array = jax.Array

# The configs' defaults: ViT-B/16, i.e. the declared model.* defaults
# (config_keys.KEYS) with the B/16 row of config/sizes.SIZES.
_B16 = presets.model_preset('B/16')
UNC_BIAS_INIT = _B16.init_unc_bias


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
  """``x / max(||x||, eps)`` over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """ViT image tower: square images cut into ``patch_size`` patches, a
  pre-LN transformer of ``layers`` blocks, ``width`` wide with ``heads``
  heads and an MLP of ``mlp_ratio * width``. Defaults are ViT-B/16's
  (``presets.model_preset('B/16').vision``)."""
  image_size: int = _B16.vision.image_size
  patch_size: int = _B16.vision.patch_size
  width: int = _B16.vision.width
  layers: int = _B16.vision.layers
  heads: int = _B16.vision.heads
  mlp_ratio: float = _B16.vision.mlp_ratio
  act: str = _B16.vision.act
  ln_eps: float = _B16.vision.ln_eps


@dataclasses.dataclass(frozen=True)
class TextConfig:
  """Text transformer over token ids of at most ``context_length`` (the
  [UNC]/[CLS] slots are extra); ``pad_id`` marks padding, which attention
  ignores. Defaults are ProLIP B/16's 12 x 768 tower on SigLIP's vocabulary
  (``presets.model_preset('B/16').text``)."""
  vocab_size: int = _B16.text.vocab_size
  context_length: int = _B16.text.context_length
  width: int = _B16.text.width
  layers: int = _B16.text.layers
  heads: int = _B16.text.heads
  mlp_ratio: float = _B16.text.mlp_ratio
  act: str = _B16.text.act
  ln_eps: float = _B16.text.ln_eps
  pad_id: int = _B16.text.pad_id
  proj_bias: bool = _B16.text.proj_bias
  # 'cls': ProLIP/SigLIP-style appended [CLS]; 'argmax': open_clip CLIP pools
  # the token with the largest id (end of text) under a causal mask.
  pool: str = _B16.text.pool
  causal: bool = _B16.text.causal


def _unc_head(embed_dim: int, in_width: int, dtype, name: str,
              bias_init: float) -> nn.Dense:
  return nn.Dense(embed_dim, dtype=dtype, name=name,
                  kernel_init=nn.initializers.normal(in_width**-0.5),
                  bias_init=nn.initializers.constant(bias_init))


class ImageTower(nn.Module):
  """ViT with [CLS], [UNC] prepended to the patch tokens.

  Input ``images``: ``(b, h, w, 3)`` float, already normalised.
  ``keep_indices``: optional ``(b, n_keep)`` patch indices for token-drop
  masking; positional embeddings are added before the drop, so kept patches
  keep their positions and [CLS]/[UNC] are always kept.
  Returns ``(mu (b, embed_dim) float32, logvar (b, embed_dim) float32 | None)``.
  """
  cfg: VisionConfig
  embed_dim: int
  use_unc: bool = True
  release_compat: bool = False
  dtype: Any = jnp.float32
  options: StackOptions = StackOptions()
  init_unc_bias: float = UNC_BIAS_INIT

  @nn.compact
  def __call__(self, images: Array, keep_indices: Optional[Array] = None):
    cfg = self.cfg
    if images.shape[1] % cfg.patch_size or images.shape[2] % cfg.patch_size:
      raise ValueError(f'image size {images.shape[1:3]} is not a multiple of '
                       f'patch size {cfg.patch_size}')
    n_special = 2 if self.use_unc else 1
    x = nn.Conv(cfg.width, (cfg.patch_size, cfg.patch_size),
                strides=(cfg.patch_size, cfg.patch_size), padding='VALID',
                use_bias=False, dtype=self.dtype, name='conv1')(
                    images.astype(self.dtype))
    b = x.shape[0]
    x = x.reshape(b, -1, cfg.width)
    n_patches = x.shape[1]
    init = nn.initializers.normal(cfg.width**-0.5)
    pos = self.param('positional_embedding', init,
                     (n_special + n_patches, cfg.width))
    special = [self.param('class_embedding', init, (cfg.width,))]
    if self.use_unc:
      special.append(self.param('unc_embedding', init, (cfg.width,)))
    x = x + pos[n_special:].astype(x.dtype)
    if keep_indices is not None:
      x = jnp.take_along_axis(x, keep_indices[:, :, None], axis=1)
    special = jnp.stack(special) + pos[:n_special]
    special = jnp.broadcast_to(special.astype(x.dtype),
                               (b, n_special, cfg.width))
    x = jnp.concatenate([special, x], axis=1)
    x = nn.LayerNorm(epsilon=cfg.ln_eps, dtype=self.dtype, name='ln_pre')(x)
    x = Encoder(cfg.width, cfg.layers, cfg.heads,
                int(cfg.width * cfg.mlp_ratio), cfg.act, cfg.ln_eps,
                self.dtype, self.options, name='transformer')(x)
    ln_post = nn.LayerNorm(epsilon=cfg.ln_eps, dtype=self.dtype, name='ln_post')
    x = ln_post(x)
    cls_out = ln_post(x[:, 0]) if self.release_compat else x[:, 0]
    mu = nn.Dense(self.embed_dim, use_bias=False, dtype=self.dtype,
                  kernel_init=init, name='proj')(cls_out)
    logvar = None
    if self.use_unc:
      head = _unc_head(self.embed_dim, cfg.width, self.dtype,
                       'uncertainty_proj', self.init_unc_bias)
      logvar = head(x[:, 1]).astype(jnp.float32)
    return l2_normalize(mu), logvar


class TextTower(nn.Module):
  """Transformer over token ids with [UNC], [CLS] appended after the caption.

  Input ``tokens``: ``(b, L)`` int32, right-padded with ``pad_id``. By default
  [UNC] goes right after the last real token and [CLS] after it, and a padding
  mask keeps pad tokens out of every output. In ``release_compat`` they go at
  positions L and L+1 and nothing is masked, as in the public release.
  Returns ``(mu (b, embed_dim) float32, logvar (b, embed_dim) float32 | None)``.
  """
  cfg: TextConfig
  embed_dim: int
  use_unc: bool = True
  release_compat: bool = False
  dtype: Any = jnp.float32
  options: StackOptions = StackOptions()
  init_unc_bias: float = UNC_BIAS_INIT

  @nn.compact
  def __call__(self, tokens: Array):
    cfg = self.cfg
    b, length = tokens.shape
    if length != cfg.context_length:
      raise ValueError(f'tokens have length {length}, the model expects '
                       f'context_length={cfg.context_length}')
    n_special = 0 if cfg.pool == 'argmax' else (2 if self.use_unc else 1)
    total = length + n_special
    init = nn.initializers.normal(0.01)
    x = nn.Embed(cfg.vocab_size, cfg.width,
                 embedding_init=nn.initializers.normal(0.02),
                 name='token_embedding')(tokens)
    x = jnp.pad(x, ((0, 0), (0, n_special), (0, 0)))
    positions = jnp.arange(total)[None, :]
    if self.release_compat:
      n_real = jnp.full((b, 1), length)
    else:
      n_real = jnp.sum(tokens != cfg.pad_id, axis=1, keepdims=True)
    if n_special:
      cls_pos = n_real + n_special - 1  # [UNC] (if any) at n_real, [CLS] last
      cls_emb = self.param('cls_emb', init, (cfg.width,))
      x = jnp.where((positions == cls_pos)[..., None], cls_emb, x)
      if self.use_unc:
        unc_emb = self.param('unc_emb', init, (cfg.width,))
        x = jnp.where((positions == n_real)[..., None], unc_emb, x)
    pos = self.param('positional_embedding', init, (total, cfg.width))
    x = (x + pos).astype(self.dtype)
    # Keys that exist: the first n_real + n_special positions (a prefix, so
    # lengths rather than a boolean mask: cuDNN takes lengths, see
    # models/attention.py). The release attends to padding too.
    kv_lengths = None
    if not self.release_compat:
      kv_lengths = (n_real + n_special)[:, 0].astype(jnp.int32)
    x = Encoder(cfg.width, cfg.layers, cfg.heads,
                int(cfg.width * cfg.mlp_ratio), cfg.act, cfg.ln_eps,
                self.dtype, self.options, cfg.causal,
                name='transformer')(x, kv_lengths)
    x = nn.LayerNorm(epsilon=cfg.ln_eps, dtype=self.dtype, name='ln_final')(x)
    take = lambda idx: jnp.take_along_axis(x, idx[:, :, None], axis=1)[:, 0]
    if cfg.pool == 'argmax':
      cls_out = take(jnp.argmax(tokens, axis=1)[:, None])
    else:
      cls_out = take(cls_pos)
    projected = nn.Dense(self.embed_dim, use_bias=cfg.proj_bias,
                         dtype=self.dtype, name='text_projection')(cls_out)
    logvar = None
    if self.use_unc:
      if self.release_compat:
        head_in, in_width = projected, self.embed_dim
      else:
        head_in, in_width = take(n_real), cfg.width
      logvar = _unc_head(self.embed_dim, in_width, self.dtype,
                         'text_uncertainty_projection',
                         self.init_unc_bias)(head_in)
      logvar = logvar.astype(jnp.float32)
    return l2_normalize(projected), logvar
