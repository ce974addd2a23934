"""The benchmarks compile the step a run compiles.

``benchmarks/compile_time.py --what=train_step`` builds its program from
``train.run_state_initializer`` and ``train.jit_train_step``; here, on the
tiny configs, its abstract state must be the training run's (UniCLIP's heads
in ``params['uniclip']``, OTTER's teacher) and the step must take it and
return the same tree (``jax.eval_shape``: traced, never compiled).
"""

import importlib.util
import os

import jax
import pytest

from prolip_jax import sharding as shd
from prolip_jax.config import presets
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.training import optimizer
from prolip_jax.training import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compile_time():
  spec = importlib.util.spec_from_file_location(
      'benchmarks_compile_time',
      os.path.join(REPO, 'benchmarks', 'compile_time.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _shapes(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.mark.parametrize('name', ['uniclip', 'otter', 'prolip'])
def test_compile_time_state_is_the_runs(name):
  compile_time = _compile_time()
  config = presets.load_config_file(
      os.path.join(REPO, 'configs', f'{name}_tiny.py'))
  model = ProLIP(ModelConfig.from_config(config.model))
  mesh = shd.make_mesh(config.mesh)
  fn, (state, batch, rng) = compile_time.train_step_program(
      config, model, mesh, mask_id=3)

  tx, _ = optimizer.make_optimizer(config.optim, config.total_steps)
  init_state, _ = train.run_state_initializer(config, model, tx, mesh)
  run_state = jax.eval_shape(init_state, jax.random.key(0))
  assert (jax.tree.structure(state) == jax.tree.structure(run_state))
  assert _shapes(state) == _shapes(run_state)
  assert ('uniclip' in state.params) == (name == 'uniclip')
  assert (state.ema is not None) == (name == 'otter')
  if name == 'uniclip':  # the views of a multi-view batch
    assert batch['image'].ndim == 5

  new_state, metrics = jax.eval_shape(fn, state, batch, rng)
  assert _shapes(new_state) == _shapes(state)
  assert 'loss' in metrics
