"""Exact gradient accumulation (``accum_steps``, training/accumulation.py).

The reference is the un-split step itself: ``accum_steps=1`` differentiates
the composed loss with ``jax.grad`` directly (the path every other test
checks against the papers and the release), while K > 1 runs the towers
micro-batch by micro-batch around one evaluation of the loss and pulls the
gradient back through cached output gradients. One step from the same state
on the same batch must give the same loss, the same gradient (Adam's first
moment after one step is 0.1 g, so the optimizer state compares the
gradients leaf by leaf) and the same updated parameters, to float32
rounding, for every objective on 1, 2 and 4 devices.
"""

import jax
import numpy as np
import pytest

from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.aot import report as aot_report
from prolip_jax.data import transforms
from prolip_jax.models import ProLIP
from prolip_jax.training import accumulation
from prolip_jax.training import optimizer
from prolip_jax.training import train

from support import load_config
from support import metric_values
from support import objective_micro_config
from support import trained_params

MASK_ID = 3
LR = 1e-3  # objective_micro_config()'s
VOCAB = 64


class _Tokenizer:
  vocab_size = VOCAB
  pad_id = 0


def _config(objective, devices, batch_size=32):
  c = objective_micro_config(objective, 4, num_devices=devices,
                             batch_size=batch_size)
  if objective == 'uniclip':
    c.data.num_views = 3
  # Stride 2 instead of 8: 2 masked rows per 4 pairs, so a 32-pair batch
  # on 4 devices still splits 4 ways (8 pairs, 4 masked, per device).
  c.masking.fraction = 0.5
  c.optim.warmup_steps = 0
  return c


def _batch(c, model, mesh, seed=0) -> dict:
  """A random batch with every entry the objective reads."""
  rng = np.random.default_rng(seed)
  b, s = c.batch_size, model.config.vision.image_size
  length = model.config.text.context_length
  image = lambda *lead: rng.integers(0, 256, (*lead, s, s, 3), np.uint8)
  tokens = lambda: rng.integers(4, VOCAB, (b, length), np.int32)
  batch = {'tokens': tokens()}
  if c.objective == 'uniclip':
    v = c.data.num_views
    batch['image'] = image(b, v)
    batch['aug'] = rng.normal(size=(b, v, transforms.AUG_DIM)).astype(
        np.float32)
  else:
    batch['image'] = image(b)
  if c.objective == 'pcclip':
    batch.update(pair_image_i=image(b), pair_image_j=image(b),
                 pair_tokens=tokens())
  return shd.host_to_global(mesh, batch)


def _steps(c, devices, fsdp=1):
  """``(step_for, state, batch)``: ``step_for(k)`` is the jitted train step
  with ``accum_steps=k`` on ``devices`` devices (``fsdp`` of them splitting
  the large parameters), ``state`` the initial state, ``batch`` a random
  one."""
  objective = objectives.get(c.objective)
  model = ProLIP(train.model_config_for(c, _Tokenizer()))
  mesh = shd.make_mesh({'data': devices // fsdp, 'fsdp': fsdp,
                        'num_devices': devices})
  tx, schedule = optimizer.make_optimizer(c.optim, c.total_steps)
  init, shardings = train.run_state_initializer(c, model, tx, mesh, objective)

  def step_for(k):
    c.accum_steps = k
    return jax.jit(
        train.make_train_step(model, c, tx, schedule, mesh, MASK_ID,
                              objective),
        in_shardings=(shardings, shd.batch_sharding(mesh),
                      shd.replicated(mesh)),
        out_shardings=(shardings, shd.replicated(mesh)))
  return step_for, init(jax.random.key(0)), _batch(c, model, mesh)


def _one_step(c, devices, ks, fsdp=1):
  """``{k: (metrics, state)}`` of one step from the same initial state."""
  step_for, state, batch = _steps(c, devices, fsdp)
  out = {}
  for k in ks:
    new_state, metrics = step_for(k)(state, batch, jax.random.key(1))
    out[k] = jax.tree.map(np.asarray, (metrics, new_state))
  return out


