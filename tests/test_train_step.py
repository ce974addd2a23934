"""The train step on its own: two steps of the micro model on a random batch,
no data pipeline, tokenizer, checkpoint or evaluation (slow all the same: it
compiles the micro model's train step and its gradient, about a CPU minute).

Against an independent assembly of the same pieces (the objective's loss,
``jax.grad``, the optimizer, the temperature clamp), plus the two guards the
slow end-to-end tests check on real runs: the logit scale is clamped after
the update (``test_train.py``), and a step with a non-finite loss changes
nothing but the step counter (``test_faults.py``).
"""

import math
import os

import jax
import numpy as np
import optax
import pytest

from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.config import presets

from support import MASK_ID
from support import micro_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_two_steps_update_clamp_and_skip_a_nan_step():
  c = presets.load_config_file(os.path.join(REPO, 'configs',
                                            'prolip_micro.py'))
  c.total_steps = 10
  c.model.init_logit_scale = 200.0  # above the clamp of 100
  c.debug_nan_steps = (2,)  # the second step's loss is NaN
  model, tx, init, step, batch = micro_step(c)
  mesh = shd.make_mesh({'data': 1, 'fsdp': 1, 'num_devices': 1})
  key = jax.random.key(1)
  state0 = init(jax.random.key(0))
  state1, m1 = step(state0, batch, key)
  state2, m2 = step(state1, batch, key)

  # Step 1 by hand: the objective's loss and its gradient at the initial
  # parameters (with the step's folded key), AdamW, then the clamp.
  loss_fn = objectives.get(c.objective).make_loss_fn(model, c, mesh, MASK_ID)
  rng1 = jax.random.fold_in(key, 0)
  # One jitted program: op by op, XLA compiles a program for each of the
  # hundreds of operations (the test took 34 s against 17 s; 2026-12-07,
  # this 2-core VM).
  @jax.jit
  def by_hand(params, opt_state, batch):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, None, batch, rng1)
    updates, _ = tx.update(grads, opt_state, params)
    return loss, grads, optax.apply_updates(params, updates)
  loss, grads, want = by_hand(state0.params, state0.opt_state, batch)
  assert float(want['logit_scale']) > math.log(100.0) + 0.5  # clamp needed
  want = dict(want, logit_scale=np.minimum(want['logit_scale'],
                                           math.log(100.0)))
  assert int(state1.step) == 1 and float(m1['nonfinite']) == 0.0
  np.testing.assert_allclose(float(m1['loss']), float(loss), rtol=1e-5)
  np.testing.assert_allclose(float(m1['grad_norm']),
                             float(optax.tree.norm(grads)), rtol=1e-4)
  for (path, got), ref in zip(
      jax.tree_util.tree_leaves_with_path(state1.params),
      jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4,
                               atol=1e-6, err_msg=jax.tree_util.keystr(path))
  np.testing.assert_allclose(float(state1.params['logit_scale']),
                             math.log(100.0), rtol=1e-6)

  # Step 2 (NaN injected): counted, nothing else moves.
  assert int(state2.step) == 2 and float(m2['nonfinite']) == 1.0
  assert not np.isfinite(float(m2['loss']))
  for a, b in zip(jax.tree.leaves((state1.params, state1.opt_state)),
                  jax.tree.leaves((state2.params, state2.opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
