"""The contributor recipes of docs/architecture.md, each done once.

A new evaluator kind is one file (its metric labels in it) and a config
entry; a new data source is one file and a config entry; a new model size
is one row of ``config/sizes.py``; a new objective is a loss file, an
objective file and a config. Each file is written here into a folder appended to its
package's ``__path__``, as a contributor would add it to the package.
"""

import functools
import json
import os
import sys

import jax
import ml_collections
import numpy as np
import pytest

from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.config import presets
from prolip_jax.config import sizes
from prolip_jax.data import digits
from prolip_jax.data import sources
from prolip_jax.data.sources import digits as digits_source
from prolip_jax.evaluation import encoders as encoders_lib
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import kinds
from prolip_jax.evaluation import report
from prolip_jax.evaluation import sets
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
from prolip_jax.evaluation import report
from prolip_jax.evaluation import sets


class Evaluator(evaluator.Evaluator):
  """``scale`` times the mean of exp(logvar) over the images."""

  OPTIONS = {'scale': 1.0}
  LABELS = (report.Label(r'sigma2', 'scaled mean sigma^2 per dimension',
                         report.number),)

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
  images = digits_source.digits_data('heldout', per_class=3).images
  _, logvar = model.encode_image(images)
  np.testing.assert_allclose(result.metrics['sigma2'],
                             2.0 * np.exp(logvar).mean(), rtol=1e-5)
  with open(tmp_path / 'out' / 's2.json', encoding='utf-8') as f:
    assert json.load(f)['details']['images'] == 30
  # The label it declares is the report's, in the printed table and in
  # the summary; a kind without labels would print the raw key.
  value = result.metrics['sigma2']
  assert 0.01 <= value < 1e4  # shown plainly with 3 significant digits
  table = report.format_table({'s2/sigma2': value}, notes=False,
                              kinds={'s2': 'mean_sigma2'})
  assert table.splitlines()[-1] == (
      f'{"s2":5s}  scaled mean sigma^2 per dimension  {value:.3g}')
  assert report.describe('mean_sigma2', 'other', 0.5) == ('other', '0.5')


SOURCE_FILE = """
\"\"\"``stripes``: synthetic images of 1-4 white vertical stripes, each
captioned with its count.\"\"\"

import numpy as np

from prolip_jax.config.keys import DATA
from prolip_jax.config.keys import Key
from prolip_jax.data.sources import base
from prolip_jax.data.sources import views

NAMES = ('one', 'two', 'three', 'four')


def draw(count, size):
  \"\"\"``count`` white stripes, one eighth of the side wide, on black.\"\"\"
  image = np.zeros((size, size, 3), np.uint8)
  width = size // 8
  for k in range(count):
    image[:, 2 * k * width:(2 * k + 1) * width] = 255
  return image


class StripesSource(base.Source):
  \"\"\"Training records and a zero-shot set (``stripes:SIZE``).\"\"\"

  name = 'stripes'
  KEYS = {'stripes_size': Key(32, 'stripes: image side in pixels', DATA),
          'stripes_per_count': Key(8, 'stripes: images of each count',
                                   DATA)}

  def train_records(self, config, data, where):
    size = int(self.value(data, 'stripes_size'))
    n = 4 * int(self.value(data, 'stripes_per_count'))
    records = [{'image': draw(1 + i % 4, size),
                'caption': f'{NAMES[i % 4]} stripes'} for i in range(n)]
    return records, lambda: [r['caption'] for r in records]

  def zero_shot_set(self, rest, cfg):
    images = [draw(count, int(rest or 32)) for count in (1, 2, 3, 4)]
    return views.ZeroShotSet(
        views.ImageSet(f'stripes-{rest}', 4, lambda i: (images[i], i)),
        NAMES, base.template_choice(cfg.templates, ('{} stripes',)))
"""


def _stripes_in(image: np.ndarray) -> int:
  """The white stripes crossing the image's first row."""
  row = image[0, :, 0] > 127
  return int(row[0]) + int(np.sum(row[1:] & ~row[:-1]))


