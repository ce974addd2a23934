"""Attention implementation: device resolution, cuDNN eligibility, masking.

The eligibility rule (``models.cudnn_refusal``) is checked against jax's own
cuDNN checks (``check_layout`` and ``check_is_flash_attention`` of
jax._src.cudnn.fused_attention_stablehlo, which need only shapes) on every
attention call that the shipped configs make, recorded by tracing the real
model. The H100 compile test spawns the CUDA build of jax (see
``_gpu_python``) and compiles the B/16 train step deviceless.
"""

import dataclasses
import glob
import importlib.util
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax.config import presets
from prolip_jax.models import attention
from prolip_jax.models import attention_impl_for
from prolip_jax.models import cudnn_refusal
from prolip_jax.models import masking
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))


def _device(platform, kind='', version=''):
  return types.SimpleNamespace(
      platform=platform, device_kind=kind,
      client=types.SimpleNamespace(platform_version=version))


H100 = _device('gpu', 'NVIDIA H100 80GB HBM3', 'PJRT C API\ncuda 12090')
ROCM = _device('gpu', 'AMD Instinct MI300X', 'PJRT C API\nrocm 6.3')


def test_attention_impl_follows_the_compile_target_not_the_default_backend():
  cpu = jax.devices('cpu')  # this process's default backend
  assert attention_impl_for([H100, H100]) == 'cudnn'
  assert attention_impl_for(cpu) == 'xla'
  assert attention_impl_for([_device('tpu', 'TPU v5p')]) == 'xla'
  assert attention_impl_for([ROCM]) == 'xla'
  assert attention_impl_for([H100, cpu[0]]) == 'xla'  # mixed: no cuDNN
  assert attention_impl_for([H100], 'xla') == 'xla'
  assert attention_impl_for([H100], 'cudnn') == 'cudnn'
  with pytest.raises(ValueError, match='needs NVIDIA GPUs'):
    attention_impl_for(cpu, 'cudnn')
  with pytest.raises(ValueError, match='attention_impl'):
    attention_impl_for(cpu, 'flash')
  with pytest.raises(ValueError, match="'xla' or 'cudnn'"):
    ProLIP(ModelConfig(), attention='auto').init(
        jax.random.key(0), jnp.zeros((1, 224, 224, 3)),
        jnp.zeros((1, 64), jnp.int32))


