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

from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

IMPLEMENTATIONS = ('auto', 'xla', 'cudnn')
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
                          implementation: str = 'xla') -> Array:
  """softmax(q k^T / sqrt(head_dim)) v of ``(b, t, heads, head_dim)`` inputs.

  ``kv_lengths``: optional ``(b,)`` int32; keys at positions >= the length are
  masked out (right padding); queries are not masked. ``causal``: query i sees
  keys <= i. ``implementation``: ``attention_impl_for``'s answer; 'cudnn'
  runs on cuDNN where ``cudnn_refusal`` accepts the shapes, else on XLA
  (same function, same masking).
  """
  impl = 'xla'
  if implementation == 'cudnn' and cudnn_refusal(
      q.shape[1], k.shape[1], q.shape[-1], q.dtype) is None:
    impl = 'cudnn'
  if kv_lengths is not None:
    kv_lengths = kv_lengths.astype(jnp.int32)
  return jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=kv_lengths, is_causal=causal,
      implementation=impl)
