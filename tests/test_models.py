"""Model tests: parameter counts, [CLS]/[UNC] placement, masking semantics."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax.config import presets
from prolip_jax.models import count_params
from prolip_jax.models import init_params
from prolip_jax.models import mask_text_tokens
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.models import random_keep_indices
from prolip_jax.models import TextConfig
from prolip_jax.models import VisionConfig


def _abstract_params(cfg):
  return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def _block_params(width, mlp):
  # q, k, v, out (weights + biases), two LayerNorms, MLP in and out.
  return 4 * (width * width + width) + 2 * 2 * width + (
      width * mlp + mlp) + (mlp * width + width)


def test_b16_parameter_count_matches_vit_b16_plus_text_tower():
  cfg = ModelConfig.from_config(presets.model_preset('B/16'))
  params = _abstract_params(cfg)
  w, d, v, ctx = 768, 768, 32100, 64
  # Standard ViT-B/16 image encoder (no classifier head): conv stem without
  # bias, [CLS], 197 positions, 12 blocks, ln_pre, ln_post, projection.
  vit_b16 = (3 * 16 * 16 * w + w + 197 * w + 12 * _block_params(w, 4 * w)
             + 2 * 2 * w + w * d)
  # 12x768 text transformer with appended [CLS], final LN and projection.
  text = (v * w + (ctx + 1) * w + w + 12 * _block_params(w, 4 * w) + 2 * w
          + w * d + d)
  expected = vit_b16 + text + 2  # + logit scale and bias
  total = count_params(params)
  assert abs(total - expected) / expected < 0.01, (total, expected)
  assert 85e6 < count_params(params['visual']) < 87e6  # ViT-B/16 is ~86M
  # [UNC] = two tokens, two extra positions and two log-variance heads.
  # Per tower (as the paper's Table C.2 counts it for the image encoder): one
  # token, one extra position and the log-variance head, well under 1M.
  det_params = _abstract_params(
      ModelConfig.from_config(presets.model_preset('B/16', use_unc=False)))
  for tower in ('visual', 'text'):
    tower_extra = count_params(params[tower]) - count_params(det_params[tower])
    assert tower_extra == w + w + (w * d + d), tower
    assert tower_extra < 1_000_000
  extra = total - count_params(det_params)
  print(f'B/16 ProLIP parameters: {total:,} (deterministic: {total - extra:,})')


def _tiny(**kw):
  base = dict(embed_dim=16,
              vision=VisionConfig(image_size=16, patch_size=4, width=32,
                                  layers=2, heads=4),
              text=TextConfig(vocab_size=50, context_length=8, width=32,
                              layers=2, heads=4, pad_id=0))
  base.update(kw)
  return ModelConfig(**base)


def _with_text_param(params, name, row, delta):
  p = jax.tree.map(lambda x: x, params)
  text = dict(p['text'])
  if name == 'token_embedding':
    arr = np.array(text[name]['embedding'])
  else:
    arr = np.array(text[name])
  arr[row] += delta  # a random direction: LayerNorm cancels constant shifts
  text[name] = ({'embedding': jnp.asarray(arr)} if name == 'token_embedding'
                else jnp.asarray(arr))
  p['text'] = text
  return p


def _perturb_padding_params(params, n_real, length):
  """Changes every parameter a pad position could read: if outputs move, pad
  tokens leaked into the real ones."""
  rng = np.random.default_rng(0)
  width = params['text']['cls_emb'].shape[0]
  for row in range(n_real + 2, length + 2):  # rows after [UNC], [CLS]
    params = _with_text_param(params, 'positional_embedding', row,
                              rng.normal(size=width))
  return _with_text_param(params, 'token_embedding', 0,  # the pad id
                          rng.normal(size=width))


@pytest.mark.parametrize('release_compat', [False, True])
def test_text_padding_is_masked_only_in_paper_mode(release_compat):
  cfg = _tiny(release_compat=release_compat)
  params = init_params(cfg, jax.random.key(1))
  model = ProLIP(cfg)
  tokens = jnp.array([[5, 6, 7, 0, 0, 0, 0, 0]])
  enc = lambda p: model.apply({'params': p}, tokens, method='encode_text')
  mu0, lv0 = enc(params)
  mu1, lv1 = enc(_perturb_padding_params(params, 3, 8))
  if release_compat:  # the release attends to padding
    assert not np.allclose(mu0, mu1, atol=1e-4)
  else:
    np.testing.assert_allclose(mu0, mu1, atol=1e-6)
    np.testing.assert_allclose(lv0, lv1, atol=1e-6)


def test_text_cls_and_unc_follow_the_caption():
  """[UNC] sits right after the last real token and [CLS] after it: exactly
  the positional rows 0..n+1 influence the output of an n-token caption."""
  cfg = _tiny()
  params = init_params(cfg, jax.random.key(2))
  model = ProLIP(cfg)
  tokens = jnp.array([[5, 6, 7, 0, 0, 0, 0, 0]])
  enc = lambda p: model.apply({'params': p}, tokens, method='encode_text')
  base = enc(params)
  rng = np.random.default_rng(1)
  for row in range(10):
    out = enc(_with_text_param(params, 'positional_embedding', row,
                               rng.normal(size=32)))
    change = max(float(jnp.abs(a - b).max()) for a, b in zip(base, out))
    if row <= 4:  # 3 tokens, [UNC] at 3, [CLS] at 4
      assert change > 1e-3, row
    else:
      assert change == 0.0, row


def test_image_token_drop_keeps_positions():
  cfg = _tiny()
  params = init_params(cfg, jax.random.key(3))
  model = ProLIP(cfg)
  images = jax.random.normal(jax.random.key(4), (2, 16, 16, 3))
  enc = lambda keep: model.apply({'params': params}, images, keep,
                                 method='encode_image')
  full = enc(None)
  n = cfg.num_patches
  # Keeping every patch in any order is the same image: positions travel with
  # the patches and attention ignores token order.
  perm = jnp.stack([jnp.arange(n)[::-1], jnp.roll(jnp.arange(n), 5)])
  for out_full, out_perm in zip(full, enc(perm)):
    np.testing.assert_allclose(out_full, out_perm, atol=1e-5)
  # Dropping patches changes the embedding.
  assert not np.allclose(full[0], enc(jnp.tile(jnp.arange(4), (2, 1)))[0],
                         atol=1e-4)


def test_unc_head_starts_at_minus_ten_and_means_are_unit_norm():
  cfg = _tiny()
  params = init_params(cfg, jax.random.key(5))
  model = ProLIP(cfg)
  images = jax.random.normal(jax.random.key(6), (4, 16, 16, 3))
  tokens = jnp.array([[5, 6, 7, 8, 0, 0, 0, 0]] * 4)
  (mi, li), (mt, lt), (a, b) = model.apply({'params': params}, images, tokens)
  for mu, lv in ((mi, li), (mt, lt)):
    np.testing.assert_allclose(np.linalg.norm(mu, axis=-1), 1.0, rtol=1e-5)
    assert abs(float(jnp.mean(lv)) + 10.0) < 1.0
  np.testing.assert_allclose([a, b], [10.0, -10.0], rtol=1e-6)


def test_deterministic_towers_have_no_logvar():
  cfg = _tiny(use_unc=False)
  params = init_params(cfg, jax.random.key(7))
  assert 'unc_embedding' not in params['visual']
  out = ProLIP(cfg).apply({'params': params}, jnp.zeros((1, 16, 16, 3)),
                          jnp.ones((1, 8), jnp.int32))
  assert out[0][1] is None and out[1][1] is None


def test_text_masking_rate_and_padding():
  tokens = jnp.array(np.random.default_rng(0).integers(4, 50, (64, 32)))
  tokens = tokens.at[:, 20:].set(0)
  masked = mask_text_tokens(jax.random.key(0), tokens, 3, 0, 0.75)
  real = tokens != 0
  assert np.all(masked[~real] == 0)
  rate = float(jnp.mean((masked == 3)[real]))
  assert abs(rate - 0.75) < 0.02  # 1280 Bernoulli draws: sd ~ 0.012
  unchanged = (masked == tokens)[real]
  assert np.all(unchanged | (masked[real] == 3))


def test_keep_indices_are_sorted_unique_and_uniform():
  keep = np.asarray(random_keep_indices(jax.random.key(0), 2000, 16, 0.25))
  assert keep.shape == (2000, 4)
  assert np.all(np.diff(keep, axis=1) > 0)
  freq = np.bincount(keep.ravel(), minlength=16) / keep.size
  np.testing.assert_allclose(freq, 1 / 16, atol=0.01)


def test_config_errors_are_clear():
  with pytest.raises(ValueError, match='unknown model config keys'):
    ModelConfig.from_config({'embed_dimm': 3})
  with pytest.raises(ValueError, match='use_unc=False'):
    ModelConfig.from_config({'text': {'pool': 'argmax'}})
  with pytest.raises(ValueError, match='context_length'):
    cfg = _tiny()
    ProLIP(cfg).init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)),
                     jnp.zeros((1, 9), jnp.int32))


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params_and_tracks_fp32_outputs():
  cfg32 = _tiny()
  cfg16 = _tiny(compute_dtype='bfloat16')
  params = init_params(cfg32, jax.random.key(8))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(
      init_params(cfg16, jax.random.key(8))))
  images = jax.random.normal(jax.random.key(9), (4, 16, 16, 3))
  tokens = jnp.array([[5, 6, 7, 8, 0, 0, 0, 0]] * 4)
  out32 = ProLIP(cfg32).apply({'params': params}, images, tokens)
  out16 = ProLIP(cfg16).apply({'params': params}, images, tokens)
  for a, b in zip(jax.tree.leaves(out32[:2]), jax.tree.leaves(out16[:2])):
    assert b.dtype == jnp.float32  # heads return float32 for the losses
    np.testing.assert_allclose(a, b, atol=0.05, rtol=0.02)
    assert not np.array_equal(a, b)  # bf16 really was used


@pytest.mark.slow
def test_remat_changes_memory_not_values_or_gradients():
  cfg = _tiny()
  params = init_params(cfg, jax.random.key(10))
  images = jax.random.normal(jax.random.key(11), (2, 16, 16, 3))

  def loss(p, remat):
    mu, lv = ProLIP(_tiny(remat=remat)).apply({'params': p}, images,
                                              method='encode_image')
    return jnp.sum(mu * mu[::-1]) + jnp.mean(lv)

  v0, g0 = jax.value_and_grad(loss)(params, False)
  v1, g1 = jax.value_and_grad(loss)(params, True)
  np.testing.assert_allclose(v0, v1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
