"""Pre-LN transformer encoder shared by the image and text towers.

Parameter names follow open_clip's layout where that costs nothing (``ln_1``,
``attn``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``) so the PyTorch converter is a
table of renames; q/k/v stay separate Dense layers (fused only on export).

With ``scan`` the blocks are one ``flax.linen.scan`` over a block whose
parameters carry a leading ``layers`` axis (``resblocks/...``, as in
big_vision's ViT): XLA compiles one block instead of ``layers`` copies.
Without it they are ``resblocks_{i}``. ``convert.stack_layers`` /
``unstack_layers`` move parameters between the two layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from prolip_jax.models.attention import dot_product_attention

Array = jax.Array
Dtype = Any


def quick_gelu(x: Array) -> Array:
  """OpenAI CLIP's sigmoid approximation of GELU."""
  return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),
    'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'quick_gelu': quick_gelu,
}


class Mlp(nn.Module):
  """Two-layer MLP of a transformer block."""
  width: int
  mlp_dim: int
  act: str = 'gelu'
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    x = nn.Dense(self.mlp_dim, dtype=self.dtype, name='c_fc')(x)
    x = ACTIVATIONS[self.act](x)
    return nn.Dense(self.width, dtype=self.dtype, name='c_proj')(x)


# Names of jax.checkpoint_policies that model.remat_policy accepts. The
# default, 'nothing_saveable', is what model.remat=True has always meant
# (jax.checkpoint's default: keep only each block's input).
REMAT_POLICIES = ('nothing_saveable', 'dots_saveable',
                  'dots_with_no_batch_dims_saveable')

# Name of the scanned block stack in the parameter tree (its leaves carry a
# leading ``layers`` axis); unrolled blocks are ``resblocks_{i}``.
SCANNED_BLOCKS = 'resblocks'


@dataclasses.dataclass(frozen=True)
class StackOptions:
  """How the block stack is compiled; none of it but ``logits_dtype``
  changes the function.

  ``remat``: rematerialise each block in the backward pass with
  ``jax.checkpoint_policies.<remat_policy>`` (``REMAT_POLICIES``).
  ``scan``: one ``nn.scan`` over the blocks (parameters stacked on a leading
  axis) instead of ``layers`` unrolled copies. ``attention``: 'xla' or
  'cudnn', from ``attention.attention_impl_for``. ``logits_dtype``: the
  dtype of XLA attention's logits (``attention.LOGITS_DTYPES``): 'bfloat16'
  changes the numbers slightly (docs/scaling.md prices it).
  """
  remat: bool = False
  remat_policy: str = 'nothing_saveable'
  scan: bool = False
  attention: str = 'xla'
  logits_dtype: str = 'float32'


class Attention(nn.Module):
  """Multi-head self-attention over ``(b, t, width)``.

  ``kv_lengths``: optional ``(b,)`` number of leading positions that exist
  (keys beyond it are masked); ``causal``: position i sees keys <= i.
  """
  width: int
  heads: int
  dtype: Dtype = jnp.float32
  causal: bool = False
  implementation: str = 'xla'
  logits_dtype: str = 'float32'

  @nn.compact
  def __call__(self, x: Array, kv_lengths: Optional[Array] = None) -> Array:
    if self.width % self.heads:
      raise ValueError(f'width {self.width} not divisible by {self.heads} heads')
    b, t, _ = x.shape
    head_dim = self.width // self.heads
    split = lambda y: y.reshape(b, t, self.heads, head_dim)
    q = split(nn.Dense(self.width, dtype=self.dtype, name='q')(x))
    k = split(nn.Dense(self.width, dtype=self.dtype, name='k')(x))
    v = split(nn.Dense(self.width, dtype=self.dtype, name='v')(x))
    out = dot_product_attention(q, k, v, kv_lengths, self.causal,
                                self.implementation, self.logits_dtype)
    out = out.reshape(b, t, self.width)
    return nn.Dense(self.width, dtype=self.dtype, name='out_proj')(out)


class EncoderBlock(nn.Module):
  """x + attn(ln_1(x)); x + mlp(ln_2(x)).

  ``scanned``: return ``(x, None)``, the carry/output pair of ``nn.scan``.
  """
  width: int
  heads: int
  mlp_dim: int
  act: str = 'gelu'
  ln_eps: float = 1e-5
  dtype: Dtype = jnp.float32
  causal: bool = False
  attention: str = 'xla'
  scanned: bool = False
  logits_dtype: str = 'float32'

  @nn.compact
  def __call__(self, x: Array, kv_lengths: Optional[Array] = None):
    ln = lambda name: nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype,
                                   name=name)
    x = x + Attention(self.width, self.heads, self.dtype, self.causal,
                      self.attention, self.logits_dtype,
                      name='attn')(ln('ln_1')(x), kv_lengths)
    x = x + Mlp(self.width, self.mlp_dim, self.act, self.dtype,
                name='mlp')(ln('ln_2')(x))
    return (x, None) if self.scanned else x


class Encoder(nn.Module):
  """A stack of ``layers`` pre-LN blocks: ``resblocks_{i}``, or with
  ``options.scan`` one scanned ``resblocks`` whose leaves have a leading
  ``layers`` axis. ``kv_lengths`` and ``causal``: see ``Attention``."""
  width: int
  layers: int
  heads: int
  mlp_dim: int
  act: str = 'gelu'
  ln_eps: float = 1e-5
  dtype: Dtype = jnp.float32
  options: StackOptions = StackOptions()
  causal: bool = False

  @nn.compact
  def __call__(self, x: Array, kv_lengths: Optional[Array] = None) -> Array:
    opts = self.options
    block_cls = EncoderBlock
    if opts.remat:
      # Rematerialising each block trades one extra forward for activation
      # memory; the policy picks what the backward pass may keep.
      if opts.remat_policy not in REMAT_POLICIES:
        raise ValueError(f'model.remat_policy must be one of '
                         f'{REMAT_POLICIES}, got {opts.remat_policy!r}')
      policy = (None if opts.remat_policy == 'nothing_saveable' else
                getattr(jax.checkpoint_policies, opts.remat_policy))
      # Inside scan the loop already keeps XLA from merging the recomputation
      # into the forward pass, so CSE prevention only costs (big_vision).
      block_cls = nn.remat(block_cls, policy=policy,
                           prevent_cse=not opts.scan)
    kwargs = dict(width=self.width, heads=self.heads, mlp_dim=self.mlp_dim,
                  act=self.act, ln_eps=self.ln_eps, dtype=self.dtype,
                  causal=self.causal, attention=opts.attention,
                  logits_dtype=opts.logits_dtype)
    if opts.scan:
      stack = nn.scan(block_cls, variable_axes={'params': 0},
                      split_rngs={'params': True}, in_axes=nn.broadcast,
                      length=self.layers)
      x, _ = stack(**kwargs, scanned=True, name=SCANNED_BLOCKS)(x, kv_lengths)
      return x
    for i in range(self.layers):
      x = block_cls(**kwargs, name=f'resblocks_{i}')(x, kv_lengths)
    return x
