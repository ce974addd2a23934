"""Model sizes, presets and the defaults read from one place.

The references are written out here: the four positional tables the size
rows replaced, the L/16 and SO400M/14 configs' models as they were, the
model dataclasses' former B/16 defaults, the papers' loss weights and the
FLOP counts of ``run_flops_per_pair`` before the objectives said which
masked copies count.
"""

import inspect
import os

import pytest

from prolip_jax import demos
from prolip_jax import objectives
from prolip_jax.config import help as config_help
from prolip_jax.config import keys as config_keys
from prolip_jax.config import paper
from prolip_jax.config import presets
from prolip_jax.config import sizes
from prolip_jax.interop import convert
from prolip_jax.losses import otter
from prolip_jax.losses import pcclip
from prolip_jax.losses import probabilistic
from prolip_jax.models import ModelConfig
from prolip_jax.models import TextConfig
from prolip_jax.models import VisionConfig
from prolip_jax.objectives import otter as otter_objective
from prolip_jax.training import mfu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tables presets.py held before the size rows, verbatim.
OLD_VISION = {
    # name: (image_size, patch, width, layers, heads)
    'tiny': (32, 8, 128, 4, 4),
    'B/32': (224, 32, 768, 12, 12),
    'B/16': (224, 16, 768, 12, 12),
    'L/16': (224, 16, 1024, 24, 16),
    'SO400M/14': (224, 14, 1152, 27, 16),
}
OLD_TEXT = {
    # name: (width, layers, heads, context_length, vocab_size)
    'tiny': (128, 3, 4, 32, 256),
    'B/32': (768, 12, 12, 64, 32100),
    'B/16': (768, 12, 12, 64, 32100),
    'L/16': (1024, 24, 16, 64, 32100),
    'SO400M/14': (1152, 27, 16, 16, 32100),
}
OLD_EMBED = {'tiny': 64, 'B/32': 768, 'B/16': 768, 'L/16': 1024,
             'SO400M/14': 1152}
# MLP widths (int(width * mlp_ratio), as the towers build them) and patches.
MLP_WIDTH = {'tiny': (512, 512), 'B/32': (3072, 3072),
             'B/16': (3072, 3072), 'L/16': (4096, 4096),
             'SO400M/14': (4304, 4304)}
NUM_PATCHES = {'tiny': 16, 'B/32': 49, 'B/16': 196, 'L/16': 196,
               'SO400M/14': 256}
# The one change: SO400M/14 takes SigLIP's tanh-approximated GELU (the old
# table left it at the declared 'gelu').
ACT = {'tiny': 'gelu', 'B/32': 'gelu', 'B/16': 'gelu', 'L/16': 'gelu',
       'SO400M/14': 'gelu_tanh'}

ARCHITECTURE_KEYS = {
    'embed_dim', 'vision.image_size', 'vision.patch_size', 'vision.width',
    'vision.layers', 'vision.heads', 'vision.mlp_ratio', 'vision.act',
    'text.vocab_size', 'text.context_length', 'text.width', 'text.layers',
    'text.heads', 'text.mlp_ratio', 'text.act'}

# ModelConfig()'s defaults as the dataclasses wrote them out (ViT-B/16).
B16_DATACLASS_DEFAULTS = {
    'embed_dim': 768, 'use_unc': True, 'release_compat': False,
    'init_logit_scale': 10.0, 'init_logit_bias': -10.0,
    'init_unc_bias': -10.0, 'compute_dtype': 'float32', 'remat': False,
    'remat_policy': 'nothing_saveable', 'scan': False,
    'attention_impl': 'auto', 'attention_logits_dtype': 'float32',
    'vision': {'image_size': 224, 'patch_size': 16, 'width': 768,
               'layers': 12, 'heads': 12, 'mlp_ratio': 4.0, 'act': 'gelu',
               'ln_eps': 1e-5},
    'text': {'vocab_size': 32100, 'context_length': 64, 'width': 768,
             'layers': 12, 'heads': 12, 'mlp_ratio': 4.0, 'act': 'gelu',
             'ln_eps': 1e-6, 'pad_id': 0, 'proj_bias': True, 'pool': 'cls',
             'causal': False},
}


