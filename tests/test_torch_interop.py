"""PyTorch interoperability: conversion, the torch reference, open_clip, tools.

Skipped without torch (``pip install -e .[torch]``).
"""

import dataclasses
import functools
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if importlib.util.find_spec('torch') is None:
  pytest.skip('torch is not installed (pip install -e .[torch])',
              allow_module_level=True)


class _Torch:
  """``torch``, imported when a test first uses it: every pytest process
  and xdist worker collects this module, and importing PyTorch there cost
  each of them 2.2 s (2026-12-07, this 2-core VM)."""

  def __getattr__(self, name):
    if name.startswith('__'):  # what pytest's collectors ask of any object
      raise AttributeError(name)
    return getattr(importlib.import_module('torch'), name)


torch = _Torch()

# pylint: disable=g-import-not-at-top,wrong-import-position
from safetensors.numpy import save_file

from prolip_jax.interop import convert
from prolip_jax.interop import torch_reference
from prolip_jax.models import init_params
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.models import TextConfig
from prolip_jax.models import VisionConfig
from prolip_jax.storage import checkpoint
# pylint: enable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4

TINY = ModelConfig(
    embed_dim=32,
    vision=VisionConfig(image_size=32, patch_size=8, width=64, layers=2,
                        heads=4),
    text=TextConfig(vocab_size=100, context_length=16, width=48, layers=2,
                    heads=4, pad_id=1))
TINY_VARIANTS = {
    'paper': TINY,
    'release': dataclasses.replace(TINY, release_compat=True),
    'no_unc': dataclasses.replace(TINY, use_unc=False),
    'no_unc_release': dataclasses.replace(TINY, use_unc=False,
                                          release_compat=True),
    'clip_argmax': dataclasses.replace(
        TINY, use_unc=False,
        vision=dataclasses.replace(TINY.vision, act='quick_gelu'),
        text=dataclasses.replace(TINY.text, pool='argmax', causal=True,
                                 proj_bias=False, ln_eps=1e-5, pad_id=0,
                                 act='quick_gelu')),
    'gelu_tanh_causal': dataclasses.replace(
        TINY, vision=dataclasses.replace(TINY.vision, act='gelu_tanh'),
        text=dataclasses.replace(TINY.text, act='gelu_tanh', causal=True)),
}
# B/16 shapes (224px, patch 16, width 768, 12 heads, context 64, vocabulary
# 32,100), two layers per tower.
B16_2L = ModelConfig(vision=VisionConfig(layers=2),
                     text=TextConfig(layers=2, pad_id=1))


def _load_module(relpath, name):
  spec = importlib.util.spec_from_file_location(name,
                                                os.path.join(ROOT, relpath))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@functools.lru_cache(maxsize=None)
def _random_params(cfg, seed=0):
  """Random parameters of ``cfg`` (numpy, no init compile: fast on CPU).

  Every leaf, biases and LayerNorms included, is away from its init pattern
  so that a wrong transpose or swap cannot go unnoticed.
  """
  abstract = jax.eval_shape(lambda r: init_params(cfg, r),
                            jax.random.PRNGKey(0))
  rng = np.random.default_rng(seed)
  flat = {}
  for path, leaf in convert.flatten(abstract).items():
    noise = rng.standard_normal(leaf.shape, np.float32)
    name = path[-1]
    if name == 'kernel':
      value = noise * math.prod(leaf.shape[:-1])**-0.5
    elif name == 'scale':
      value = 1 + 0.1 * noise
    elif name == 'bias' and 'uncertainty' in path[-2]:
      value = -10 + 0.1 * noise
    elif path == ('logit_scale',):
      value = np.float32(math.log(10.0))
    else:
      value = 0.1 * noise
    flat[path] = np.asarray(value, np.float32)
  return convert.unflatten(flat)


