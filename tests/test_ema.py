"""The moving average of the parameters (``optim.ema_decay``).

Against an independent computation: the average of the parameter trajectory
the same steps produce, computed here in float64 numpy from the parameters
after each step (``theta~_t = m theta~_{t-1} + (1 - m) theta_t``, starting
from the initial parameters).
"""

import os

import jax
import numpy as np
import pytest

from prolip_jax import demos
from prolip_jax import objectives
from prolip_jax.config import presets
from prolip_jax.interop import load as load_lib
from prolip_jax.storage import checkpoint
from prolip_jax.training import optimizer
from prolip_jax.training import train

from support import load_config
from support import micro_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECAY = 0.5  # fast, so three steps move the average well away from theta


def _leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def test_the_state_keeps_the_average_of_the_trajectory_and_skips_nan_steps():
  c = presets.load_config_file(os.path.join(REPO, 'configs',
                                            'prolip_micro.py'))
  c.optim.ema_decay = DECAY
  c.debug_nan_steps = (3,)  # the third step's loss is NaN: nothing moves
  _, _, init, step, batch = micro_step(c)
  state = init(jax.random.key(0))
  want = _leaves(state.params)
  for _ in range(4):
    state, metrics = step(state, batch, jax.random.key(1))
    if not float(metrics['nonfinite']):
      want = [DECAY * w + (1 - DECAY) * p
              for w, p in zip(want, _leaves(state.params))]
    for got, w in zip(_leaves(state.ema), want):
      np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-7)
  assert float(metrics['nonfinite']) == 0.0
  moved = max(float(np.abs(e - p).max()) for e, p in
              zip(_leaves(state.ema), _leaves(state.params)))
  assert moved > 1e-4  # the average is not the parameters


def test_the_evaluators_score_the_average_but_otter_scores_its_student():
  prolip, otter = objectives.get('prolip'), objectives.get('otter')
  c = demos.tiny_demo_config('prolip')
  assert not optimizer.evaluates_ema(c, prolip)
  c.optim.ema_decay = 0.9
  assert optimizer.evaluates_ema(c, prolip)
  assert not optimizer.evaluates_ema(demos.tiny_demo_config('otter'), otter)


def _micro(steps, decay):
  c = load_config('prolip_micro')
  c.total_steps = steps
  c.mesh.num_devices = 1
  c.optim.ema_decay = decay
  c.checkpoint_every_steps = 1
  c.keep_checkpoints = None
  return c


@pytest.mark.slow
def test_saved_resumed_turned_on_at_resume_and_what_load_returns(tmp_path):
  """The average is saved with the state: 3 steps in one go equal 2 + a
  resumed 1; turned on at a resume it starts from the restored parameters;
  ``prolip_jax.load`` and the export read it as the run's model."""
  whole = str(tmp_path / 'whole')
  train.train_and_evaluate(_micro(3, DECAY), whole)
  split = str(tmp_path / 'split')
  train.train_and_evaluate(_micro(3, DECAY), split, max_steps=2)
  train.train_and_evaluate(_micro(3, DECAY), split)
  for a, b in zip(_leaves(checkpoint.load_params(whole, 3, 'teacher')[0]),
                  _leaves(checkpoint.load_params(split, 3, 'teacher')[0])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)

  late = str(tmp_path / 'late')
  train.train_and_evaluate(_micro(3, 0.0), late, max_steps=2)
  with pytest.raises(FileNotFoundError, match='no moving average'):
    checkpoint.load_params(late, 2, 'teacher')
  train.train_and_evaluate(_micro(3, DECAY), late)
  p2 = _leaves(checkpoint.load_params(late, 2)[0])
  p3 = _leaves(checkpoint.load_params(late, 3)[0])
  ema3, meta = checkpoint.load_params(late, 3, 'teacher')
  assert meta[checkpoint.SCORED] == 'teacher'
  for got, a, b in zip(_leaves(ema3), p2, p3):
    np.testing.assert_allclose(got, DECAY * a + (1 - DECAY) * b, rtol=1e-5,
                               atol=1e-7)

  loaded = load_lib.load(late)
  for got, want in zip(_leaves(loaded.params), _leaves(ema3)):
    np.testing.assert_array_equal(got, want)
