"""Which attention kernel runs: XLA's, or cuDNN's fused (flash) attention.

Two decisions, both made before anything is traced:

* ``attention_impl_for(devices, requested)``: the implementation for the
  devices a step is compiled for (a mesh's devices, or topology devices when
  compiling ahead of time from a CPU). The code that builds a step calls it
  once and hands the answer to the model (``ProLIP(config, attention=...)``);
  model code never asks JAX which backend is the default, because under
  ahead-of-time compilation the default backend (CPU) is not the target.
* ``cudnn_refusal(q_len, kv_len, head_dim, dtype)``: whether one attention
  call of these static shapes is one that cuDNN accepts, from the rules of
  ``jax._src.cudnn.fused_attention_stablehlo`` (jax 0.10.2). Calls cuDNN
  would refuse run on XLA. The refusal cannot be caught at run time: under
  ``jax.checkpoint`` (remat, scan) cuDNN's training rule runs while JAX
  differentiates, outside any try/except around the forward call.

The rules, as written in jax 0.10.2 (``check_layout`` and
``check_is_flash_attention``):

* q, k, v rank 4, float16 or bfloat16 (fp8 is a separate path);
* head dim a multiple of 8 and at most 128 (256 on Hopper when the compiling
  process itself sees a Hopper GPU; under ahead-of-time compilation from a
  CPU jax checks 128, so 128 is the bound that holds everywhere);
* when the call is differentiated (``is_training``), query and key lengths
  both even. jax applies this "with bias" rule to every differentiated call,
  mask or not, because the forward rule passes a placeholder bias array; the
  model cannot know at trace time whether it is being differentiated, so the
  rule is applied to every call. ProLIP's masked image copies (49 kept patches
  + [CLS] + [UNC] = 51 tokens) therefore run on XLA: at 51 tokens attention
  is a few percent of the block's FLOPs, so padding them to 52 for cuDNN
  would buy little and change the model's shapes;
* a boolean mask becomes a ``(b, 1, 1, S)`` bias, which ``check_layout``
  refuses (the bias must be ``(., ., T, S)``): padding is therefore passed as
  key lengths (cuDNN's PADDING mask), never as a boolean mask.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

IMPLEMENTATIONS = ('auto', 'xla', 'cudnn')
# model.attention_logits_dtype: the dtype q k^T is rounded to on XLA's path
# before the softmax, which always runs in float32 ('float32' is jax's own
# XLA attention and the release's).
LOGITS_DTYPES = ('float32', 'bfloat16')
CUDNN_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
CUDNN_MAX_HEAD_DIM = 128


def is_cuda_device(device: Any) -> bool:
  """True for an NVIDIA GPU (a real one or an ahead-of-time topology one)."""
  if getattr(device, 'platform', '') not in ('gpu', 'cuda'):
    return False
  kind = str(getattr(device, 'device_kind', '')).lower()
  try:
    version = str(device.client.platform_version).lower()
  except Exception:  # pylint: disable=broad-except
    version = ''
  return 'cuda' in version or 'nvidia' in kind


def attention_impl_for(devices: Iterable[Any], requested: str = 'auto') -> str:
  """``'xla'`` or ``'cudnn'``: the attention implementation for ``devices``.

  ``devices``: the devices the step is compiled for (``mesh.devices.flat``,
  or ``jax.experimental.topologies`` devices ahead of time). ``requested``:
  ``model.attention_impl``; ``'auto'`` picks cuDNN exactly when every device
  is an NVIDIA GPU. ``'cudnn'`` on other devices is a ValueError (a config
  mistake). Calls whose shapes cuDNN refuses still run on XLA
  (``cudnn_refusal``).
  """
  if requested not in IMPLEMENTATIONS:
    raise ValueError(f'model.attention_impl must be one of {IMPLEMENTATIONS}, '
                     f'got {requested!r}')
  devices = list(devices)
  on_cuda = bool(devices) and all(is_cuda_device(d) for d in devices)
  if requested == 'xla':
    return 'xla'
  if requested == 'cudnn' and not on_cuda:
    platforms = sorted({str(getattr(d, 'platform', '?')) for d in devices})
    raise ValueError("model.attention_impl='cudnn' needs NVIDIA GPUs; the "
                     f'step is compiled for {platforms}')
  return 'cudnn' if on_cuda else 'xla'


def cudnn_refusal(q_len: int, kv_len: int, head_dim: int,
                  dtype: Any) -> Optional[str]:
  """Why cuDNN fused attention refuses this call, or None if it accepts it.

  Static shapes only (see the module docstring for the rules and where they
  come from); the call is assumed to be differentiated.
  """
  if np.dtype(dtype) not in CUDNN_DTYPES:
    return f'dtype {np.dtype(dtype)} is not float16/bfloat16'
  if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
    return (f'head dim {head_dim} is not a multiple of 8 up to '
            f'{CUDNN_MAX_HEAD_DIM}')
  if q_len % 2 or kv_len % 2:
    return (f'sequence lengths Q {q_len}, KV {kv_len} are not both even '
            '(cuDNN training kernel)')
  return None


def dot_product_attention(q: Array, k: Array, v: Array,
                          kv_lengths: Optional[Array] = None,
                          causal: bool = False,
                          implementation: str = 'xla',
                          logits_dtype: str = 'float32') -> Array:
  """softmax(q k^T / sqrt(head_dim)) v of ``(b, t, heads, head_dim)`` inputs.

  ``kv_lengths``: optional ``(b,)`` int32; keys at positions >= the length are
  masked out (right padding); queries are not masked. ``causal``: query i sees
  keys <= i. ``implementation``: ``attention_impl_for``'s answer; 'cudnn'
  runs on cuDNN where ``cudnn_refusal`` accepts the shapes, else on XLA
  (same function, same masking). ``logits_dtype`` (``LOGITS_DTYPES``): on
  XLA's path, 'bfloat16' rounds the scaled logits ``(b, heads, t, t)`` to
  bfloat16 before the float32 softmax (``low_precision_logits_attention``);
  cuDNN keeps its own float32 accumulation either way.
  """
  if logits_dtype not in LOGITS_DTYPES:
    raise ValueError(f'model.attention_logits_dtype must be one of '
                     f'{LOGITS_DTYPES}, got {logits_dtype!r}')
  impl = 'xla'
  if implementation == 'cudnn' and cudnn_refusal(
      q.shape[1], k.shape[1], q.shape[-1], q.dtype) is None:
    impl = 'cudnn'
  if kv_lengths is not None:
    kv_lengths = kv_lengths.astype(jnp.int32)
  if impl == 'xla' and logits_dtype == 'bfloat16':
    return low_precision_logits_attention(q, k, v, kv_lengths, causal)
  return jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=kv_lengths, is_causal=causal,
      implementation=impl)


def low_precision_logits_attention(q: Array, k: Array, v: Array,
                                   kv_lengths: Optional[Array] = None,
                                   causal: bool = False) -> Array:
  """Attention whose logits are stored in bfloat16 (MaxText's default,
  ``float32_qk_product: false``, ``float32_logits: false``).

  Same inputs and masking as ``dot_product_attention``. ``q`` is scaled by
  ``1/sqrt(head_dim)`` in its dtype, ``q k^T`` is written as bfloat16 (the
  dot accumulates in float32 inside the kernel), then masked and put
  through a float32 softmax; the probabilities are cast to ``v``'s dtype for the
  second product, as in jax's XLA attention. The logits tensor
  ``(b, heads, t, t)`` is the one that crosses memory between the two
  matmuls, so halving it halves attention's memory traffic where XLA does
  not fuse the softmax into the products (docs/scaling.md prices it).
  """
  # The scale goes on q (exact for heads of 64 or 256, a power of 4), so
  # that the product XLA writes out is the bf16 logits themselves.
  q = q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)
  logits = jnp.einsum('btnh,bsnh->bnts', q, k,
                      preferred_element_type=jnp.bfloat16)
  logits = logits.astype(jnp.float32)
  t, s = logits.shape[-2:]
  keep = jnp.ones((t, s), bool)
  if causal:
    keep = jnp.tril(keep)
  keep = keep[None, None]
  if kv_lengths is not None:
    keep = keep & (jnp.arange(s)[None, None, None, :]
                   < kv_lengths[:, None, None, None])
  # A finite stand-in for -inf, as jax's: a row with no key left stays
  # finite (uniform) instead of NaN.
  logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min * 0.7)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum('bnts,bsnh->btnh', probs, v)