def _run_model(width, layers, heads, context, embed, mlp_ratio=4.0,
               act='gelu', patch=16):
  """``config.model`` of the B/16 recipe at another size, as
  configs/prolip_l16.py and prolip_so400m14.py built it before: the preset,
  then bf16, remat, scan and the SigLIP pad id (remat and scan set by the
  larger configs themselves since B/16 dropped both)."""
  tower = {'width': width, 'layers': layers, 'heads': heads,
           'mlp_ratio': mlp_ratio, 'act': act}
  return {
      'attention_impl': 'auto', 'attention_logits_dtype': 'float32',
      'compute_dtype': 'bfloat16',
      'embed_dim': embed, 'init_logit_bias': -10.0, 'init_logit_scale': 10.0,
      'init_unc_bias': -10.0, 'release_compat': False, 'remat': True,
      'remat_policy': 'nothing_saveable', 'scan': True, 'use_unc': True,
      'text': dict(tower, causal=False, context_length=context, ln_eps=1e-6,
                   pad_id=1, pool='cls', proj_bias=True, vocab_size=32100),
      'vision': dict(tower, image_size=224, ln_eps=1e-5, patch_size=patch),
  }


@pytest.mark.parametrize('name', sorted(OLD_VISION))
def test_every_size_row_builds_the_old_tables_model(name):
  for use_unc in (True, False):
    m = ModelConfig.from_config(presets.model_preset(name, use_unc=use_unc))
    assert m.use_unc is use_unc
    assert (m.vision.image_size, m.vision.patch_size, m.vision.width,
            m.vision.layers, m.vision.heads) == OLD_VISION[name]
    assert (m.text.width, m.text.layers, m.text.heads, m.text.context_length,
            m.text.vocab_size) == OLD_TEXT[name]
    assert m.embed_dim == OLD_EMBED[name]
    assert (int(m.vision.width * m.vision.mlp_ratio),
            int(m.text.width * m.text.mlp_ratio)) == MLP_WIDTH[name]
    assert m.num_patches == NUM_PATCHES[name]
    assert (m.vision.act, m.text.act) == (ACT[name], ACT[name])
  # Everything but the size is the declared default.
  flat = config_help.flatten(presets.model_preset(name))
  for key, value in flat.items():
    if key not in ARCHITECTURE_KEYS:
      assert value == config_keys.default('model.' + key), key


def test_so400m_mlp_ratio_is_the_old_tables_float():
  so400m = presets.model_preset('SO400M/14')
  assert so400m.vision.mlp_ratio == 4304 / 1152 == so400m.text.mlp_ratio


def test_model_size_sets_the_architecture_only():
  assert set(sizes.SIZES) == set(OLD_VISION)
  for name in sizes.SIZES:
    assert set(config_help.flatten(presets.model_size(name))) == (
        ARCHITECTURE_KEYS)
  with pytest.raises(ValueError, match='unknown model size'):
    presets.model_size('B/17')
  with pytest.raises(ValueError, match='unknown model preset'):
    presets.model_preset('B/17')
  # Laid over the B/16 config's model: the run settings stay.
  c = presets.load_config_file(os.path.join(REPO, 'configs', 'prolip_b16.py'))
  before = config_help.flatten(c.model)
  c.model.update(presets.model_size('L/16'))
  after = config_help.flatten(c.model)
  changed = {k for k in after if after[k] != before[k]}
  assert changed == {'embed_dim', 'vision.width', 'vision.layers',
                     'vision.heads', 'text.width', 'text.layers',
                     'text.heads'}
  # B/16 runs without remat and unrolled (docs/scaling.md, "Remat policies
  # for B/16"); L/16 and SO400M/14 set remat and scan back themselves.
  assert (after['compute_dtype'], after['remat'], after['scan'],
          after['text.pad_id']) == ('bfloat16', False, False, 1)


def test_the_declared_model_defaults_are_the_tiny_row():
  tiny = sizes.SIZES['tiny']
  assert config_keys.default('model.vision.width') == tiny.vision.width == 128
  assert config_keys.default('model.text.layers') == tiny.text.layers == 3
  assert config_keys.default('model.embed_dim') == tiny.embed_dim == 64
  assert presets.base_config().model == presets.model_preset('tiny')


@pytest.mark.parametrize('config_file,model', [
    ('prolip_l16.py', _run_model(1024, 24, 16, 64, 1024)),
    # As before but for the activation: SigLIP's tanh-approximated GELU.
    ('prolip_so400m14.py', _run_model(1152, 27, 16, 16, 1152,
                                      mlp_ratio=4304 / 1152, act='gelu_tanh',
                                      patch=14)),
])
def test_larger_configs_are_the_b16_recipe_at_their_size(config_file, model):
  got = presets.load_config_file(
      os.path.join(REPO, 'configs', config_file)).to_dict()
  b16 = presets.load_config_file(
      os.path.join(REPO, 'configs', 'prolip_b16.py')).to_dict()
  assert got.pop('model') == model
  b16.pop('model')
  assert got == b16


