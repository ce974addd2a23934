"""Sharded training equals single-device training (issue: pod scale).

The host has 8 CPU devices (conftest). The same global batch trained on a
mesh of 8 devices, with data and FSDP splits, must give the parameters of the
1-device run: the blockwise ring losses and the per-sample terms are exact.
"""

import jax
import numpy as np
import pytest

from prolip_jax.storage import checkpoint
from prolip_jax.training import train

from support import micro_config


def _sharded_config(num_devices, data, fsdp, total_steps=3):
  c = micro_config(total_steps=total_steps)
  c.batch_size = 64  # 8 per device on 8 devices; every 8th sample masked
  c.mesh.num_devices = num_devices
  c.mesh.data = data
  c.mesh.fsdp = fsdp
  # The micro model's weights are all under the default 4 MiB FSDP floor:
  # without this they would stay replicated and FSDP would go untested.
  c.mesh.fsdp_min_size_mb = 0.0
  c.checkpoint_every_steps = 1000
  return c


def _final_params(workdir):
  params, _ = checkpoint.load_params(workdir)
  return jax.tree.map(np.asarray, params)


@pytest.fixture(scope='module')
def single_device_params(tmp_path_factory):
  d = tmp_path_factory.mktemp('one')
  train.train_and_evaluate(_sharded_config(1, 1, 1), str(d))
  return _final_params(str(d))


@pytest.mark.slow
@pytest.mark.parametrize('data,fsdp', [(8, 1), (2, 4)])
def test_sharded_train_step_matches_single_device(single_device_params,
                                                  tmp_path, data, fsdp):
  train.train_and_evaluate(_sharded_config(8, data, fsdp), str(tmp_path))
  sharded = _final_params(str(tmp_path))
  flat_one = jax.tree_util.tree_flatten_with_path(single_device_params)[0]
  flat_many = dict(jax.tree_util.tree_flatten_with_path(sharded)[0])
  for path, ref in flat_one:
    name = jax.tree_util.keystr(path)
    if "['attn']['k']['bias']" in name:
      # The key bias shifts every logit of a query equally, so softmax makes
      # its true gradient exactly zero; Adam rescales the leftover rounding
      # noise into steps of up to lr. Bound it by the summed step sizes.
      assert np.abs(flat_many[path] - ref).max() <= 2 * 3 * 1e-3, name
      continue
    np.testing.assert_allclose(flat_many[path], ref, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_param_spec_rule():
  from prolip_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  P = jax.sharding.PartitionSpec
  assert shd.param_spec((768, 3072), 4) == P(None, 'fsdp')
  assert shd.param_spec((32100, 768), 4) == P('fsdp', None)
  assert shd.param_spec((7, 5), 4) == P()
  assert shd.param_spec((), 4) == P()
  assert shd.param_spec((768, 3072), 1) == P()
  assert shd.mesh_shape({'data': -1, 'fsdp': 2}, 8) == (4, 2)
  with pytest.raises(ValueError, match='cannot be split'):
    shd.mesh_shape({'data': -1, 'fsdp': 3}, 8)
  with pytest.raises(ValueError, match='needs 6 devices'):
    shd.mesh_shape({'data': 2, 'fsdp': 3}, 8)