def _jax_accepts(q_len, kv_len, head_dim, dtype, with_lengths):
  """jax 0.10.2's own verdict on a differentiated cuDNN attention call."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  b, heads = 4, 3
  q = jax.ShapeDtypeStruct((b, q_len, heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((b, kv_len, heads, head_dim), dtype)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32) if with_lengths else None
  try:
    fa.check_layout(q, kv, kv, None, lengths, lengths, None, None, None, None,
                    fa.AttentionLayout.BTNH)
    # The forward rule under differentiation: a placeholder bias is always
    # passed (has_bias=True) and is_training=True.
    fa.check_is_flash_attention(q, kv, kv, fa.AttentionLayout.BTNH.value,
                                91000, True, True)
  except (NotImplementedError, ValueError):
    return False
  return True


def _recorded_calls(cfg: ModelConfig, keep_ratio: float, monkeypatch):
  """The jax.nn.dot_product_attention call of encode_image (full and masked
  copies) and of encode_text, traced (no compute) with attention='cudnn'."""
  calls = []

  def spy(q, k, v, **kw):
    calls.append(dict(q=q.shape, k=k.shape, dtype=q.dtype,
                      lengths=kw.get('key_value_seq_lengths') is not None,
                      impl=kw['implementation']))
    return jnp.zeros_like(q)

  monkeypatch.setattr(jax.nn, 'dot_product_attention', spy)
  # One traced block per tower is enough to see every shape.
  cfg = dataclasses.replace(cfg, scan=True)
  model = ProLIP(cfg, attention='cudnn')
  size = cfg.vision.image_size
  images = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
  tokens = jax.ShapeDtypeStruct((2, cfg.text.context_length), jnp.int32)
  n_keep = masking.num_kept_patches(cfg.num_patches, keep_ratio)
  keep = jax.ShapeDtypeStruct((2, n_keep), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), images, tokens)
  out = []
  for args, method in (((images,), 'encode_image'),
                       ((images, keep), 'encode_image'),
                       ((tokens,), 'encode_text')):
    calls.clear()
    jax.eval_shape(lambda p, *a, m=method: model.apply(p, *a, method=m),
                   params, *args)
    # nn.scan may trace its body more than once: the calls are all alike.
    assert calls and all(c == calls[0] for c in calls), calls
    out.append(calls[0])
  return out


@pytest.mark.parametrize('path', CONFIGS, ids=os.path.basename)
def test_cudnn_rule_matches_jax_on_every_shipped_attention_call(
    path, monkeypatch):
  config = presets.load_config_file(path)
  cfg = ModelConfig.from_config(config.model)
  calls = _recorded_calls(cfg, config.masking.image_keep_ratio, monkeypatch)
  assert len(calls) == 3  # full image, masked image, text
  for call in calls:
    b, t, heads, head_dim = call['q']
    refusal = cudnn_refusal(t, call['k'][1], head_dim, call['dtype'])
    assert (refusal is None) == _jax_accepts(
        t, call['k'][1], head_dim, call['dtype'], call['lengths']), call
    assert call['impl'] == ('cudnn' if refusal is None else 'xla'), call
  full, masked, text = (c['q'][1] for c in calls)
  n_special = 2 if cfg.use_unc else 1
  assert full == cfg.num_patches + n_special
  assert masked == masking.num_kept_patches(
      cfg.num_patches, config.masking.image_keep_ratio) + n_special
  assert text == cfg.text.context_length + (
      0 if cfg.text.pool == 'argmax' else n_special)
  if os.path.basename(path) == 'prolip_b16.py':
    # 196 + 2 and 64 + 2 on cuDNN; the masked copies' 49 + 2 on XLA.
    assert [c['impl'] for c in calls] == ['cudnn', 'xla', 'cudnn']
    assert masked == 51


def _reference_attention(q, k, v, lengths, causal):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(q.shape[-1])
  t = q.shape[1]
  keep = np.arange(t)[None, None, None, :] < lengths[:, None, None, None]
  if causal:
    keep = keep & np.tril(np.ones((t, t), bool))[None, None]
  logits = np.where(keep, logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  return np.einsum('bhqk,bkhd->bqhd', w, v)


@pytest.mark.parametrize('causal', [False, True])
def test_attention_masks_keys_beyond_lengths(causal):
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(3, 6, 2, 8)).astype(np.float32)
             for _ in range(3))
  lengths = np.array([6, 4, 1], np.int32)
  # 'cudnn' asked for, but float32 is ineligible: XLA computes it here.
  out = attention.dot_product_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths),
      causal, 'cudnn')
  np.testing.assert_allclose(out, _reference_attention(q, k, v, lengths,
                                                       causal), atol=1e-5)


@pytest.mark.parametrize('causal', [False, True])
def test_bfloat16_logits_are_the_rounded_logits_through_a_float32_softmax(
    causal):
  """model.attention_logits_dtype='bfloat16' against numpy: (q/sqrt(d)) k^T
  in float64, rounded to bfloat16, softmax in float64, the
  probabilities rounded to the inputs' dtype (bfloat16 here). Its error
  against exact attention is larger than float32 logits' but of the same
  order (the price docs/scaling.md measures in training)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  bf16 = ml_dtypes.bfloat16
  rng = np.random.default_rng(1)
  # Logits of std ~4, where bfloat16's 8 bits show.
  q, k, v = (rng.normal(size=(2, 12, 3, 16)).astype(bf16) for _ in range(3))
  lengths = np.array([12, 5], np.int32)
  got = np.asarray(attention.dot_product_attention(
      *map(jnp.asarray, (q, k, v, lengths)), causal, 'xla', 'bfloat16'),
      np.float64)
  qf, kf, vf = (x.astype(np.float64) for x in (q, k, v))
  # 1/sqrt(16) is a power of two: scaling q in bfloat16 is exact.
  logits = np.einsum('bqhd,bkhd->bhqk', qf / 4, kf).astype(bf16)
  logits = logits.astype(np.float64)
  keep = np.arange(12)[None, None, None, :] < lengths[:, None, None, None]
  if causal:
    keep = keep & np.tril(np.ones((12, 12), bool))
  logits = np.where(keep, logits, -np.inf)
  w = np.exp(logits - logits.max(-1, keepdims=True))
  w = (w / w.sum(-1, keepdims=True)).astype(bf16).astype(np.float64)
  want = np.einsum('bhqk,bkhd->bqhd', w, vf)
  # The output is bfloat16 (a rounding of 2^-8 relative).
  np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7)
  exact = _reference_attention(qf, kf, vf, lengths, causal)
  f32 = np.asarray(attention.dot_product_attention(
      *map(jnp.asarray, (q, k, v, lengths)), causal, 'xla', 'float32'),
      np.float64)
  err_bf16 = np.abs(got - exact).mean()
  err_f32 = np.abs(f32 - exact).mean()
  assert err_f32 < err_bf16 < 4 * err_f32, (err_f32, err_bf16)
  with pytest.raises(ValueError, match='attention_logits_dtype'):
    attention.dot_product_attention(*map(jnp.asarray, (q, k, v)),
                                    logits_dtype='float16')