def test_model_dataclass_defaults_are_b16_from_the_declarations():
  assert ModelConfig().to_dict() == B16_DATACLASS_DEFAULTS
  assert ModelConfig() == ModelConfig.from_config(presets.model_preset('B/16'))
  assert convert.model_dict({}) == B16_DATACLASS_DEFAULTS
  # Partial configs fill in the same defaults.
  assert ModelConfig(vision=VisionConfig(layers=2)).vision.width == 768
  assert TextConfig(width=48).context_length == 64


def test_loss_defaults_are_the_papers_numbers_written_once():
  papers = {'loss.alpha1': 1e-7, 'loss.alpha2': 1e-3, 'loss.beta': 1e-4,
            'loss.c': 1000.0, 'loss.eps': -20.0, 'loss.otter.alpha': 0.5,
            'loss.otter.lam': 0.15, 'loss.otter.n_iter': 5,
            'loss.otter.gamma_v': 1.0, 'loss.otter.gamma_t': 1.0,
            'loss.otter.eta': 100.0, 'loss.pcclip_tau': 1.0}
  for key, value in papers.items():
    assert config_keys.default(key) == value, key

  def default(fn, arg):
    return inspect.signature(fn).parameters[arg].default

  for fn in (probabilistic.prolip_loss, probabilistic.prolip_loss_blockwise):
    for arg in ('alpha1', 'alpha2', 'beta', 'c', 'eps'):
      assert default(fn, arg) == papers['loss.' + arg], (fn, arg)
  for fn in (otter.otter_loss, otter.otter_loss_blockwise):
    for arg in ('alpha', 'lam', 'n_iter', 'gamma_v', 'gamma_t', 'eta'):
      assert default(fn, arg) == papers['loss.otter.' + arg], (fn, arg)
  assert default(pcclip.difference_alignment_loss, 'scale') == (
      1 / papers['loss.pcclip_tau'])
  # OTTER's teacher decay is the run's optim.ema_decay: the paper's value
  # is cited by OTTER's refusal of a run without one.
  without = demos.tiny_demo_config('otter')
  without.optim.ema_decay = 0.0
  with pytest.raises(ValueError, match=r'optim.ema_decay.*the paper: 0.999'):
    otter_objective.OTTERObjective().validate(without)
  pcme = demos.tiny_demo_config('pcme').model
  assert (pcme.init_logit_scale, pcme.init_logit_bias) == (5.0, 5.0) == (
      paper.PCME_SCALE_INIT, paper.PCME_BIAS_INIT)


# run_flops_per_pair of the shipped configs before the objectives said which
# masked copies count (forward, masked_forward, train FLOPs per pair).
OLD_FLOPS = {
    ('prolip_b16.py', 'prolip'): (46687223808, 2524211712, 147634306560),
    ('prolip_b16.py', 'siglip'): (46687223808, 0, 140061671424),
    ('prolip_l16.py', 'prolip'): (164049453056, 8929374208, 518936481792),
    ('prolip_so400m14.py', 'prolip'): (235590266880, 8717428224,
                                       732923085312),
    ('prolip_so400m14.py', 'otter'): (235590266880, 0, 706770800640),
}


@pytest.mark.parametrize('config_file,objective', sorted(OLD_FLOPS))
def test_run_flops_count_the_masked_copies_the_objective_makes(
    config_file, objective):
  c = presets.load_config_file(os.path.join(REPO, 'configs', config_file))
  c.objective = objective
  got = mfu.run_flops_per_pair(c, ModelConfig.from_config(c.model).to_dict(),
                               objectives.get(objective))
  assert (got['forward'], got['masked_forward'], got['train']) == (
      OLD_FLOPS[config_file, objective])


def test_only_prolip_makes_masked_copies():
  c = presets.load_config_file(os.path.join(REPO, 'configs', 'prolip_b16.py'))
  for name in objectives.OBJECTIVES:
    copies = objectives.get(name).masked_copies(c)
    if name == 'prolip':
      assert copies == {'fraction': 0.125, 'image_keep_ratio': 0.25,
                        'text_mask_prob': 0.75}
    else:
      assert copies is None, name
