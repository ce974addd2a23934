"""Pre-LN transformer encoder shared by the image and text towers.

Parameter names follow open_clip's layout where that costs nothing (``ln_1``,
``attn``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``) so the PyTorch converter is a
table of renames; q/k/v stay separate Dense layers (fused only on export).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

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


def attention_implementation(backend: str, dtype: Any, head_dim: int) -> str:
  """The ``jax.nn.dot_product_attention`` implementation to ask for first.

  cuDNN's fused (flash) attention on GPUs for half-precision inputs with head
  dimensions it supports (multiples of 8 up to 128); XLA's otherwise (CPU,
  TPU, float32). ``jax.nn.dot_product_attention``'s own default is always
  XLA, so the choice is made here.
  """
  if (backend == 'gpu' and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and head_dim % 8 == 0 and head_dim <= 128):
    return 'cudnn'
  return 'xla'


def dot_product_attention(q: Array, k: Array, v: Array,
                          mask: Optional[Array] = None,
                          backend: Optional[str] = None) -> Array:
  """Softmax attention of ``(b, t, heads, head_dim)`` inputs, through cuDNN
  where ``attention_implementation`` says so, falling back to XLA when cuDNN
  refuses the call (version, shape or mask it does not support)."""
  backend = backend or jax.default_backend()
  if attention_implementation(backend, q.dtype, q.shape[-1]) == 'cudnn':
    try:
      return jax.nn.dot_product_attention(q, k, v, mask=mask,
                                          implementation='cudnn')
    except Exception:  # pylint: disable=broad-except
      pass  # refused at trace time: XLA computes the same function
  return jax.nn.dot_product_attention(q, k, v, mask=mask,
                                      implementation='xla')


class Attention(nn.Module):
  """Multi-head self-attention; ``mask`` is boolean ``(b, 1, q, k)``."""
  width: int
  heads: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array] = None) -> Array:
    if self.width % self.heads:
      raise ValueError(f'width {self.width} not divisible by {self.heads} heads')
    b, t, _ = x.shape
    head_dim = self.width // self.heads
    split = lambda y: y.reshape(b, t, self.heads, head_dim)
    q = split(nn.Dense(self.width, dtype=self.dtype, name='q')(x))
    k = split(nn.Dense(self.width, dtype=self.dtype, name='k')(x))
    v = split(nn.Dense(self.width, dtype=self.dtype, name='v')(x))
    out = dot_product_attention(q, k, v, mask=mask)
    out = out.reshape(b, t, self.width)
    return nn.Dense(self.width, dtype=self.dtype, name='out_proj')(out)


class EncoderBlock(nn.Module):
  """x + attn(ln_1(x)); x + mlp(ln_2(x))."""
  width: int
  heads: int
  mlp_dim: int
  act: str = 'gelu'
  ln_eps: float = 1e-5
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array] = None) -> Array:
    ln = lambda name: nn.LayerNorm(epsilon=self.ln_eps, dtype=self.dtype,
                                   name=name)
    x = x + Attention(self.width, self.heads, self.dtype, name='attn')(
        ln('ln_1')(x), mask)
    return x + Mlp(self.width, self.mlp_dim, self.act, self.dtype,
                   name='mlp')(ln('ln_2')(x))


class Encoder(nn.Module):
  """A stack of ``layers`` pre-LN blocks named ``resblocks_{i}``."""
  width: int
  layers: int
  heads: int
  mlp_dim: int
  act: str = 'gelu'
  ln_eps: float = 1e-5
  dtype: Dtype = jnp.float32
  remat: bool = False

  @nn.compact
  def __call__(self, x: Array, mask: Optional[Array] = None) -> Array:
    # Rematerialising each block trades one extra forward for activation
    # memory of a single block per layer.
    block_cls = nn.remat(EncoderBlock) if self.remat else EncoderBlock
    for i in range(self.layers):
      x = block_cls(self.width, self.heads, self.mlp_dim, self.act,
                    self.ln_eps, self.dtype, name=f'resblocks_{i}')(x, mask)
    return x