def _assert_same_step(results, name):
  (m1, s1), = [results[1]]
  for k, (mk, sk) in results.items():
    if k == 1:
      continue
    assert float(mk['nonfinite']) == 0.0
    np.testing.assert_allclose(mk['loss'], m1['loss'], rtol=2e-6,
                               err_msg=f'{name} K={k} loss')
    np.testing.assert_allclose(mk['grad_norm'], m1['grad_norm'], rtol=1e-5,
                               err_msg=f'{name} K={k} grad norm')
    for what, a, b in (('opt_state', sk.opt_state, s1.opt_state),
                       ('params', sk.params, s1.params)):
      for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(a),
                                   jax.tree.leaves(b)):
        if "['k']['bias']" in jax.tree_util.keystr(path):
          # Softmax ignores a key bias: its gradient is zero but for
          # rounding (~1e-9 here), and Adam's first step turns any noise
          # into +-lr. Zero both ways, then the step bounded by lr.
          bound = 2.5 * LR if what == 'params' else 1e-7
          assert np.abs(got - want).max() <= bound, (name, k, what)
          continue
        # Float32 sums in another order: the gradients (opt_state) to 1e-5
        # of the leaf's largest. Adam's first step is lr * g / (|g| + eps):
        # where |g| is near eps that rounding moves the update, so the
        # parameters agree to a twentieth of one step's size.
        scale = float(np.abs(want).max()) if np.size(want) else 0.0
        atol = 0.05 * LR if what == 'params' else 1e-5 * scale + 1e-12
        np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=atol,
            err_msg=f'{name} K={k} {what}{jax.tree_util.keystr(path)}')


def test_prolip_step_with_two_micro_batches_equals_the_whole_batch():
  """ProLIP (masked copies drawn on the whole batch, arranged per shard,
  the ring loss) on 2 devices: K = 2 gives the un-split step."""
  c = _config('prolip', 2)
  _assert_same_step(_one_step(c, 2, (1, 2)), 'prolip/2')


@pytest.mark.slow
@pytest.mark.parametrize('objective', sorted(objectives.OBJECTIVES))
def test_every_objective_accumulates_exactly_on_two_devices(objective):
  c = _config(objective, 2)
  _assert_same_step(_one_step(c, 2, (1, 2, 4)), f'{objective}/2')


@pytest.mark.slow
def test_the_gradient_is_all_reduced_once_per_step_whatever_k():
  """On 4 data-parallel devices each device sums its own micro-batches'
  gradients and the sums are added once: the compiled step's all-reduce
  traffic (``aot.report.collectives``, each collective counted as often as
  its loop runs) does not grow with K and is no more than the un-split
  step's. Reducing after every micro-batch, as summing reduced gradients
  does, adds the parameters' size once more per extra micro-batch. (XLA's
  CPU compiler reduces the un-split step's gradient in two parts, one per
  use of the image tower, so K = 1 moves twice the parameters' size here;
  a TPU v5e compile moves it once.)"""
  c = _config('prolip', 4)
  step_for, state, batch = _steps(c, 4)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
  traffic = {}
  for k in (1, 2, 4):
    compiled = step_for(k).lower(state, batch, jax.random.key(1)).compile()
    traffic[k] = aot_report.collectives(compiled.as_text())['all-reduce'][
        'bytes']
  assert min(traffic.values()) >= param_bytes, (traffic, param_bytes)
  assert traffic[2] <= traffic[1], (traffic, param_bytes)
  assert abs(traffic[4] - traffic[2]) < 0.01 * param_bytes, (
      traffic, param_bytes)