def _inputs(cfg, n_images=2, seed=0):
  """NHWC images; tokens right-padded to several lengths (one full row)."""
  rng = np.random.default_rng(seed)
  size, length = cfg.vision.image_size, cfg.text.context_length
  images = rng.normal(size=(n_images, size, size, 3)).astype(np.float32)
  lengths = [1, 4, length // 2, length]
  tokens = np.full((len(lengths), length), cfg.text.pad_id, np.int64)
  for i, n in enumerate(lengths):
    ids = rng.integers(2, cfg.text.vocab_size, size=n)
    if cfg.text.pool == 'argmax':  # an end-of-text token with the largest id
      ids[-1] = cfg.text.vocab_size - 1
      ids[:-1] = np.minimum(ids[:-1], cfg.text.vocab_size - 2)
    tokens[i, :n] = ids
  return images, tokens


def _jax_encode(cfg, params, images, tokens):
  model = ProLIP(cfg)

  @jax.jit
  def run(p, i, t):
    return (model.apply({'params': p}, i, method='encode_image'),
            model.apply({'params': p}, t, method='encode_text'))

  return jax.tree.map(np.asarray, run(params, jnp.asarray(images),
                                      jnp.asarray(tokens, jnp.int32)))


def _torch_encode(model, images, tokens):
  with torch.no_grad():
    img = model.encode_image(torch.from_numpy(images).permute(0, 3, 1, 2))
    txt = model.encode_text(torch.from_numpy(tokens))
  to_np = lambda x: None if x is None else x.numpy()
  return ((to_np(img[0]), to_np(img[1])), (to_np(txt[0]), to_np(txt[1])))


def _assert_close(jax_out, torch_out, use_unc):
  for (j_mu, j_lv), (t_mu, t_lv) in zip(jax_out, torch_out):
    np.testing.assert_allclose(t_mu, j_mu, atol=TOL, rtol=0)
    if use_unc:
      np.testing.assert_allclose(t_lv, j_lv, atol=TOL, rtol=0)
    else:
      assert j_lv is None and t_lv is None


def _tree_equal(a, b):
  fa, fb = convert.flatten(a), convert.flatten(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    x, y = np.asarray(fa[k]), np.asarray(fb[k])
    assert x.shape == y.shape and x.dtype == y.dtype, k
    assert np.array_equal(x, y), k


# ----------------------------------------------------------------------------
# Conversion


@pytest.mark.slow
def test_import_prolip_jax_is_torch_free():
  code = ('import sys, prolip_jax, prolip_jax.interop.convert, '
          'prolip_jax.interop.torch_reference; '
          'assert "torch" not in sys.modules and "jax" not in sys.modules, '
          'sorted(m for m in sys.modules if m in ("torch", "jax"))')
  subprocess.run([sys.executable, '-c', code], check=True, cwd=ROOT)


def test_convert_defaults_mirror_model_dataclasses():
  assert convert.model_dict({}) == ModelConfig().to_dict()
  assert convert.model_dict(B16_2L.to_dict()) == B16_2L.to_dict()


@pytest.mark.parametrize('name', sorted(TINY_VARIANTS))
def test_round_trip_is_bit_exact(name, tmp_path):
  cfg = TINY_VARIANTS[name]
  params = _random_params(cfg)
  sd = convert.params_to_state_dict(params, cfg)
  assert list(sd) == convert.state_dict_keys(cfg)
  assert all(v.flags.c_contiguous for v in sd.values())
  # Through a safetensors file, as the tools do.
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  save_file(sd, str(tmp_path / 'm.safetensors'))
  back, report = convert.state_dict_to_params(
      load_file(str(tmp_path / 'm.safetensors')), cfg)
  _tree_equal(params, back)
  assert not (report.created or report.dropped or report.reshaped
              or report.cast)
  assert report.converted == len(sd)
  assert report.source_layout == ('clip' if name == 'clip_argmax'
                                  else 'custom')


def test_key_layouts():
  keys = convert.state_dict_keys(B16_2L)
  assert 'visual.unc_embedding' in keys and 'text.unc_emb' in keys
  assert 'text.text_projection.weight' in keys
  assert 'text.text_uncertainty_projection.bias' in keys
  clip = convert.state_dict_keys(TINY_VARIANTS['clip_argmax'])
  assert 'token_embedding.weight' in clip and 'text_projection' in clip
  assert 'ln_final.weight' in clip
  assert not any(k.startswith('text.') for k in clip)
  # Either layout can be asked for explicitly.
  custom = convert.state_dict_keys(TINY_VARIANTS['clip_argmax'], 'custom')
  assert 'text.text_projection' in custom


def test_wrong_architecture_lists_every_offending_key():
  sd = convert.params_to_state_dict(_random_params(TINY), TINY)
  other = dataclasses.replace(
      TINY, vision=dataclasses.replace(TINY.vision, layers=3),
      text=dataclasses.replace(TINY.text, width=64))
  with pytest.raises(ValueError) as e:
    convert.state_dict_to_params(sd, other)
  msg = str(e.value)
  assert 'visual.transformer.resblocks.2.ln_1.weight: missing' in msg
  assert ('text.token_embedding.weight: expected (100, 64), found (100, 48)'
          in msg)
  assert 'text.ln_final.weight: expected (64,), found (48,)' in msg


def test_missing_and_unexpected_keys_in_one_error():
  sd = convert.params_to_state_dict(_random_params(TINY), TINY)
  del sd['visual.ln_pre.weight']
  sd['visual.bogus'] = np.zeros((3,), np.float32)
  sd['text.transformer.resblocks.0.attn.in_proj_bias'] = np.zeros(
      (5,), np.float32)
  with pytest.raises(ValueError) as e:
    convert.state_dict_to_params(sd, TINY)
  msg = str(e.value)
  assert '3 offending keys' in msg
  assert 'visual.ln_pre.weight: missing (expected (64,))' in msg
  assert 'visual.bogus: unexpected key (3,)' in msg
  assert ('text.transformer.resblocks.0.attn.in_proj_bias: expected (144,), '
          'found (5,)') in msg


@pytest.mark.slow
def test_clip_source_into_prolip_creates_and_reshapes():
  src_cfg = TINY_VARIANTS['clip_argmax']
  tgt_cfg = dataclasses.replace(
      TINY, text=dataclasses.replace(src_cfg.text, pool='cls', causal=False,
                                     proj_bias=True))
  src = _random_params(src_cfg)
  sd = convert.params_to_state_dict(src, src_cfg)
  del sd['logit_bias']  # as in open_clip's CLIP
  params, report = convert.state_dict_to_params(sd, tgt_cfg,
                                                 jax.random.PRNGKey(7))
  init = init_params(tgt_cfg, jax.random.PRNGKey(7))
  created = {c.split(' ')[0] for c in report.created}
  assert created == {
      'visual.unc_embedding', 'visual.uncertainty_proj.weight',
      'visual.uncertainty_proj.bias', 'text.cls_emb', 'text.unc_emb',
      'text.text_projection.bias', 'text.text_uncertainty_projection.weight',
      'text.text_uncertainty_projection.bias', 'logit_bias'}
  assert [r.split(':')[0] for r in report.reshaped] == [
      'visual.positional_embedding', 'text.positional_embedding']
  np.testing.assert_array_equal(params['visual']['uncertainty_proj']['bias'],
                                np.full(32, -10.0, np.float32))
  np.testing.assert_array_equal(params['logit_bias'], init['logit_bias'])
  np.testing.assert_array_equal(params['text']['cls_emb'],
                                init['text']['cls_emb'])
  # Kept rows stay, new rows come from init: [CLS], [UNC] first for images.
  vpos, ipos = params['visual']['positional_embedding'], init['visual'][
      'positional_embedding']
  spos = src['visual']['positional_embedding']
  np.testing.assert_array_equal(vpos[0], spos[0])
  np.testing.assert_array_equal(vpos[1], ipos[1])
  np.testing.assert_array_equal(vpos[2:], spos[1:])
  tpos = params['text']['positional_embedding']
  np.testing.assert_array_equal(tpos[:16], src['text']['positional_embedding'])
  np.testing.assert_array_equal(tpos[16:],
                                init['text']['positional_embedding'][16:])
  np.testing.assert_array_equal(params['text']['text_projection']['kernel'],
                                src['text']['text_projection']['kernel'])

  # And back: the [UNC]/[CLS] parts are dropped, the rest is unchanged.
  sd2 = convert.params_to_state_dict(params, tgt_cfg)
  sd2['text.text_projection.bias'] = np.zeros(32, np.float32)
  back, report2 = convert.state_dict_to_params(sd2, src_cfg)
  assert len(report2.dropped) == 8 and len(report2.reshaped) == 2
  _tree_equal(dict(src, logit_bias=params['logit_bias']), back)


def test_nonzero_bias_is_not_dropped():
  src_cfg = TINY_VARIANTS['no_unc']
  tgt_cfg = dataclasses.replace(
      src_cfg, text=dataclasses.replace(src_cfg.text, proj_bias=False))
  sd = convert.params_to_state_dict(_random_params(src_cfg), src_cfg)
  with pytest.raises(ValueError, match='text.text_projection.bias: '
                     'unexpected nonzero bias'):
    convert.state_dict_to_params(sd, tgt_cfg)


# ----------------------------------------------------------------------------
# config.json


def test_config_json_schema_and_inverse():
  cj = convert.config_json(B16_2L, {'tokenizer_file': 'tokenizer.model',
                                    'mask_id': 3})
  json.dumps(cj)  # serialisable
  assert cj['embed_dim'] == 768 and cj['init_logit_bias'] == -10.0
  assert math.isclose(cj['init_logit_scale'], math.log(10.0))
  assert cj['vision_cfg'] == {
      'image_size': 224, 'layers': 2, 'width': 768, 'head_width': 64,
      'patch_size': 16, 'mlp_ratio': 4.0, 'embed_unc': True,
      'init_unc_bias': -10.0}
  tc = cj['text_cfg']
  assert tc['context_length'] == 64 and tc['vocab_size'] == 32100
  assert tc['hf_tokenizer_name'] == convert.SIGLIP_HF_TOKENIZER
  assert (tc['width'], tc['heads'], tc['layers']) == (768, 12, 2)
  assert tc['no_causal_mask'] and tc['proj_bias'] and tc['embed_cls']
  assert tc['embed_unc'] and tc['norm_kwargs'] == {'eps': 1e-6}
  assert tc['init_unc_bias'] == -10.0 and tc['pad_id'] == 1
  project = cj['prolip_jax']
  assert project['model'] == B16_2L.to_dict()
  assert project['tokenizer_file'] == 'tokenizer.model'
  assert project['mask_id'] == 3 and project['release_compat'] is False
  for cfg in list(TINY_VARIANTS.values()) + [B16_2L]:
    assert convert.model_config_from_json(convert.config_json(cfg)) == cfg

  # Without the project's key (release / hub files) the schema is enough.
  hub = convert.hub_config(cj)
  assert 'prolip_jax' not in hub
  rebuilt = convert.model_config_from_json(hub)
  assert math.isclose(rebuilt.init_logit_scale, 10.0)
  assert dataclasses.replace(rebuilt, init_logit_scale=10.0) == \
      dataclasses.replace(B16_2L, release_compat=True)
  for name in ('release', 'no_unc_release', 'clip_argmax', 'gelu_tanh_causal'):
    cfg = TINY_VARIANTS[name]
    got = convert.model_config_from_json(convert.hub_config(
        convert.config_json(cfg)))
    want = cfg if name != 'gelu_tanh_causal' else dataclasses.replace(
        cfg, release_compat=True)
    assert dataclasses.replace(got, init_logit_scale=want.init_logit_scale) \
        == want, name
    assert math.isclose(got.init_logit_scale, want.init_logit_scale)


# ----------------------------------------------------------------------------
# Parity with the PyTorch reference


@pytest.mark.parametrize('name', sorted(TINY_VARIANTS))
def test_parity_tiny(name):
  cfg = TINY_VARIANTS[name]
  params = _random_params(cfg, seed=1)
  model = torch_reference.build(cfg)
  torch_reference.load_state_dict(model,
                                  convert.params_to_state_dict(params, cfg))
  images, tokens = _inputs(cfg, seed=1)
  _assert_close(_jax_encode(cfg, params, images, tokens),
                _torch_encode(model.eval(), images, tokens), cfg.use_unc)


@pytest.mark.slow  # B/16 widths: a real-size compile
@pytest.mark.parametrize('release_compat', [False, True],
                         ids=['paper', 'release'])
def test_parity_b16_two_layers(release_compat):
  cfg = dataclasses.replace(B16_2L, release_compat=release_compat)
  params = _random_params(cfg, seed=2)
  model = torch_reference.build(cfg)
  torch_reference.load_state_dict(model,
                                  convert.params_to_state_dict(params, cfg))
  images, tokens = _inputs(cfg, seed=2)
  j = _jax_encode(cfg, params, images, tokens)
  _assert_close(j, _torch_encode(model.eval(), images, tokens), True)
  # The two modes differ (padding, [UNC]/[CLS] placement, double ln_post).
  other = _jax_encode(dataclasses.replace(cfg, release_compat=not
                                          release_compat), params, images,
                      tokens) if not release_compat else None
  if other is not None:
    assert np.abs(other[0][0] - j[0][0]).max() > 1e-3
    assert np.abs(other[1][0][:3] - j[1][0][:3]).max() > 1e-3


# ----------------------------------------------------------------------------
# A real client: open_clip


@pytest.fixture(scope='module')
def clip_config():
  return _load_module('configs/clip_b16_openclip.py', 'clip_b16_openclip')


@pytest.mark.slow
def test_open_clip_vit_b16(clip_config):
  open_clip = pytest.importorskip('open_clip')
  torch.manual_seed(0)
  oc = open_clip.create_model('ViT-B-16', pretrained=None).eval()
  with torch.no_grad():  # move every tensor off its init pattern
    for p in oc.parameters():
      p.add_(0.02 * torch.randn_like(p))
  sd = oc.state_dict()
  cfg = ModelConfig.from_config(clip_config.get_config().model)
  params, report = convert.state_dict_to_params(sd, cfg)
  assert report.source_layout == 'clip'
  assert report.created == ['logit_bias ()'] and not report.dropped
  assert not report.reshaped and not report.cast

  images = torch.randn(2, 3, 224, 224)
  tokens = open_clip.tokenize(['a photo of a cat', 'a diagram',
                               'an extremely long caption ' * 20])
  with torch.no_grad():
    want_img = oc.encode_image(images, normalize=True).numpy()
    want_txt = oc.encode_text(tokens, normalize=True).numpy()
  (mu_img, lv_img), (mu_txt, lv_txt) = _jax_encode(
      cfg, params, images.permute(0, 2, 3, 1).numpy(), tokens.numpy())
  assert lv_img is None and lv_txt is None
  np.testing.assert_allclose(mu_img, want_img, atol=TOL, rtol=0)
  np.testing.assert_allclose(mu_txt, want_txt, atol=TOL, rtol=0)

  # Export goes back to exactly open_clip's tensors.
  back = convert.params_to_state_dict(params, cfg)
  del back['logit_bias']
  assert back.keys() == sd.keys()
  for k, v in sd.items():
    assert np.array_equal(back[k], v.numpy()), k


# ----------------------------------------------------------------------------
# Tools


@pytest.fixture(scope='module')
def import_tool():
  return _load_module('tools/import_pytorch.py', 'import_pytorch')


@pytest.fixture(scope='module')
def export_tool():
  return _load_module('tools/export_pytorch.py', 'export_pytorch')


def _write_config(tmp_path, cfg):
  path = tmp_path / 'cfg.py'
  path.write_text(
      'import ml_collections\nfrom prolip_jax.config import presets\n\n'
      'def get_config():\n  c = presets.base_config()\n'
      f'  c.model = ml_collections.ConfigDict({cfg.to_dict()!r})\n'
      '  return c\n')
  return str(path)


def _config(tmp_path, cfg):
  return _load_module(_write_config(tmp_path, cfg), 'cfg').get_config()


@pytest.mark.slow
def test_export_then_reference_load(tmp_path, export_tool):
  cfg = TINY_VARIANTS['release']
  params = _random_params(cfg, seed=3)
  workdir = tmp_path / 'wd'
  run_cfg = {'data': {'mean': [0.5, 0.5, 0.5], 'std': [0.25, 0.25, 0.25]},
             'tokenizer': {'mask_id': 5}}
  with checkpoint.manager(str(workdir)) as mngr:
    checkpoint.save(mngr, 7, params, {'count': np.zeros((), np.int32)},
                    {'step': 7, 'config': run_cfg, 'model': cfg.to_dict()})
    mngr.wait_until_finished()
  (workdir / 'tokenizer.model').write_bytes(b'spm')
  out = tmp_path / 'out'
  cj = export_tool.export(str(workdir), str(out))
  assert sorted(os.listdir(out)) == ['config.json', 'model.safetensors',
                                     'prolip_jax_manifest.json',
                                     'tokenizer.model']
  assert cj['prolip_jax']['step'] == 7 and cj['prolip_jax']['mask_id'] == 5
  assert cj['prolip_jax']['tokenizer_file'] == 'tokenizer.model'
  assert cj['prolip_jax']['mean'] == [0.5, 0.5, 0.5]
  assert json.loads((out / 'config.json').read_text()) == cj

  model = torch_reference.load(str(out))
  images, tokens = _inputs(cfg, seed=3)
  _assert_close(_jax_encode(cfg, params, images, tokens),
                _torch_encode(model, images, tokens), True)

  # The hub-compatible variant: plain release schema, same weights.
  hub = tmp_path / 'hub'
  cj = export_tool.export(str(workdir), str(hub), step=7, hub_compatible=True)
  assert 'prolip_jax' not in cj
  model = torch_reference.load(str(hub))
  _assert_close(_jax_encode(cfg, params, images, tokens),
                _torch_encode(model, images, tokens), True)


@pytest.mark.slow
def test_import_tool_cli(tmp_path):
  """Command line: safetensors + config + override -> step-0 checkpoint."""
  cfg = TINY
  params = _random_params(cfg, seed=4)
  src = tmp_path / 'model.safetensors'
  save_file(convert.params_to_state_dict(params, cfg), str(src))
  workdir = tmp_path / 'wd'
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'tools', 'import_pytorch.py'),
       f'--src={src}', f'--config={_write_config(tmp_path, cfg)}',
       f'--workdir={workdir}', '--config.model.init_logit_bias=-5.0'],
      capture_output=True, text=True, cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr
  assert 'converted 71 tensors' in proc.stdout
  loaded, meta = checkpoint.load_params(str(workdir))
  _tree_equal(params, jax.tree.map(np.asarray, loaded))
  want = dataclasses.replace(cfg, init_logit_bias=-5.0)
  assert ModelConfig.from_config(meta['model']) == want
  assert meta['step'] == 0 and meta['has_opt_state'] is False
  assert meta['config']['model']['init_logit_bias'] == -5.0
  with checkpoint.manager(str(workdir), read_only=True) as mngr:
    assert 'opt_state' not in mngr.item_metadata(0)

  # Failure on the command line: exit status 2, one line, nothing written.
  bad = tmp_path / 'bad.safetensors'
  bad.write_bytes(src.read_bytes()[:1000])
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'tools', 'import_pytorch.py'),
       f'--src={bad}', f'--config={_write_config(tmp_path, cfg)}',
       f'--workdir={tmp_path / "wd2"}'],
      capture_output=True, text=True, cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.startswith('error: ') and proc.stderr.count('\n') == 1
  assert 'cannot read safetensors file' in proc.stderr
  assert 'nothing was written' in proc.stderr
  assert not (tmp_path / 'wd2').exists()


