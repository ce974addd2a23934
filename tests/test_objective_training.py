"""Short training runs of the objectives beyond prolip/siglip/clip.

Micro-sized models and a few steps each: they show that an objective trains
(finite, decreasing loss), that its sharded form agrees with one device, and
that unsupported combinations fail with a clear error.
"""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

from prolip_jax import checkpoint
from prolip_jax import objectives
from prolip_jax import presets
from prolip_jax import train

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                          'configs')


def load_config(name):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(CONFIG_DIR, name + '.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def micro(objective, total_steps, num_devices=1, batch_size=16):
  """``prolip_micro`` towers with the objective's tiny-demo settings."""
  c = load_config('prolip_micro')
  demo = presets.tiny_demo_config(objective)
  c.objective = objective
  c.model.use_unc = demo.model.use_unc
  c.model.init_logit_scale = demo.model.init_logit_scale
  c.model.init_logit_bias = demo.model.init_logit_bias
  c.loss = demo.loss
  c.total_steps = total_steps
  c.batch_size = batch_size
  c.optim.lr = 1e-3
  c.mesh.num_devices = num_devices
  c.mesh.data = num_devices
  c.mesh.fsdp = 1
  c.checkpoint_every_steps = 1000
  c.log_every_steps = 1
  return c


def _losses(workdir, key='loss'):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [r[key] for r in rows if key in r]


def _params(workdir):
  params, _ = checkpoint.load_params(workdir)
  return jax.tree.map(np.asarray, params)


# ----------------------------------------------------------------------------
# PCME++ (ProLIP paper, Table C.3)


def test_pcme_config_file():
  c = load_config('pcme_tiny')
  assert c.objective == 'pcme'
  assert c.model.use_unc
  assert c.model.init_logit_scale == 5.0 and c.model.init_logit_bias == 5.0


def test_pcme_needs_unc(tmp_path):
  c = micro('pcme', 2)
  c.model.use_unc = False
  with pytest.raises(ValueError, match='use_unc'):
    train.train_and_evaluate(c, str(tmp_path))


def test_pcme_trains_and_loss_decreases(tmp_path):
  c = micro('pcme', 20)
  summary = train.train_and_evaluate(c, str(tmp_path))
  assert summary['step'] == 20
  loss = _losses(str(tmp_path))
  pml = _losses(str(tmp_path), 'pml')
  vib = _losses(str(tmp_path), 'vib')
  assert len(loss) == 20 and np.all(np.isfinite(loss))
  assert np.mean(loss[-5:]) < np.mean(loss[:3])
  # loss = PML + beta * VIB, and no masked copies are made.
  np.testing.assert_allclose(loss, np.asarray(pml) + c.loss.beta
                             * np.asarray(vib), rtol=1e-5)
  assert 'inclusion' not in json.dumps(summary['train'])


@pytest.mark.slow
def test_pcme_sharded_matches_single_device(tmp_path):
  one = micro('pcme', 2, num_devices=1, batch_size=32)
  four = micro('pcme', 2, num_devices=4, batch_size=32)
  train.train_and_evaluate(one, str(tmp_path / 'one'))
  train.train_and_evaluate(four, str(tmp_path / 'four'))
  p1 = _params(str(tmp_path / 'one'))
  p4 = dict(jax.tree_util.tree_flatten_with_path(_params(str(tmp_path /
                                                                'four')))[0])
  for path, ref in jax.tree_util.tree_flatten_with_path(p1)[0]:
    name = jax.tree_util.keystr(path)
    if "['attn']['k']['bias']" in name:  # see test_sharded_train
      assert np.abs(p4[path] - ref).max() <= 2 * 2 * 1e-3, name
      continue
    np.testing.assert_allclose(p4[path], ref, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_objective_lists():
  assert 'pcme' in objectives.OBJECTIVES
  assert 'pcme' in objectives.PROBABILISTIC
  assert 'pcme' not in objectives.MASKED