@pytest.mark.slow
def test_an_fsdp_mesh_accumulates_exactly():
  """data 2 x fsdp 2 (the micro model's large leaves split over fsdp): each
  micro-batch's gradient is reduced as it ends, and K = 2 still gives the
  un-split step."""
  c = _config('prolip', 4)
  c.mesh.fsdp_min_size_mb = 0.0
  _assert_same_step(_one_step(c, 4, (1, 2), fsdp=2), 'prolip/fsdp2')


# One device (no ring: the dense loss) and four (one masked row per
# micro-batch) for the objectives whose parts are their own (the others
# share the default parts with different local losses, all run above).
@pytest.mark.slow
@pytest.mark.parametrize('devices', [1, 4])
@pytest.mark.parametrize('objective', ['pcclip', 'prolip', 'uniclip'])
def test_own_parts_accumulate_exactly_on_one_and_four_devices(objective,
                                                              devices):
  c = _config(objective, devices)
  _assert_same_step(_one_step(c, devices, (1, 4)), f'{objective}/{devices}')


@pytest.mark.slow
def test_micro_run_on_two_devices_with_four_micro_batches_is_the_same_run(
    tmp_path):
  """configs/prolip_micro.py, global batch 64 on 2 devices, 4 steps through
  the loop (data, masking, checkpoint): ``accum_steps=4`` gives the losses
  and final parameters of the un-split run, and so does a run that changes
  K on resume (2 steps with K=2, then 2 with K=4)."""

  def run(name, *ks):
    workdir = str(tmp_path / name)
    for k in ks:
      c = load_config('prolip_micro')
      c.batch_size = 64  # 32 per device: 4 micro-batches, 1 masked row each
      c.total_steps = 4
      c.mesh.num_devices = 2
      c.accum_steps = k
      train.train_and_evaluate(c, workdir, max_steps=4 // len(ks))
    return metric_values(workdir), trained_params(workdir), c.optim.lr

  losses1, params1, lr = run('k1', 1)
  assert len(losses1) == 4
  for name, ks in (('k4', (4,)), ('k2_then_k4', (2, 4))):
    losses, params, _ = run(name, *ks)
    np.testing.assert_allclose(losses, losses1, rtol=1e-5, err_msg=name)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree.leaves(params1)):
      leaf = name + jax.tree_util.keystr(path)
      if "['k']['bias']" in leaf:  # zero gradient but for rounding (above)
        assert np.abs(got - want).max() <= 4 * 2.5 * lr, leaf
        continue
      # Adam near eps (above): a twentieth of a step per step.
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=4 * 0.05 * lr,
                                 err_msg=leaf)


def test_split_and_join_rows_keep_each_device_its_rows():
  """Micro-batch j holds rows j*m.. of every device's share; joining the
  micro-batches gives the batch back in its order."""
  x = np.arange(24).reshape(12, 2)
  micro_batches = np.asarray(accumulation.split_rows(x, shards=2, k=3))
  # Device 0 holds rows 0..5, device 1 rows 6..11; m = 2.
  np.testing.assert_array_equal(micro_batches[:, :, 0],
                                [[0, 2, 12, 14], [4, 6, 16, 18],
                                 [8, 10, 20, 22]])
  np.testing.assert_array_equal(
      np.asarray(accumulation.join_rows(micro_batches, shards=2)), x)
  with pytest.raises(errors.ConfigError, match='accum_steps=5'):
    accumulation.split_rows(x, shards=2, k=5)


def test_a_batch_that_does_not_split_is_one_line_before_any_work():
  c = _config('prolip', 2)
  c.accum_steps = 4
  c.batch_size = 8  # 4 per device: 2 masked rows, not 4 micro-batches
  with pytest.raises(ValueError, match='accum_steps=4 equal micro-batches, '
                     'each of which must be a multiple of 1/masking.fraction '
                     r'= 2.*multiple of 16'):
    objectives.get('prolip').validate_batch(c, 2)
  c.objective = 'siglip'
  c.batch_size = 12
  with pytest.raises(ValueError, match='multiple of 8'):
    objectives.get('siglip').validate_batch(c, 2)