def test_import_tool_torch_files_and_prefix(tmp_path, import_tool):
  cfg = TINY_VARIANTS['no_unc']
  params = _random_params(cfg, seed=5)
  sd = {f'module.{k}': torch.from_numpy(v.copy()) for k, v in
        convert.params_to_state_dict(params, cfg).items()}
  src = tmp_path / 'epoch_1.pt'
  torch.save({'epoch': 1, 'state_dict': sd}, str(src))
  report = import_tool.import_weights(str(src), _config(tmp_path, cfg),
                                      str(tmp_path / 'wd'))
  assert report.converted == len(sd)
  loaded, _ = checkpoint.load_params(str(tmp_path / 'wd'))
  _tree_equal(params, jax.tree.map(np.asarray, loaded))
  # An existing checkpoint is never overwritten.
  with pytest.raises(import_tool.ImportFailed, match='already has checkpoints'):
    import_tool.import_weights(str(src), _config(tmp_path, cfg),
                               str(tmp_path / 'wd'))


@pytest.mark.parametrize('case', ['truncated', 'architecture', 'keys',
                                  'not_a_file', 'pickle'])
def test_import_tool_errors_write_nothing(case, tmp_path, import_tool):
  cfg = TINY
  sd = convert.params_to_state_dict(_random_params(cfg, seed=6), cfg)
  target = cfg
  src = tmp_path / 'model.safetensors'
  if case == 'truncated':
    save_file(sd, str(src))
    src.write_bytes(src.read_bytes()[:-100])
    match = 'cannot read safetensors file'
  elif case == 'architecture':
    save_file(sd, str(src))
    target = dataclasses.replace(
        cfg, vision=dataclasses.replace(cfg.vision, width=32))
    match = 'visual.conv1.weight: expected \\(32, 3, 8, 8\\), found'
  elif case == 'keys':
    sd['extra.thing'] = np.ones(2, np.float32)
    del sd['text.unc_emb'], sd['visual.ln_post.bias']
    save_file(sd, str(src))
    match = ('(?s)3 offending keys.*visual.ln_post.bias: missing.*'
             'text.unc_emb: missing.*the source has.*'
             'extra.thing: unexpected key')
  elif case == 'not_a_file':
    src = tmp_path / 'nothing.safetensors'
    match = 'no such file'
  else:
    src = tmp_path / 'model.pt'
    torch.save({'a': [1, 2]}, str(src))
    match = 'does not hold a state dict of tensors'
  workdir = tmp_path / 'wd'
  with pytest.raises(import_tool.ImportFailed, match=match):
    import_tool.import_weights(str(src), _config(tmp_path, target),
                               str(workdir))
  assert not workdir.exists()


