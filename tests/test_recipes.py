"""The contributor recipes of docs/architecture.md, each done once.

A new evaluator kind is one file and a config entry; a new model size is
one row of ``config/sizes.py``; a new objective is a loss file, an objective
file and a config. Each file is written here into a folder appended to its
package's ``__path__``, as a contributor would add it to the package.
"""

import functools
import json
import os
import sys

import jax
import numpy as np
import pytest

from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.config import presets
from prolip_jax.config import sizes
from prolip_jax.evaluation import bundled
from prolip_jax.evaluation import encoders as encoders_lib
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import kinds
from prolip_jax.interop import load as load_lib
from prolip_jax import losses
from prolip_jax.models import count_params
from prolip_jax.models import init_params
from prolip_jax.models import ModelConfig
from prolip_jax.training import train

KIND_FILE = '''
"""``mean_sigma2``: the mean sigma^2 per dimension of a set's images."""

import numpy as np

from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import sets


class Evaluator(evaluator.Evaluator):
  """``scale`` times the mean of exp(logvar) over the images."""

  OPTIONS = {'scale': 1.0}

  def evaluate(self, params):
    images = self.opened(sets.zero_shot_set).images
    emb = self.embed_images(params, images)
    value = float(self.cfg.scale * np.exp(emb.logvar).mean())
    return evaluator.Result({'sigma2': value}, {'images': images.size})
'''


def _add_to_package(monkeypatch, package, folder, files: dict[str, str]):
  """Writes ``files`` ({module: source}) into ``folder`` and appends it to
  ``package.__path__``; the modules are forgotten afterwards."""
  os.makedirs(folder, exist_ok=True)
  for name, source in files.items():
    with open(os.path.join(folder, f'{name}.py'), 'w', encoding='utf-8') as f:
      f.write(source)
    monkeypatch.delitem(sys.modules, f'{package.__name__}.{name}',
                        raising=False)
  monkeypatch.setattr(package, '__path__', [*package.__path__, str(folder)])


def test_a_new_evaluator_kind_is_one_file_and_a_config_entry(
    workdir, tmp_path, monkeypatch):  # pylint: disable=redefined-outer-name
  _add_to_package(monkeypatch, kinds, tmp_path / 'kinds',
                  {'mean_sigma2': KIND_FILE})
  assert 'mean_sigma2' in evaluator.kind_names()
  # The config entry, checked as any other (its own key included).
  evals = {'s2': {'kind': 'mean_sigma2', 'data': 'digits:heldout',
                  'per_class': 3, 'scale': 2.0, 'batch_size': 8}}
  model = load_lib.load(workdir)
  encoders = encoders_lib.from_loaded(
      model, shd.make_mesh({'data': -1, 'fsdp': 1}))
  (e,) = evaluator.build(evals, encoders)
  result = e.run(model.params, str(tmp_path / 'out'), log=lambda _: None)
  # Independent: the loaded model's own host path over the same images.
  images = bundled.digits_data('heldout', per_class=3).images
  _, logvar = model.encode_image(images)
  np.testing.assert_allclose(result.metrics['sigma2'],
                             2.0 * np.exp(logvar).mean(), rtol=1e-5)
  with open(tmp_path / 'out' / 's2.json', encoding='utf-8') as f:
    assert json.load(f)['details']['images'] == 30


def test_a_new_model_size_is_one_row(monkeypatch):
  row = sizes.Size(image_size=48, patch_size=12,
                   vision=sizes.Tower(64, 2, 2), context_length=20,
                   vocab_size=300, text=sizes.Tower(48, 2, 3, act='gelu_tanh'),
                   embed_dim=24)
  monkeypatch.setitem(sizes.SIZES, 'S/12', row)
  from_row = ModelConfig.from_config(presets.model_preset('S/12'))
  # Independent: the same sizes set field by field on the tiny preset.
  by_hand = presets.model_preset('tiny')
  by_hand.vision.update(image_size=48, patch_size=12, width=64, layers=2,
                        heads=2)
  by_hand.text.update(context_length=20, vocab_size=300, width=48, layers=2,
                      heads=3, act='gelu_tanh')
  by_hand.embed_dim = 24
  by_hand = ModelConfig.from_config(by_hand)
  assert from_row == by_hand
  assert from_row.num_patches == 16
  shapes = jax.eval_shape(functools.partial(init_params, from_row),
                          jax.random.key(0))
  assert count_params(shapes) == count_params(jax.eval_shape(
      functools.partial(init_params, by_hand), jax.random.key(0)))


