"""Train-loop tests: exact resumption, optimizer settings, metrics files."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax.config import presets
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.objectives import prolip as prolip_objective
from prolip_jax.storage import checkpoint
from prolip_jax.training import optimizer
from prolip_jax.training import train

from support import load_config
from support import micro_config
from support import tool


def _params(workdir):
  params, meta = checkpoint.load_params(workdir)
  return jax.tree.map(np.asarray, params), meta


@pytest.mark.slow
def test_resumed_run_matches_uninterrupted_run(tmp_path):
  cfg = micro_config(total_steps=6)
  full = train.train_and_evaluate(cfg, str(tmp_path / 'full'))
  part = train.train_and_evaluate(cfg, str(tmp_path / 'split'), max_steps=3)
  assert part['step'] == 3
  resumed = train.train_and_evaluate(cfg, str(tmp_path / 'split'))
  assert full['step'] == resumed['step'] == 6
  p_full, meta = _params(str(tmp_path / 'full'))
  p_split, _ = _params(str(tmp_path / 'split'))
  assert meta['step'] == 6
  leaves_full = jax.tree.leaves(p_full)
  leaves_split = jax.tree.leaves(p_split)
  assert len(leaves_full) == len(leaves_split)
  for a, b in zip(leaves_full, leaves_split):
    np.testing.assert_array_equal(a, b)
  # And training moved the parameters away from the step-3 checkpoint.
  p3, _ = checkpoint.load_params(str(tmp_path / 'split'), step=3)
  assert not np.allclose(np.asarray(p3['visual']['proj']['kernel']),
                         p_full['visual']['proj']['kernel'])
  # metrics.jsonl: one row per logged step with every loss term.
  rows = [json.loads(l) for l in open(tmp_path / 'full' / 'metrics.jsonl')]
  train_rows = [r for r in rows if 'loss' in r]
  assert [r['step'] for r in train_rows] == list(range(1, 7))
  for key in ('ppcl', 'inclusion_img_txt', 'inclusion_masked_img',
              'inclusion_masked_txt', 'vib_img', 'vib_txt', 'scale', 'bias',
              'sigma2_img', 'sigma2_txt', 'lr', 'samples_per_sec'):
    assert key in train_rows[-1], key
  assert any('eval/zeroshot_csd_top1' in r for r in rows)
  assert os.path.exists(tmp_path / 'full' / 'tensorboard')


def test_weight_decay_mask_exempts_vectors_and_scalars():
  params = {'w': jnp.ones((3, 4)), 'b': jnp.ones(4), 'tok': jnp.ones(8),
            'logit_scale': jnp.ones(()), 'conv': jnp.ones((2, 2, 3, 4))}
  mask = optimizer.weight_decay_mask(params)
  assert mask == {'w': True, 'b': False, 'tok': False, 'logit_scale': False,
                  'conv': True}
  # AdamW with zero gradients: only the masked leaves shrink, by lr * wd.
  cfg = presets.base_config().optim
  cfg.warmup_steps = 0
  tx, schedule = optimizer.make_optimizer(cfg, total_steps=10)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, state, params)
  lr = float(schedule(0))
  for k, decayed in mask.items():
    expected = -lr * cfg.weight_decay if decayed else 0.0
    np.testing.assert_allclose(np.asarray(updates[k]), expected, rtol=1e-6)


def test_unc_lr_mult_scales_only_the_uncertainty_group():
  # The real model's parameter tree: which leaves are the [UNC] group.
  cfg = micro_config(total_steps=4)
  model = ProLIP(ModelConfig.from_config(cfg.model))
  size, length = cfg.model.vision.image_size, cfg.model.text.context_length
  params = jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)),
      jnp.zeros((1, length), jnp.int32)))['params']
  mask = optimizer.uncertainty_mask(params)
  flat = {jax.tree_util.keystr(k): v
          for k, v in jax.tree_util.tree_leaves_with_path(mask)}
  chosen = sorted(k for k, v in flat.items() if v)
  assert chosen == sorted([
      "['text']['text_uncertainty_projection']['bias']",
      "['text']['text_uncertainty_projection']['kernel']",
      "['text']['unc_emb']",
      "['visual']['unc_embedding']",
      "['visual']['uncertainty_proj']['bias']",
      "['visual']['uncertainty_proj']['kernel']"])
  # Same gradients through AdamW with and without the multiplier: the
  # group's updates are exactly 7x (weight decay included), the rest equal.
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.3, s.dtype), params)
  grads = jax.tree.map(lambda p: jnp.full_like(p, -0.01), params)
  optim = presets.base_config().optim
  optim.warmup_steps = 0
  plain, _ = optimizer.make_optimizer(optim, total_steps=10)
  optim.unc_lr_mult = 7.0
  boosted, _ = optimizer.make_optimizer(optim, total_steps=10)
  u_plain, _ = plain.update(grads, plain.init(params), params)
  u_boost, _ = boosted.update(grads, boosted.init(params), params)
  for (path, a), b, m in zip(jax.tree_util.tree_leaves_with_path(u_plain),
                             jax.tree.leaves(u_boost), jax.tree.leaves(mask)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a) * (7.0 if m else 1.0),
                               rtol=1e-6, err_msg=jax.tree_util.keystr(path))
  optim.unc_lr_mult = 0.0
  with pytest.raises(ValueError, match='unc_lr_mult'):
    optimizer.make_optimizer(optim, total_steps=10)


def test_schedule_is_linear_warmup_then_cosine():
  cfg = presets.base_config().optim
  cfg.lr, cfg.warmup_steps, cfg.end_lr_ratio = 1e-3, 10, 0.1
  schedule = optimizer.learning_rate_schedule(cfg, total_steps=110)
  np.testing.assert_allclose(float(schedule(5)), 0.5e-3, rtol=1e-6)
  for step in (10, 40, 110):
    t = (step - 10) / 100
    want = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * t))
    np.testing.assert_allclose(float(schedule(step)), want, rtol=1e-5)


def test_masked_rows_do_not_depend_on_the_number_of_shards():
  x = jnp.arange(32)
  np.testing.assert_array_equal(prolip_objective.strided_rows(x, 8), [0, 8, 16, 24])
  for shards in (1, 2, 4):
    y = np.asarray(prolip_objective.strided_rows_first(x, shards, 8))
    assert sorted(y) == list(range(32))  # a permutation
    per_shard = y.reshape(shards, -1)
    n_local = 32 // shards // 8
    # Each shard starts with its strided rows, in the global order.
    np.testing.assert_array_equal(per_shard[:, :n_local].ravel(),
                                  [0, 8, 16, 24])
  assert prolip_objective.masking_stride(0.125) == 8 and prolip_objective.masking_stride(0) == 0
  with pytest.raises(ValueError, match='1/k'):
    prolip_objective.masking_stride(0.3)


@pytest.mark.slow
def test_logit_scale_is_clamped_after_the_update(tmp_path):
  cfg = micro_config(total_steps=2)
  cfg.model.init_logit_scale = 200.0  # above the clamp of 100
  train.train_and_evaluate(cfg, str(tmp_path))
  params, _ = _params(str(tmp_path))
  assert float(params['logit_scale']) <= math.log(100.0) + 1e-6


@pytest.mark.slow
def test_export_import_and_finetune_round_trip(tmp_path):
  """Train -> export (safetensors) -> load() the export -> import into a new
  workdir -> fine-tune from it with a fresh optimizer."""
  import prolip_jax  # pylint: disable=g-import-not-at-top
  cfg = micro_config(total_steps=3)
  src, out, dst = (str(tmp_path / n) for n in ('src', 'export', 'dst'))
  train.train_and_evaluate(cfg, src)
  tool('export_pytorch').export(src, out)

  captions = ['seven', 'a thick seven written on the left side']
  from_workdir = prolip_jax.load(src).encode_text(captions)
  from_export = prolip_jax.load(out).encode_text(captions)
  for a, b in zip(from_workdir, from_export):
    np.testing.assert_array_equal(a, b)

  tool('import_pytorch').import_weights(
      os.path.join(out, 'model.safetensors'), cfg, dst,
      tokenizer=os.path.join(out, 'tokenizer.model'))
  imported, meta = checkpoint.load_params(dst, step=0)
  assert meta['has_opt_state'] is False
  trained, _ = _params(src)
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(imported)):
    np.testing.assert_array_equal(a, np.asarray(b))
  summary = train.train_and_evaluate(micro_config(total_steps=2), dst)
  assert summary['step'] == 2
  tuned, _ = _params(dst)
  assert not np.array_equal(tuned['visual']['proj']['kernel'],
                            trained['visual']['proj']['kernel'])


def _digit_shards(directory, n_good=48, corrupt_every=4):
  """Two array_record shards of bundled digits; ``dirty`` has truncated JPEGs."""
  import io  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import digits, record_format  # pylint: disable=g-import-not-at-top
  images, labels = digits.split('train')
  caps = digits.captions_for(images[:2 * n_good], labels[:2 * n_good])

  def jpeg(i):
    buf = io.BytesIO()
    Image.fromarray(images[i]).convert('RGB').save(buf, 'JPEG')
    return buf.getvalue()

  for name, offset in (('clean', 0), ('dirty', n_good)):
    w = record_format.ShardWriter(
        os.path.join(directory, name + '.array_record'))
    for i in range(offset, offset + n_good):
      data = jpeg(i)
      if name == 'dirty' and i % corrupt_every == 0:
        data = data[:len(data) // 3]
      w.write(record_format.serialize_example(data, caps[i][-1],
                                              f'{name}{i}'))
    w.close()
  return os.path.join(directory, '*.array_record')


@pytest.mark.slow
def test_array_record_training_counts_and_stops_on_bad_records(tmp_path):
  from prolip_jax.data import bad_records  # pylint: disable=g-import-not-at-top
  os.makedirs(tmp_path / 'shards')
  pattern = _digit_shards(str(tmp_path / 'shards'))
  cfg = micro_config(total_steps=2)
  cfg.data.name = 'array_record'
  cfg.data.path = pattern
  cfg.data.bad_record_warmup = 0
  cfg.data.max_bad_fraction = 0.5
  train.train_and_evaluate(cfg, str(tmp_path / 'ok'))
  rows = [json.loads(l) for l in open(tmp_path / 'ok' / 'metrics.jsonl')]
  last = [r for r in rows if 'data/records_seen' in r][-1]
  assert last['data/records_seen'] >= 32  # two steps of 16
  assert 0 < last['data/bad_records'] < last['data/records_seen']
  # 12 of 96 records are corrupt: 1% is far too many; the error names the
  # shard, and the run's progress so far is checkpointed.
  cfg.data.max_bad_fraction = 0.01
  with pytest.raises(bad_records.BadRecordError, match='dirty.array_record'):
    train.train_and_evaluate(cfg, str(tmp_path / 'stop'))
  assert checkpoint.latest_step(str(tmp_path / 'stop')) in (0, 1)


@pytest.mark.slow
def test_colour_on_device_plumbing_gives_the_host_run(tmp_path):
  """`data.color_on_device` sends the jitter order with the batch and the
  train step applies it; with nothing to apply (no jitter, no grayscale) the
  run must be the host run up to float rounding of the identity ops."""
  runs = {}
  for on_device in (False, True):
    cfg = micro_config(total_steps=3)
    cfg.data.jitter_prob = 0.0
    cfg.data.grayscale_prob = 0.0
    cfg.data.color_on_device = on_device
    train.train_and_evaluate(cfg, str(tmp_path / str(on_device)))
    runs[on_device], _ = _params(str(tmp_path / str(on_device)))
  host, dev = (jax.tree.leaves(runs[k]) for k in (False, True))
  for a, b in zip(host, dev):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  # And the batch really carried the order (the device path ran).
  from prolip_jax.data import pipeline, sources  # pylint: disable=g-import-not-at-top
  cfg = micro_config()
  cfg.data.color_on_device = True
  source, _ = sources.train_source(cfg)
  element = pipeline.TrainTransform(
      lambda text: np.zeros((1, 16), np.int32), 32,
      train.augment_config(cfg.data)).random_map(
          source[0], np.random.default_rng(0))
  assert element['color_order'].shape == (4,)
  assert sorted(element['color_order'].tolist()) == [0, 1, 2, 3]


def test_b16_keeps_the_paper_recipe_and_tiny_demos_the_short_run_knobs():
  # Paper B.1 weights for B/16; the CPU demos' opt-in knobs
  # (docs/small_scale_uncertainty.md) only in the two tiny ProLIP configs.
  b16 = load_config('prolip_b16')
  assert (b16.optim.unc_lr_mult, b16.loss.beta, b16.loss.alpha1,
          b16.loss.alpha2, b16.model.init_unc_bias) == (1.0, 1e-4, 1e-7,
                                                        1e-3, -10.0)
  for name, beta in (('prolip_tiny', 0.1), ('prolip_emoji', 0.3)):
    c = load_config(name)
    assert (c.optim.unc_lr_mult, c.loss.beta, c.loss.alpha1) == (10.0, beta,
                                                                  1e-3), name
  for name in ('siglip_tiny', 'siglip_emoji', 'pcme_tiny', 'prolip_micro'):
    assert load_config(name).optim.unc_lr_mult == 1.0, name
