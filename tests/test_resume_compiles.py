"""A resumed run compiles its train step once, as a fresh run does.

A second compilation shows as one step that takes as long as the first
(seconds on the micro config, minutes on a large model) right after a
resume or ``init_from``: the first step's state (restored) and the second's
(the step's own outputs) differed in something jit keys its cache on.
"""

import contextlib
import importlib.util
import os

from jax import monitoring
import pytest

from prolip_jax.config import presets
from prolip_jax.training import train

ROOT = os.path.dirname(os.path.dirname(__file__))

# Recorded once per lowering of a jitted function, whether or not the
# persistent compilation cache (tests/conftest.py) then supplies the
# executable: it counts compile requests, not XLA compilations.
_LOWERING = '/jax/core/compile/jaxpr_to_mlir_module_duration'


@contextlib.contextmanager
def _train_step_lowerings():
  """A list that gets one entry per lowering of the train step while the
  block runs."""
  seen = []

  def listener(event, duration, **kwargs):
    del duration
    if event == _LOWERING and 'train_step' in str(kwargs.get('fun_name')):
      seen.append(kwargs['fun_name'])

  monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    monitoring.unregister_event_duration_listener(listener)


def _micro_config(total_steps, eval_every_steps=None):
  """The micro config; its held-out evaluation every ``eval_every_steps``
  steps, none when None (evaluating takes longer than the steps)."""
  c = presets.load_config_file(os.path.join(ROOT, 'configs',
                                            'prolip_micro.py'))
  c.total_steps = total_steps
  c.mesh.num_devices = 1
  if eval_every_steps is None:
    c.evals = {}
  else:
    c.evals.eval.every_steps = eval_every_steps
  return c


def _export(workdir, out):
  """``tools/export_pytorch.py``: ``workdir``'s weights as a snapshot for
  ``init_from``."""
  spec = importlib.util.spec_from_file_location(
      'export_pytorch', os.path.join(ROOT, 'tools', 'export_pytorch.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.export(workdir, out)


@pytest.mark.slow
def test_fresh_resumed_and_init_from_runs_compile_the_train_step_once(
    tmp_path):
  """One lowering of the train step per run: fresh (with an evaluation
  between its steps), resumed, and started from imported weights."""
  workdir = str(tmp_path / 'run')
  # An evaluation after step 1: step 2 follows it.
  with _train_step_lowerings() as fresh:
    assert train.train_and_evaluate(_micro_config(6, 1), workdir,
                                    max_steps=2)['step'] == 2
  assert len(fresh) == 1, f'fresh run: {fresh}'
  with _train_step_lowerings() as resumed:
    assert train.train_and_evaluate(_micro_config(6), workdir,
                                    max_steps=2)['step'] == 4
  assert len(resumed) == 1, f'resumed run: {resumed}'

  # Imported weights: a fresh optimizer state on the restored parameters.
  _export(workdir, str(tmp_path / 'snapshot'))
  # total_steps as above: the same program, loaded from the persistent
  # compilation cache (the schedule is compiled in).
  cfg = _micro_config(6)
  cfg.init_from = str(tmp_path / 'snapshot')
  with _train_step_lowerings() as imported:
    assert train.train_and_evaluate(cfg, str(tmp_path / 'tuned'),
                                    max_steps=2)['step'] == 2
  assert len(imported) == 1, f'init_from run: {imported}'