@pytest.mark.slow
def test_readme_pytorch_snippet_runs_on_an_export(tmp_path, monkeypatch,
                                                  capsys):
  """The copy-paste PyTorch snippet of docs/interop.md, run verbatim on a fresh export,
  gives the JAX model's embeddings."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  import prolip_jax  # pylint: disable=g-import-not-at-top
  from prolip_jax.training import train  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      'prolip_micro', os.path.join(repo, 'configs', 'prolip_micro.py'))
  cfg_mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cfg_mod)
  cfg = cfg_mod.get_config()
  cfg.total_steps = 2
  cfg.mesh.num_devices = 1
  workdir = str(tmp_path / 'workdirs' / 'prolip_tiny')
  train.train_and_evaluate(cfg, workdir)
  export_spec = importlib.util.spec_from_file_location(
      'export_pytorch', os.path.join(repo, 'tools', 'export_pytorch.py'))
  export_mod = importlib.util.module_from_spec(export_spec)
  export_spec.loader.exec_module(export_mod)
  export_mod.export(workdir, os.path.join(workdir, 'export'))

  readme = open(os.path.join(repo, 'docs', 'interop.md')).read()
  snippet = readme.split('Then, in PyTorch')[1].split('```python')[1]
  snippet = snippet.split('```')[0]
  monkeypatch.chdir(tmp_path)
  scope = {}
  exec(snippet, scope)  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  assert 'PyTorch: CSD(image, text) = ' in printed
  assert 'max |PyTorch - JAX|: image mu' in printed
  # Independently of the snippet's own comparison: the workdir in JAX.
  loaded = prolip_jax.load(workdir)
  mu_txt, logvar_txt = loaded.encode_text(['a thick seven'])
  np.testing.assert_allclose(scope['mu_txt'].numpy(), mu_txt, atol=1e-4)
  np.testing.assert_allclose(scope['logvar_txt'].numpy(), logvar_txt,
                             atol=1e-4)
  digit = digits.split('heldout')[0][0]
  mu_img, _ = loaded.encode_image([np.asarray(
      Image.fromarray(digit).convert('RGB').resize(
          (cfg.model.vision.image_size,) * 2, Image.BICUBIC))])
  np.testing.assert_allclose(scope['mu_img'].numpy(), mu_img, atol=1e-4)
  assert np.isfinite(float(scope['csd']))
