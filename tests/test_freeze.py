"""Locked and frozen parameters (``optim.freeze``, training/optimizer.py).

The frozen leaves get no update, no weight decay and no optimizer state; the
rest train as if the frozen ones were constants. Checked against independent
computations: the state's size summed from the trainable leaves alone, the
updates of a plain ``optax`` AdamW built on the trainable subtree alone, two
train steps against a hand-rolled loop over that subtree, and a real run
through ``train.train_and_evaluate`` whose image tower stays bit-identical
to the initial one (also across a resume).
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.config import presets
from prolip_jax.data import transforms
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.models import init_params
from prolip_jax.storage import checkpoint
from prolip_jax.training import optimizer
from prolip_jax.training import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')
LIT = os.path.join(REPO, 'configs', 'prolip_b16_lit.py')
MASK_ID = 3
IMAGE_TOWER = ('visual/.*',)


class _Tokenizer:
  vocab_size = 64
  pad_id = 0


def _micro(total_steps=6, freeze=IMAGE_TOWER):
  c = presets.load_config_file(MICRO)
  c.total_steps = total_steps
  c.mesh.num_devices = 1
  c.optim.freeze = freeze
  return c


def _abstract_params(config):
  model_cfg = ModelConfig.from_config(config.model)
  return jax.eval_shape(lambda r: init_params(model_cfg, r),
                        jax.random.key(0))


def _is_image_tower(path):
  return getattr(path[0], 'key', None) == 'visual'


def _split(tree):
  """``(trainable, frozen)``: the image tower apart from the rest."""
  return ({k: v for k, v in tree.items() if k != 'visual'},
          {'visual': tree['visual']})


def _floats_and_counters(state):
  leaves = jax.tree.leaves(state)
  floats = sum(math.prod(x.shape) for x in leaves
               if jnp.issubdtype(x.dtype, jnp.floating))
  counters = [x for x in leaves if not jnp.issubdtype(x.dtype, jnp.floating)]
  return floats, counters


@pytest.mark.parametrize('path', [MICRO, LIT])
def test_frozen_tower_has_no_optimizer_state(path):
  """With the image tower frozen, AdamW's state holds exactly two floats
  (first and second moment) per trainable scalar, summed here from the
  leaves outside ``visual``, plus the scalar step counters; without, two
  per scalar of the model. The B/16 LiT config: its image tower's 86M
  parameters (about 0.66 GiB of moments) leave the state."""
  config = presets.load_config_file(path)
  config.optim.grad_clip = 1.0  # the clip's state is empty too
  params = _abstract_params(config)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  trainable = sum(math.prod(x.shape) for p, x in leaves
                  if not _is_image_tower(p))
  everything = sum(math.prod(x.shape) for _, x in leaves)
  assert config.optim.freeze == (IMAGE_TOWER if path == LIT else ())
  config.optim.freeze = IMAGE_TOWER
  tx, _ = optimizer.make_optimizer(config.optim, config.total_steps)
  floats, counters = _floats_and_counters(jax.eval_shape(tx.init, params))
  assert floats == 2 * trainable
  assert counters and all(c.shape == () for c in counters)
  config.optim.freeze = ()
  tx, _ = optimizer.make_optimizer(config.optim, config.total_steps)
  floats, counters = _floats_and_counters(jax.eval_shape(tx.init, params))
  assert floats == 2 * everything
  assert counters and all(c.shape == () for c in counters)
  if path == LIT:  # the released B/16's image tower: ViT-B/16, ~86M
    assert 85e6 < everything - trainable < 88e6


def test_frozen_leaves_get_no_update_and_the_rest_plain_adamw():
  """One update with weight decay and a global-norm clip: every frozen leaf's
  update is exactly zero; the trainable leaves' equal those of optax's
  clip + AdamW built here on the trainable subtree alone (so the clip's
  norm counts the trainable gradients only)."""
  config = _micro()
  optim = config.optim
  optim.warmup_steps, optim.weight_decay, optim.grad_clip = 0, 0.1, 0.5
  params = init_params(ModelConfig.from_config(config.model),
                       jax.random.key(0))
  grads = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
  tx, schedule = optimizer.make_optimizer(optim, config.total_steps)
  state = tx.init(params)
  updates, state = tx.update(grads, state, params)
  updates, _ = tx.update(grads, state, params)  # the second: Adam's moments

  trainable, frozen = _split(params)
  ref_tx = optax.chain(
      optax.clip_by_global_norm(0.5),
      optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                  weight_decay=0.1, mask=optimizer.weight_decay_mask))
  ref_grads = _split(grads)[0]
  ref_state = ref_tx.init(trainable)
  _, ref_state = ref_tx.update(ref_grads, ref_state, trainable)
  want, _ = ref_tx.update(ref_grads, ref_state, trainable)
  assert optax.tree.norm(_split(grads)[1]) > 0.5  # the clip would differ
  for leaf in jax.tree.leaves(updates['visual']):
    np.testing.assert_array_equal(np.asarray(leaf), 0.0)
  got = _split(updates)[0]
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-9, err_msg=jax.tree_util.keystr(path))
  assert jax.tree.leaves(frozen)  # and the image tower had leaves at all


def test_freeze_patterns_are_full_regular_expressions():
  params = _abstract_params(_micro())
  paths = [optimizer.parameter_path(p)
           for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  mask = optimizer.frozen_mask(params, ('logit_.*', 'text/unc_emb'))
  chosen = sorted(p for p, f in zip(paths, jax.tree.leaves(mask)) if f)
  assert chosen == ['logit_bias', 'logit_scale', 'text/unc_emb']
  # Matched in full: 'visual' alone is no parameter, 'visual/.*' is 55.
  with pytest.raises(errors.ConfigError, match="'visual' matches no"):
    optimizer.frozen_mask(params, ('visual',))
  mask = optimizer.frozen_mask(params, IMAGE_TOWER)
  assert sum(jax.tree.leaves(mask)) == sum(
      p.startswith('visual/') for p in paths)


@pytest.mark.parametrize('freeze,message', [
    (('image_tower/.*',), "optim.freeze pattern 'image_tower/.*' matches no "
     "parameter (regular expressions matched in full against '/'-joined "
     "paths such as 'logit_bias', 'logit_scale', 'text/cls_emb', "
     "'visual/class_embedding')"),
    (('(',), "optim.freeze: '(' is not a regular expression"),
    (('.*',), "optim.freeze ('.*',) freezes every parameter"),
    ((3,), 'optim.freeze: 3 is not a string pattern'),
])
def test_a_bad_freeze_is_one_line_before_any_work(tmp_path, capfd, freeze,
                                                  message):
  """A pattern that matches nothing (with real example paths), no regular
  expression, or one that freezes everything: one ``error:`` line, exit
  status 2, before the workdir exists."""
  config = _micro()
  with config.ignore_type():
    config.optim.freeze = freeze
  workdir = tmp_path / 'wd'
  status = errors.cli_main(lambda: train.train_and_evaluate(config,
                                                            str(workdir)))
  assert status == errors.EXIT_USER_ERROR
  lines = [l for l in capfd.readouterr().err.splitlines()
           if l.startswith('error:')]
  assert len(lines) == 1 and message in lines[0], lines
  assert not workdir.exists()
  with pytest.raises(errors.ConfigError, match='sequence of patterns'):
    optimizer.freeze_patterns({'freeze': 'visual/.*'})


def _batch(mesh, config, model):
  rng = np.random.default_rng(0)
  b, s = config.batch_size, model.config.vision.image_size
  return shd.host_to_global(mesh, {
      'image': rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8),
      'aug': np.tile(transforms.identity_aug_vector(), (b, 1)),
      'tokens': rng.integers(4, 60, (b, model.config.text.context_length),
                             dtype=np.int32)})


def _hand_rolled(config, model, mesh, params, batch, key, schedule, steps):
  """``steps`` steps by hand: the objective's loss differentiated with
  respect to the trainable subtree only (the image tower a constant),
  optax's AdamW on that subtree, then the scale's clamp. Returns the
  trainable subtree, the losses and the gradient norms."""
  loss_fn = objectives.get(config.objective).make_loss_fn(model, config,
                                                          mesh, MASK_ID)
  optim = config.optim
  tx = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                   weight_decay=optim.weight_decay,
                   mask=optimizer.weight_decay_mask)
  trainable, frozen = _split(params)
  state = tx.init(trainable)
  losses, norms = [], []

  @jax.jit
  def step(trainable, state, number):
    f = lambda t: loss_fn(dict(t, **frozen), None, batch,
                          jax.random.fold_in(key, number))
    (loss, _), grads = jax.value_and_grad(f, has_aux=True)(trainable)
    updates, state = tx.update(grads, state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    trainable = dict(trainable, logit_scale=jnp.minimum(
        trainable['logit_scale'], math.log(optim.max_logit_scale)))
    return trainable, state, loss, optax.tree.norm(grads)

  for number in range(steps):
    trainable, state, loss, norm = step(trainable, state, number)
    losses.append(float(loss))
    norms.append(float(norm))
  return trainable, losses, norms


@pytest.mark.slow  # compiles the micro model's step twice (~1 CPU minute)
def test_frozen_steps_equal_a_hand_rolled_loop_on_the_trainable_subtree():
  """Three steps of ``train.make_train_step`` with the image tower frozen
  against ``_hand_rolled``: the same losses and gradient norms, the same
  trainable parameters; the image tower bit-identical to its start."""
  c = _micro(total_steps=10)
  c.optim.warmup_steps = 1
  model = ProLIP(train.model_config_for(c, _Tokenizer()))
  mesh = shd.make_mesh({'data': 1, 'fsdp': 1, 'num_devices': 1})
  tx, schedule = optimizer.make_optimizer(c.optim, c.total_steps)
  init, shardings = train.train_state_initializer(model, tx, mesh)
  step = jax.jit(train.make_train_step(model, c, tx, schedule, mesh, MASK_ID),
                 in_shardings=(shardings, shd.batch_sharding(mesh),
                               shd.replicated(mesh)),
                 out_shardings=(shardings, shd.replicated(mesh)))
  batch, key = _batch(mesh, c, model), jax.random.key(1)
  state0 = init(jax.random.key(0))
  state, losses, norms = state0, [], []
  for _ in range(3):
    state, metrics = step(state, batch, key)
    losses.append(float(metrics['loss']))
    norms.append(float(metrics['grad_norm']))
  want, want_losses, want_norms = _hand_rolled(
      c, model, mesh, jax.tree.map(np.asarray, state0.params), batch, key,
      schedule, 3)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
  got, frozen = _split(state.params)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    name = jax.tree_util.keystr(path)
    # The key bias shifts every logit of a query alike: its gradient is 0 up
    # to rounding, which Adam's normalisation turns into noise of ~lr * 1e-2.
    atol = 5e-5 if name.endswith("['k']['bias']") else 1e-6
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=atol, err_msg=name)
  for a, b in zip(jax.tree.leaves(frozen),
                  jax.tree.leaves(state0.params['visual'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.allclose(np.asarray(got['text']['unc_emb']),
                         np.asarray(state0.params['text']['unc_emb']))


def _initial_params(config):
  """The parameters a run of ``config`` starts from: the run's own jitted
  initializer (``train.run_state_initializer``) at its ``init_rng``."""
  model = ProLIP(ModelConfig.from_config(config.model))
  mesh = shd.make_mesh(config.mesh)
  tx, _ = optimizer.make_optimizer(config.optim, config.total_steps)
  init, _ = train.run_state_initializer(config, model, tx, mesh)
  init_rng, _ = jax.random.split(jax.random.key(config.seed))
  return jax.tree.map(np.asarray, init(init_rng).params)


@pytest.mark.slow  # three micro runs (~1 CPU minute)
def test_a_frozen_run_keeps_its_image_tower_and_resumes_exactly(tmp_path):
  """``train.train_and_evaluate`` with the image tower frozen: after 4 steps
  (2, a checkpoint, a resume, 2 more) every image-tower leaf is
  bit-identical to the run's initial one, the text tower moved, and the
  parameters equal those of an uninterrupted run (the optimizer state,
  with its empty frozen part, was saved and restored)."""
  config = _micro(total_steps=4)
  split, whole = str(tmp_path / 'split'), str(tmp_path / 'whole')
  assert train.train_and_evaluate(config, split, max_steps=2)['step'] == 2
  assert train.train_and_evaluate(config, split)['step'] == 4
  train.train_and_evaluate(config, whole)
  start = _initial_params(config)
  params, meta = checkpoint.load_params(split)
  params = jax.tree.map(np.asarray, params)
  assert meta['step'] == 4
  for (path, a), b in zip(
      jax.tree_util.tree_leaves_with_path(params['visual']),
      jax.tree.leaves(start['visual'])):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  assert not np.allclose(params['text']['text_projection']['kernel'],
                         start['text']['text_projection']['kernel'])
  other = jax.tree.map(np.asarray, checkpoint.load_params(whole)[0])
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(other)):
    np.testing.assert_array_equal(a, b)