def test_the_logits_dtype_reaches_every_attention_call_of_the_model():
  """The option flows from the config to each block: a tiny model's
  outputs change with it (and only slightly), and cuDNN's path is not
  asked for on the CPU."""
  cfg = presets.model_preset('tiny')
  cfg.compute_dtype = 'bfloat16'
  outs = {}
  for dtype in attention.LOGITS_DTYPES:
    cfg.attention_logits_dtype = dtype
    model_cfg = ModelConfig.from_config(cfg)
    model = ProLIP(model_cfg)
    images = jnp.asarray(np.random.default_rng(0).uniform(
        -1, 1, (2, model_cfg.vision.image_size, model_cfg.vision.image_size,
                3)), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(1).integers(
        4, 100, (2, model_cfg.text.context_length)), jnp.int32)
    params = model.init(jax.random.key(0), images, tokens)
    outs[dtype] = np.asarray(model.apply(
        params, images, method=model.encode_image)[0], np.float32)
  diff = np.abs(outs['float32'] - outs['bfloat16']).max()
  assert 0 < diff < 0.05, diff
  cfg.attention_logits_dtype = 'float16'
  with pytest.raises(ValueError, match='attention_logits_dtype'):
    ModelConfig.from_config(cfg)


def _gpu_python():
  """The interpreter of the CUDA build of jax, or (None, why)."""
  exe = os.environ.get('PROLIP_GPU_PYTHON', '')
  if exe:
    return (exe, '') if os.path.exists(exe) else (
        None, f'PROLIP_GPU_PYTHON={exe} does not exist')
  if importlib.util.find_spec('jax_cuda12_plugin') is not None:
    return sys.executable, ''
  return None, ('no CUDA build of jax: set PROLIP_GPU_PYTHON to the python '
                'of a venv with jax[cuda12] (docs/gpu.md)')


@pytest.mark.slow
def test_b16_train_step_compiles_for_h100_with_cudnn_attention(tmp_path):
  exe, why = _gpu_python()
  if exe is None:
    pytest.skip(why)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_SKIP_CUDA_CONSTRAINTS_CHECK='1',
             XLA_FLAGS='--xla_gpu_enable_triton_gemm=false',
             JAX_PLATFORMS='cpu')
  out = tmp_path / 'result.json'
  proc = subprocess.run(
      [exe, os.path.join(ROOT, 'tests', 'gpu_aot_check.py'),
       '--per_device_batch=16', f'--out={out}'],
      env=env, capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  result = json.loads(out.read_text())
  assert result['attention'] == 'cudnn'
  # One backward kernel per eligible call: 12 blocks each of the full images
  # (198 tokens), the captions and the masked captions (66); the masked
  # images (51 tokens) run on XLA, else there would be 48. Remat runs each
  # forward twice. A scanned stack has its calls once, in the loop body.
  calls = 3 if result['scan'] else 36
  assert result['cudnn_bwd'] == calls, result
  assert result['cudnn_fwd'] == calls * (2 if result['remat'] else 1), result