LOSS_FILE = '''
"""The pairwise sigmoid loss written out (a recipe's loss file)."""

import jax
import jax.numpy as jnp


def pair_sigmoid_loss(img, txt, scale, bias):
  """Mean over images of the sum over captions of -log sigmoid(z * logit),
  z = +1 for the matching pair and -1 otherwise."""
  logits = scale * img @ txt.T + bias
  z = 2.0 * jnp.eye(img.shape[0]) - 1.0
  return -jnp.sum(jax.nn.log_sigmoid(z * logits)) / img.shape[0]
'''

OBJECTIVE_FILE = '''
"""A recipe's objective: the pairwise sigmoid loss over the means."""

from prolip_jax.losses.recipe_sigmoid import pair_sigmoid_loss
from prolip_jax.objectives.base import Objective


class RecipeSigmoidObjective(Objective):
  """Dense only: a split batch is refused by its ``validate``."""

  name = 'recipe_sigmoid'

  def validate(self, config):
    super().validate(config)
    if config.mesh.num_devices != 1:
      raise ValueError('recipe_sigmoid runs on one device')

  def local_loss(self, loss_cfg, axis_name=None):
    del loss_cfg, axis_name

    def loss_fn(img, txt, scale, bias, *_):
      loss = pair_sigmoid_loss(img.mu, txt.mu, scale, bias)
      return loss, {'loss': loss}
    return loss_fn
'''

CONFIG_FILE = '''
"""The recipe's objective on the micro towers."""

import os

from prolip_jax.config import presets

MICRO = os.path.join({repo!r}, 'configs', 'prolip_micro.py')


def get_config():
  c = presets.load_config_file(MICRO)
  c.objective = 'recipe_sigmoid'
  c.model.use_unc = False
  c.total_steps = 3
  c.log_every_steps = 1
  c.mesh.num_devices = 1
  c.evals = {{}}
  return c
'''


def _losses(path):
  with open(os.path.join(path, 'metrics.jsonl'), encoding='utf-8') as f:
    return [r['loss'] for r in map(json.loads, f) if 'loss' in r]


@pytest.mark.slow
def test_a_new_objective_is_three_files(tmp_path, monkeypatch):
  _add_to_package(monkeypatch, losses, tmp_path / 'losses',
                  {'recipe_sigmoid': LOSS_FILE})
  _add_to_package(monkeypatch, objectives, tmp_path / 'objectives',
                  {'recipe_sigmoid': OBJECTIVE_FILE})
  registry = objectives.discover()  # what importing the package does
  assert 'recipe_sigmoid' in registry
  monkeypatch.setattr(objectives, 'REGISTRY', registry)
  monkeypatch.setattr(objectives, 'OBJECTIVES', tuple(registry))
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config_file = tmp_path / 'recipe_sigmoid_micro.py'
  config_file.write_text(CONFIG_FILE.format(repo=repo))
  config = presets.load_config_file(str(config_file))
  train.train_and_evaluate(config, str(tmp_path / 'recipe'))
  # Independent: the shipped SigLIP objective on the same run.
  config.objective = 'siglip'
  train.train_and_evaluate(config, str(tmp_path / 'siglip'))
  mine, siglip = _losses(tmp_path / 'recipe'), _losses(tmp_path / 'siglip')
  assert len(mine) == 3
  np.testing.assert_allclose(mine, siglip, rtol=1e-5)
