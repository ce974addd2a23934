"""UniCLIP as a training objective (configs/uniclip_tiny.py).

Numbers, not shapes: a micro run lowers the MP-NCE loss and separates the
positives (other views of a picture, the picture and its caption) from the
negatives on held-out digits; the sharded loss and gradients equal the dense
ones; the pipeline gives V different, reproducible views; bad configs fail
with a clear error.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import prolip_jax
from prolip_jax import embedding
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax import demos
from prolip_jax.data import digits
from prolip_jax.data import pipeline
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import train_tokenizer
from prolip_jax.interop import load as load_lib
from prolip_jax.losses import uniclip as uniclip_loss
from prolip_jax.models import ProLIP
from prolip_jax.objectives import uniclip as uniclip_train
from prolip_jax.storage import checkpoint
from prolip_jax.training import optimizer
from prolip_jax.training import train

from support import load_config
from support import tool


def micro(total_steps, batch_size=16):
  """``prolip_micro`` towers with the UniCLIP demo settings, smaller heads."""
  c = load_config('prolip_micro')
  demo = load_config('uniclip_tiny')
  c.objective = 'uniclip'
  c.model.use_unc = False
  c.data = demo.data
  c.data.num_threads = 1
  c.loss = demo.loss
  c.uniclip = demo.uniclip
  c.uniclip.aug_features = 16
  c.uniclip.aug_hidden = 16
  c.total_steps = total_steps
  c.batch_size = batch_size
  c.optim.lr = 2e-3
  c.optim.warmup_steps = 2
  c.mesh.num_devices = 1
  c.mesh.data = 1
  c.mesh.fsdp = 1
  c.checkpoint_every_steps = 1000
  c.log_every_steps = 1
  return c


def _heldout_batch(tokenizer, image_size, n=40, num_views=3, seed=123):
  """A batch of held-out digits (never trained on) with 3 views each."""
  source = digits.records('heldout')
  config = load_config('uniclip_tiny')
  ds = pipeline.train_dataset(
      source, tokenizer=tokenizer, image_size=image_size,
      global_batch_size=n, seed=seed,
      augment=train.augment_config(config.data), num_views=num_views)
  return ds[0]


def _mean_scores(z_views: np.ndarray, z_txt: np.ndarray, temperatures,
                 offsets) -> dict[str, float]:
  """Diagnostics of eq. 16's log-scores on one batch.

  For every anchor: its mean log-score to its positives (other views of its
  image, and image <-> caption) and to its negatives, per domain pair.
  Returns ``{'pos_ii', 'neg_ii', 'pos_it', 'neg_it', 'above_ii',
  'above_it', 'margin_min', 'margin_mean'}``: the margins are (positive - the
  anchor's mean negative of the same domain pair) over all positive pairs
  i != j, smallest and mean, ``above_*`` the fraction of them above zero;
  training drives them up.
  """
  z_views = np.asarray(z_views, np.float32)  # (b, V, E)
  b, v, e = z_views.shape
  z = np.concatenate([z_views.reshape(b * v, e), np.asarray(z_txt)], 0)
  domains = np.concatenate([np.zeros(b * v, np.int32), np.ones(b, np.int32)])
  ids = np.concatenate([np.repeat(np.arange(b), v), np.arange(b)])
  logits = np.asarray(uniclip_loss.domain_logits(z, domains, temperatures,
                                                 offsets))
  pair = domains[:, None] + domains[None, :]
  same = ids[:, None] == ids[None, :]
  off_diag = ~np.eye(len(z), dtype=bool)
  out = {}
  margins = []
  for k, name in ((0, 'ii'), (1, 'it')):
    pos = same & off_diag & (pair == k)
    neg = ~same & (pair == k)
    out[f'pos_{name}'] = float(logits[pos].mean())
    out[f'neg_{name}'] = float(logits[neg].mean())
    # Per anchor row: each positive against the row's mean negative.
    row_neg = np.where(neg, logits, 0).sum(1) / np.maximum(neg.sum(1), 1)
    rows, cols = np.nonzero(pos)
    margin = logits[rows, cols] - row_neg[rows]
    out[f'above_{name}'] = float(np.mean(margin > 0))
    margins.append(margin)
  margins = np.concatenate(margins)
  out['margin_min'] = float(margins.min())
  out['margin_mean'] = float(margins.mean())
  return out


def _scores(model, params_list, config, batch):
  """``_mean_scores`` of ``batch`` under each parameter set."""

  @jax.jit
  def embed(params, batch):
    images = embedding.normalize_images(batch['image'], config.data.mean,
                                    config.data.std)
    z = uniclip_train.embed(model, params, config, images, batch['aug'],
                            batch['tokens'])
    return z, uniclip_train.domain_scalars(
        params['uniclip'], 1.0 / config.optim.max_logit_scale)

  out = []
  for params in params_list:
    (z_views, z_txt), (tau, offset) = embed(params, batch)
    out.append(_mean_scores(z_views, z_txt, tau, offset))
  return out


# ----------------------------------------------------------------------------
# Training


@pytest.mark.slow
def test_uniclip_trains_and_separates_positives(tmp_path):
  """60 micro steps of the loop ``main`` runs, then held-out digits scored.

  Micro towers learn slowly (SigLIP's stay near chance for hundreds of steps
  at this size), so the bar is the direction of every number, not accuracy.
  """
  c = micro(60)
  workdir = str(tmp_path)
  summary = train.train_and_evaluate(c, workdir)
  assert summary['step'] == 60
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if '"loss"' in line]
  loss = np.asarray([r['loss'] for r in rows])
  assert len(loss) == 60 and np.all(np.isfinite(loss))
  assert np.mean(loss[-5:]) < 0.75 * np.mean(loss[:3]), loss
  # The loss is the sum of its three domain-pair parts.
  parts = sum(np.asarray([r[f'mp_nce_{k}'] for r in rows])
              for k in uniclip_loss.DOMAIN_PAIRS)
  np.testing.assert_allclose(loss, parts, rtol=1e-5)
  # Eq. 16's scalars are learned: they leave their init (tau 0.07, b 0), and
  # the easier image-image pairs get the larger offset (the paper's
  # expectation below eq. 16: an easy domain pair's threshold is higher).
  last = rows[-1]
  assert abs(last['tau_ii'] - 0.07) > 1e-3
  assert last['offset_ii'] > 0.02 > -0.02 > last['offset_it'], last
  # Train-time eval ran through the heads.
  assert 'zeroshot_cosine_top1' in summary['eval']
  _check_load_and_export(workdir, summary['eval'], tmp_path)

  tokenizer = Tokenizer(os.path.join(workdir, checkpoint.TOKENIZER_FILE),
                        c.model.text.context_length)
  model = ProLIP(train.model_config_for(c, tokenizer))
  params, _ = checkpoint.load_params(workdir)
  assert set(params['uniclip']) == {'image_head', 'text_head', 'log_tau',
                                    'offset'}
  tx, _ = optimizer.make_optimizer(c.optim, c.total_steps)
  init, _ = train.train_state_initializer(
      model, tx, shd.make_mesh(c.mesh),
      extra_params=functools.partial(
          objectives.get('uniclip').init_extra_params, c, model.config))
  params0 = init(jax.random.key(0)).params
  batch = _heldout_batch(tokenizer, model.config.vision.image_size)
  before, after = _scores(model, [params0, params], c, batch)
  # On pictures never trained on: another view of the same picture, and the
  # picture's caption, score above the negatives of their domain pair ...
  assert after['pos_ii'] > after['neg_ii'] + 0.1, after
  assert after['pos_it'] > after['neg_it'], after
  # ... and the worst positive (vs its anchor's mean negative) is much less
  # bad than at init. Not yet above it: micro towers after 60 steps.
  assert after['margin_min'] > before['margin_min'] + 2.0, (before, after)
  assert after['above_it'] > before['above_it'], (before, after)


def _check_load_and_export(workdir, train_eval, tmp_path):
  """``prolip_jax.load`` scores a UniCLIP checkpoint through its heads (the
  same zero-shot accuracy as the train-time eval); the export refuses it."""
  model = prolip_jax.load(workdir)
  assert model.objective == 'uniclip'
  images, labels = digits.split('heldout')
  rgb = np.repeat(images[..., None], 3, -1)
  clf = model.zero_shot_classifier(list(digits.CLASS_NAMES),
                                   list(digits.EVAL_TEMPLATES))
  assert clf.var is None  # deterministic: cosine
  acc = float(np.mean(clf.predict(rgb) == labels))
  assert acc == pytest.approx(train_eval['zeroshot_cosine_top1'], abs=1e-9)
  # The towers' own outputs score differently: that is what the heads change.
  towers = load_lib.LoadedModel(model.config, model.params, model.tokenizer,
                                 model.mean, model.std)
  tower_acc = float(np.mean(towers.zero_shot_classifier(
      list(digits.CLASS_NAMES), list(digits.EVAL_TEMPLATES)).predict(rgb)
                            == labels))
  assert tower_acc != acc
  with pytest.raises(ValueError, match="'uniclip' checkpoint"):
    tool('export_pytorch').export(workdir, str(tmp_path / 'export'))
  assert not os.path.exists(tmp_path / 'export' / 'model.safetensors')


def test_uniclip_config_file_and_validation():
  c = load_config('uniclip_tiny')
  assert c.objective == 'uniclip' and not c.model.use_unc
  assert c.data.num_views == 3
  train.validate_config(c)
  assert uniclip_train.resolve_weights(c.loss.mp_nce_weights, 3) == (
      1 / 9, 1 / 6, 1.0)  # the paper's w_D
  assert 'uniclip' in objectives.OBJECTIVES
  assert objectives.get('uniclip').multi_view
  assert not objectives.get('uniclip').needs_unc

  for section, key, value, match in [
      ('model', 'use_unc', True, 'use_unc=False'),
      ('data', 'num_views', 1, 'num_views >= 2'),
      ('loss', 'mp_nce_weights', 'equal', 'mp_nce_weights'),
      ('uniclip', 'head_width', 8, 'head_width')]:
    bad = load_config('uniclip_tiny')
    bad[section][key] = value
    with pytest.raises(ValueError, match=match):
      train.validate_config(bad)
  other = demos.tiny_demo_config('siglip')
  other.data.num_views = 3
  with pytest.raises(ValueError, match='one view per image'):
    train.validate_config(other)


# ----------------------------------------------------------------------------
# Dense == sharded


@pytest.mark.slow
def test_uniclip_sharded_step_matches_single_device():
  c = micro(10, batch_size=16)
  c.optim.warmup_steps = 0
  # Random token ids: the model config needs only a vocabulary size and a
  # pad id, no trained tokenizer.
  model = ProLIP(train.model_config_for(c, _FakeTokenizer()))
  rng = np.random.default_rng(0)
  b, v, s = c.batch_size, c.data.num_views, model.config.vision.image_size
  batch = {
      'image': rng.integers(0, 256, (b, v, s, s, 3), dtype=np.uint8),
      'aug': rng.uniform(0, 1, (b, v, transforms.AUG_DIM)).astype(np.float32),
      'tokens': rng.integers(3, 60, (b, c.model.text.context_length),
                             dtype=np.int32)}
  _, schedule = optimizer.make_optimizer(c.optim, c.total_steps)
  # An "optimizer" that stores the gradients as its state and leaves the
  # parameters alone: the loop's own jitted train step then hands back the
  # exact gradients it computed, with the state's shardings.
  keep_grads = optax.GradientTransformation(
      lambda params: jax.tree.map(jnp.zeros_like, params),
      lambda grads, state, params=None: (
          jax.tree.map(jnp.zeros_like, grads), grads))
  extra = functools.partial(objectives.get('uniclip').init_extra_params, c,
                            model.config)
  results = {}
  for n in (1, 8):  # dense mp_nce_loss vs shard_map'd mp_nce_loss_sharded
    mesh = shd.make_mesh({'data': n, 'fsdp': 1, 'num_devices': n})
    init, shardings = train.train_state_initializer(model, keep_grads, mesh,
                                                    extra_params=extra)
    step = jax.jit(
        train.make_train_step(model, c, keep_grads, schedule, mesh, 3),
        in_shardings=(shardings, shd.batch_sharding(mesh),
                      shd.replicated(mesh)),
        out_shardings=(shardings, shd.replicated(mesh)))
    state, metrics = step(init(jax.random.key(0)),
                          shd.host_to_global(mesh, batch), jax.random.key(1))
    assert int(state.step) == 1
    results[n] = jax.tree.map(np.asarray, jax.device_get((state.opt_state,
                                                          metrics)))
  g1, m1 = results[1]
  g8, m8 = results[8]
  for k in ('loss', 'mp_nce_image_image', 'mp_nce_image_text',
            'mp_nce_text_text', 'tau_ii', 'offset_it', 'grad_norm'):
    np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, err_msg=k)
  flat8 = dict(jax.tree_util.tree_flatten_with_path(g8)[0])
  top = max(np.abs(x).max() for x in jax.tree.leaves(g1))
  for path, ref in jax.tree_util.tree_flatten_with_path(g1)[0]:
    name = jax.tree_util.keystr(path)
    if "['attn']['k']['bias']" in name:
      # Softmax ignores a key bias: its gradient is 0 up to rounding, which
      # differs between the two reduction orders (see test_sharded_train).
      assert np.abs(flat8[path]).max() <= 1e-3 * top
      assert np.abs(ref).max() <= 1e-3 * top
      continue
    scale = np.abs(ref).max() + 1e-12
    np.testing.assert_allclose(flat8[path] / scale, ref / scale, atol=1e-4,
                               err_msg=name)
  # ProLIP's own scalars are unused by UniCLIP.
  assert g1['logit_scale'] == 0 and g1['logit_bias'] == 0
  # The heads and the domain scalars do get gradients.
  assert np.abs(g1['uniclip']['log_tau']).min() > 0
  assert np.abs(g1['uniclip']['image_head']['aug_encoder']['fc1']['kernel']
                ).max() > 0


class _FakeTokenizer:
  vocab_size = 64
  pad_id = 0


# ----------------------------------------------------------------------------
# Data


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('tok') / 'spm.model')
  train_tokenizer(digits.tokenizer_corpus()[:2000], path, 80)
  return Tokenizer(path, 16)


def test_pipeline_multiple_views(tokenizer):
  source = digits.records('train')[:64]
  augment = train.augment_config(load_config('uniclip_tiny').data)
  make = lambda **kw: pipeline.train_dataset(
      source, tokenizer=tokenizer, image_size=32, global_batch_size=8,
      seed=3, augment=augment, **kw)
  ds3 = make(num_views=3)
  batch = ds3[2]
  assert batch['image'].shape == (8, 3, 32, 32, 3)
  assert batch['aug'].shape == (8, 3, transforms.AUG_DIM)
  for i in range(8):
    for a, b in ((0, 1), (0, 2), (1, 2)):
      # Different crops/jitter: different pixels and different vectors.
      assert np.abs(batch['image'][i, a].astype(int)
                    - batch['image'][i, b]).mean() > 1.0
      assert np.abs(batch['aug'][i, a] - batch['aug'][i, b]).max() > 1e-3
  # Crop and brightness/contrast fields vary (the head sees how views
  # differ); saturation and hue stay at the identity for grey digits.
  assert np.std(batch['aug'][..., 0:4]) > 0.01
  assert np.std(batch['aug'][..., 4:6]) > 0.01
  np.testing.assert_array_equal(batch['aug'][..., 6], 1.0)
  np.testing.assert_array_equal(batch['aug'][..., 7], 0.0)
  # A function of the step only: rebuilt or re-read, the same batch.
  again = make(num_views=3)[2]
  for k in batch:
    np.testing.assert_array_equal(again[k], batch[k])
  assert np.abs(ds3[3]['image'].astype(int) - batch['image']).mean() > 1.0
  # num_views=1 is the default single-view output, unchanged.
  one, default = make(num_views=1)[2], make()[2]
  assert one['image'].shape == (8, 32, 32, 3) and one['aug'].shape == (8, 11)
  for k in default:
    np.testing.assert_array_equal(one[k], default[k])
  # Same per-element RNG: the first view is the single-view pipeline's view.
  np.testing.assert_array_equal(batch['image'][:, 0], one['image'])