def test_a_new_source_is_one_file_and_a_config_entry(workdir, tmp_path,
                                                     monkeypatch):  # pylint: disable=redefined-outer-name
  _add_to_package(monkeypatch, sources, tmp_path / 'sources',
                  {'stripes': SOURCE_FILE})
  assert 'stripes' in sources.names('train')
  assert 'stripes' in sources.names('zero_shot')
  assert 'stripes' not in sources.names('retrieval')
  # Training reads it by its name, with its own key (or its default).
  config = ml_collections.ConfigDict({'data': {'name': 'stripes',
                                               'stripes_per_count': 2}})
  records, corpus = sources.train_source(config)
  names = ('one', 'two', 'three', 'four')
  assert len(records) == 8
  for r in records:  # each image shows the count its caption says
    assert r['image'].shape == (32, 32, 3)
    assert r['caption'] == f'{names[_stripes_in(r["image"]) - 1]} stripes'
  assert corpus() == [r['caption'] for r in records]
  del config.data.stripes_per_count
  assert len(sources.train_source(config)[0]) == 4 * 8
  with pytest.raises(errors.ConfigError, match="did you mean 'stripes'"):
    sources.train_source(ml_collections.ConfigDict({'data': {
        'name': 'stripe'}}))
  # A mixture entry may set its keys for itself.
  config = ml_collections.ConfigDict({'data': {
      'name': 'digits', 'sources': {
          'lines': {'name': 'stripes', 'weight': 1.0, 'stripes_size': 16,
                    'stripes_per_count': 1},
          'mnist': {'name': 'digits', 'weight': 1.0, 'split': 'val'}}}})
  mixed, _ = sources.train_source(config)
  assert mixed.labels == ('lines', 'mnist')
  assert [_stripes_in(r['image']) for r in mixed.sources[0]] == [1, 2, 3, 4]
  assert mixed.sources[0][0]['image'].shape == (16, 16, 3)
  assert len(mixed.sources[1]) == len(digits.split('val')[1])
  # Evaluation reads it by the same name: a zero-shot entry scored as the
  # loaded model's own classifier scores the same images.
  evals = {'lines': {'kind': 'zero_shot', 'data': 'stripes:24',
                     'batch_size': 4, 'templates': ('{} stripes',)}}
  model = load_lib.load(workdir)
  encoders = encoders_lib.from_loaded(
      model, shd.make_mesh({'data': -1, 'fsdp': 1}))
  (e,) = evaluator.build(evals, encoders)
  zs = sets.zero_shot_set(e.cfg)
  images = [zs.images.get(i)[0] for i in range(zs.images.size)]
  assert [_stripes_in(x) for x in images] == [1, 2, 3, 4]
  assert [zs.images.get(i)[1] for i in range(4)] == [0, 1, 2, 3]
  result = e.run(model.params, '', log=lambda _: None)
  classifier = model.zero_shot_classifier(names, ('{} stripes',))
  for metric in ('csd', 'cosine'):
    assert result.metrics[f'{metric}_top1'] == pytest.approx(np.mean(
        classifier.predict(images, metric) == np.arange(4)))


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


@pytest.mark.slow
def test_a_new_source_trains_as_a_shipped_one_on_the_same_records(
    tmp_path, monkeypatch):
  _add_to_package(monkeypatch, sources, tmp_path / 'sources',
                  {'stripes': SOURCE_FILE})
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = presets.load_config_file(
      os.path.join(repo, 'configs', 'prolip_micro.py'))
  config.data.name = 'stripes'
  config.data.stripes_per_count = 8
  config.total_steps = 3
  config.mesh.num_devices = 1
  config.evals = {}
  train.train_and_evaluate(config, str(tmp_path / 'stripes'))
  # Independent: the same records served by the shipped digits source.
  records, corpus = sources.train_source(config)
  monkeypatch.setattr(digits, 'records', lambda split, captions: records)
  monkeypatch.setattr(digits, 'tokenizer_corpus', lambda captions: corpus())
  config.data.name = 'digits'
  train.train_and_evaluate(config, str(tmp_path / 'digits'))
  mine, shipped = _losses(tmp_path / 'stripes'), _losses(tmp_path / 'digits')
  assert len(mine) == 3
  np.testing.assert_allclose(mine, shipped, rtol=1e-6)
