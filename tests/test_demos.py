"""The CPU demos' configs (``prolip_jax/demos.py``): every objective's demo
configs hold exactly the values they held when ``presets`` built them by
branching on the objective's name; a new objective gets them from its own
declarations; the demos name no objective."""

import ast
import os

import ml_collections
import pytest

from prolip_jax import demos
from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax.config import help as config_help
from prolip_jax.config import keys as config_keys
from prolip_jax.config import presets

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each demo set over the config it started from (base_config for the
# tiny demo, the tiny demo for the emoji demo, the emoji demo for the
# study), read off presets.tiny_demo_config, emoji_demo_config and
# emoji_study_config of commit 21d5e82, the last that branched on names.
# Each objective's own values are laid over the shared ones.
SNAPSHOT_SHARED = {
    'tiny': {
        'batch_size': 128, 'total_steps': 600, 'optim.lr': 0.001,
        'optim.warmup_steps': 60, 'optim.weight_decay': 0.05,
        'data.name': 'digits', 'data.mean': (0.5, 0.5, 0.5),
        'data.std': (0.5, 0.5, 0.5), 'data.jitter_prob': 0.0,
        'data.grayscale_prob': 0.0, 'log_every_steps': 25,
        'checkpoint_every_steps': 200, 'evals.eval.kind': 'heldout',
        'evals.eval.every_steps': 300},
    'emoji': {
        'data.name': 'emoji', 'data.jitter_prob': 0.0,
        'data.grayscale_prob': 0.0, 'tokenizer.vocab_size': 1024,
        'model.text.vocab_size': 1024},
    'emoji_study': {
        'data.captions': 'paraphrases', 'data.split': 'fit',
        'total_steps': 1800, 'optim.warmup_steps': 180},
}
SNAPSHOT_OWN = {
    'tiny': {
        'clip': {'objective': 'clip', 'model.use_unc': False,
                 'model.init_logit_scale': 14.285714285714285},
        'otter': {'objective': 'otter', 'model.use_unc': False,
                  'model.init_logit_scale': 14.285714285714285,
                  'optim.ema_decay': 0.99},
        'pcclip': {'objective': 'pcclip', 'model.use_unc': False,
                   'model.init_logit_scale': 14.285714285714285,
                   'loss.pcclip_weight': 1.0, 'loss.pcclip_tau': 1.0,
                   'loss.pcclip_squared': False,
                   'loss.pcclip_max_phrases': 1},
        'pcme': {'objective': 'pcme', 'model.use_unc': True,
                 'model.init_logit_scale': 5.0, 'model.init_logit_bias': 5.0},
        'prolip': {'objective': 'prolip', 'model.use_unc': True,
                   'optim.unc_lr_mult': 10.0, 'loss.beta': 0.1,
                   'loss.alpha1': 0.001},
        'siglip': {'objective': 'siglip', 'model.use_unc': False},
        'uniclip': {'objective': 'uniclip', 'model.use_unc': False,
                    'data.num_views': 3, 'data.crop_scale': (0.6, 1.0),
                    'data.jitter': (0.4, 0.4, 0.0, 0.0),
                    'data.jitter_prob': 0.8, 'loss.mp_nce_weights': 'balanced',
                    'uniclip.embed_dim': 0, 'uniclip.num_blocks': 3,
                    'uniclip.mlp_ratio': 2.0, 'uniclip.aug_features': 64,
                    'uniclip.aug_hidden': 64, 'uniclip.use_aug': True,
                    'uniclip.init_tau': 0.07, 'uniclip.init_offset': 0.0},
    },
    'emoji': {
        'prolip': {'optim.unc_lr_mult': 10.0, 'loss.beta': 0.3,
                   'loss.alpha1': 0.001},
    },
    'emoji_study': {
        'prolip': {'loss.beta': 0.1},
    },
}
BUILDERS = {'tiny': demos.tiny_demo_config, 'emoji': demos.emoji_demo_config,
            'emoji_study': demos.emoji_study_config}


def _snapshot(demo: str, objective: str) -> dict:
  """The flattened config ``demo`` of ``objective`` gave at the snapshot."""
  flat = {k: v for k, v in config_help.flatten(presets.base_config()).items()
          if k != 'evals'}  # {} in base_config, the held-out entry here
  for d in demos.DEMOS[:demos.DEMOS.index(demo) + 1]:
    flat.update(SNAPSHOT_SHARED[d])
    flat.update(SNAPSHOT_OWN[d].get(objective, {}))
  return flat


@pytest.mark.parametrize('demo', demos.DEMOS)
@pytest.mark.parametrize('objective', sorted(SNAPSHOT_OWN['tiny']))
def test_every_demo_config_holds_its_snapshot_values(objective, demo):
  assert objective in objectives.OBJECTIVES
  got = config_help.flatten(BUILDERS[demo](objective))
  assert got == _snapshot(demo, objective)


def test_the_default_objective_is_the_declared_one():
  assert demos.DEFAULT_OBJECTIVE == config_keys.default('objective')
  for demo, build in BUILDERS.items():
    assert config_help.flatten(build()) == config_help.flatten(
        build(config_keys.default('objective'))), demo


class _NewObjective(objectives.Objective):
  """An objective the demos have never heard of: [UNC] towers, a key of its
  own and a setting per demo."""

  name = 'new_here'
  needs_unc = True
  demo_settings = {'tiny': {'optim.lr': 0.002, 'loss.new_here_weight': 3.0},
                   'emoji_study': {'optim.b2': 0.99}}

  def local_loss(self, loss_cfg, axis_name=None):
    raise NotImplementedError


def test_a_new_objective_gets_the_demos_from_its_declarations(monkeypatch):
  monkeypatch.setitem(objectives.REGISTRY, 'new_here', _NewObjective())
  monkeypatch.setitem(config_keys.KEYS, 'loss.new_here_weight', config_keys.Key(
      1.0, 'the new objective: its weight', added_by='new_here'))
  for demo, build in BUILDERS.items():
    got = config_help.flatten(build('new_here'))
    # Independent: the snapshot of an objective with no settings of its
    # own (SigLIP's), with what the new one declares written out here.
    want = dict(_snapshot(demo, 'siglip'), objective='new_here')
    want.update({'model.use_unc': True, 'optim.lr': 0.002,
                 'loss.new_here_weight': 3.0})
    if demo == 'emoji_study':
      want['optim.b2'] = 0.99
    assert got == want, demo


def test_declared_demo_settings_name_demos_and_declared_keys():
  for name in objectives.OBJECTIVES:
    settings = objectives.get(name).demo_settings
    assert set(settings) <= set(demos.DEMOS), name
    for demo, values in settings.items():
      undeclared = [k for k in values if config_keys.declaration(k) is None]
      assert not undeclared, (name, demo, undeclared)


def test_apply_refuses_an_undeclared_key_and_unknown_objectives_are_one_line():
  config = presets.base_config()
  with pytest.raises(KeyError, match='optim.lrr'):
    demos.apply(config, {'optim.lrr': 1.0})
  demos.apply(config, {'optim.lr': 0.25})
  assert config.optim.lr == 0.25
  with pytest.raises(errors.ConfigError, match="unknown objective 'sigclip'"):
    demos.tiny_demo_config('sigclip')
  assert isinstance(demos.emoji_demo_config(), ml_collections.ConfigDict)


@pytest.mark.parametrize('path', ['prolip_jax/demos.py',
                                  'prolip_jax/registries.py',
                                  'prolip_jax/config/presets.py',
                                  'prolip_jax/config/help.py'])
def test_the_demos_and_the_config_help_name_no_objective(path):
  with open(os.path.join(PACKAGE, path), encoding='utf-8') as f:
    tree = ast.parse(f.read())
  strings = {n.value for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str)}
  assert not strings & set(objectives.OBJECTIVES), path
