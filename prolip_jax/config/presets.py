"""Model presets and the base config as ``ConfigDict``s.

A model is a size and run settings. The sizes are the rows of
``sizes.SIZES`` (architecture only: ``tiny``, ``B/32``, ``B/16``, ``L/16``,
``SO400M/14``); the run settings (dtype, remat, scan, pad id, ...) are the
declared ``model.*`` defaults of ``config_keys.KEYS``, which a config file
overrides. ``model_preset('B/16')`` is the paper's ProLIP ViT-B/16: 224px,
patch 16, 12x768 image and text towers, 12 heads, context 64, embedding 768,
vocabulary 32,100 (the SigLIP sentencepiece model); ``model_size('L/16')``
the L/16 row alone, to lay over another config's model.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from prolip_jax.config import keys as config_keys
from prolip_jax.config import paper
from prolip_jax.config import sizes


def model_size(name: str) -> ml_collections.ConfigDict:
  """The architecture fields of the named size (``sizes.SIZES``) as a
  ``config.model`` update: ``c.model.update(model_size('L/16'))`` makes
  ``c``'s model L/16 and keeps its run settings (dtype, remat, scan, pad
  id, use_unc, ...)."""
  if name not in sizes.SIZES:
    raise ValueError(f'unknown model size {name!r}; have '
                     f'{sorted(sizes.SIZES)}')
  return ml_collections.ConfigDict(sizes.SIZES[name].to_dict())


def model_preset(name: str, use_unc: bool = True) -> ml_collections.ConfigDict:
  """The model config of a named size (``tiny``, ``B/32``, ``B/16``,
  ``L/16``, ``SO400M/14``): the declared ``model.*`` defaults
  (``config_keys.KEYS``) with the size's row (``model_size``) laid over
  them."""
  if name not in sizes.SIZES:
    raise ValueError(f'unknown model preset {name!r}; have '
                     f'{sorted(sizes.SIZES)}')
  c = config_keys.nested({k[len('model.'):]: v for k, v in
                          config_keys.defaults('model.').items()})
  c.update(model_size(name))
  c.use_unc = use_unc
  return c


def base_config() -> ml_collections.ConfigDict:
  """Run settings shared by every config, each at its declared default
  (``config_keys.KEYS``); each config file overrides some."""
  return config_keys.nested(config_keys.defaults())


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file such as ``configs/prolip_tiny.py``."""
  spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f'cannot load a config from {path!r}')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, 'get_config', None)):
    raise AttributeError(f'{path!r} defines no get_config()')
  config = module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise TypeError(f'get_config() of {path!r} returned a '
                    f'{type(config).__name__}, not an '
                    'ml_collections.ConfigDict')
  return config


def heldout_evals(every_steps: int = 0) -> dict:
  """``config.evals`` of the demos: the held-out evaluation of the bundled
  set they train on (``kind='heldout'``, metrics ``eval/...``), every
  ``every_steps`` steps and at the end. ``python -m prolip_jax.evaluate``
  adds the set's bundled report (``configs/eval/<set>.py``)."""
  return {'eval': {'kind': 'heldout', 'every_steps': every_steps}}


def benchmark_evals(every_steps: int = 5000, batch_size: int = 1024,
                    probabilistic: bool = True) -> dict:
  """``config.evals`` of the pre-training configs: ImageNet-1k zero-shot
  (80 templates, CSD and cosine), ImageNet-v2, COCO 5k retrieval (Karpathy
  test split) and, for probabilistic models, the uncertainty summary on
  COCO; every ``every_steps`` steps and at the end. TFDS data sets that are
  not prepared are reported in one line at the start and skipped; set
  ``--config.evals.<name>.data_dir`` to where ``tfds build`` put them."""
  common = {'every_steps': every_steps, 'batch_size': batch_size}
  evals = {
      'imagenet': {'kind': 'zero_shot', 'data': 'tfds:imagenet2012:validation',
                   'templates': 'imagenet', **common},
      'imagenet_v2': {'kind': 'zero_shot', 'data': 'tfds:imagenet_v2:test',
                      'templates': 'imagenet', **common},
      'coco': {'kind': 'retrieval', 'data': 'tfds:coco_captions:test',
               **common},
  }
  if probabilistic:
    evals['uncertainty'] = {'kind': 'uncertainty',
                            'data': 'tfds:coco_captions:test', **common}
  return evals


def short_run_uncertainty(c: ml_collections.ConfigDict, beta: float = 0.3
                          ) -> ml_collections.ConfigDict:
  """Knobs under which ProLIP's sigma^2 trains in a few hundred steps.

  The paper's weights are tuned for 1.28B samples: in 600 steps Adam moves
  the [UNC] heads by about 0.3 in log sigma^2, VIB (beta = 1e-4) and
  L_inc(v ⊂ t) (alpha1 = 1e-7) are invisible, and PPCL shrinks every
  caption's sigma^2. A 10x learning rate for the uncertainty parameters, a
  VIB weight that balances PPCL at sigma^2 ~ 1e-3..1e-2 per dimension and a
  visible image ⊂ text inclusion term let general captions end up more
  uncertain than specific ones. Chosen on validation splits carved from
  training; docs/small_scale_uncertainty.md has every setting tried.
  """
  c.optim.unc_lr_mult = 10.0
  c.loss.beta = beta
  c.loss.alpha1 = 1e-3
  return c


def tiny_demo_config(objective: str = 'prolip') -> ml_collections.ConfigDict:
  """The CPU demo on the bundled MNIST digits, for any objective.

  Deterministic objectives ('siglip', 'clip', 'otter', 'uniclip', 'pcclip')
  get towers without [UNC]; set ``model.use_unc`` for OTTER's probabilistic
  (CSD-logit) variant.
  """
  c = base_config()
  c.objective = objective
  c.model = model_preset('tiny', use_unc=objective in ('prolip', 'pcme'))
  if objective in ('clip', 'otter', 'pcclip'):
    c.model.init_logit_scale = 1 / 0.07  # CLIP's temperature init
  if objective == 'pcclip':
    # PC-CLIP (Sam et al.): CLIP + weight * eq. 1 over difference pairs,
    # tau = 1 (appendix C.1). One differing attribute per T_ij (the declared
    # default): with the 256-piece demo tokenizer one phrase is 15-26 tokens,
    # and two would not fit the 32-token context.
    config_keys.add(c, 'pcclip')
  if objective == 'pcme':
    # PCME++'s release inits a = 5, b = 5 (the model stores log a).
    c.model.init_logit_scale = paper.PCME_SCALE_INIT
    c.model.init_logit_bias = paper.PCME_BIAS_INIT
  if objective == 'otter':
    # The teacher is the run's EMA. The paper's 0.999 suits long runs; over
    # the demo's 600 steps it would leave the teacher at about half its
    # random init.
    c.optim.ema_decay = 0.99
  c.batch_size = 128
  c.total_steps = 600
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 60
  c.optim.weight_decay = 0.05
  c.data.name = 'digits'
  if objective == 'prolip':
    short_run_uncertainty(c, beta=0.1)
  c.data.mean = (0.5, 0.5, 0.5)
  c.data.std = (0.5, 0.5, 0.5)
  # Grayscale digits: colour jitter and grayscale do nothing useful.
  c.data.jitter_prob = 0.0
  c.data.grayscale_prob = 0.0
  c.log_every_steps = 25
  c.checkpoint_every_steps = 200
  c.evals = heldout_evals(every_steps=300)
  if objective == 'uniclip':
    _uniclip_settings(c)
  return c


def _uniclip_settings(c: ml_collections.ConfigDict):
  """UniCLIP on the digits: 3 views per image, heads of section 2.1."""
  c.data.num_views = 3  # the paper's positive group: 3 views + 1 caption
  # Views must differ (image-image positives) and the head must see how:
  # crops and, since grey digits have no colour, brightness/contrast jitter
  # only (saturation/hue factors stay at identity).
  c.data.crop_scale = (0.6, 1.0)
  c.data.jitter = (0.4, 0.4, 0.0, 0.0)
  c.data.jitter_prob = 0.8
  # Declared defaults: balanced (1/V^2, 1/(2V), 1) weights (eq. 12's w_D),
  # an image head of 3 residual blocks, eq. 16 starting as eq. 13.
  config_keys.add(c, 'uniclip')
  c.uniclip.aug_features = 64  # f_A: the digits need less than 128
  c.uniclip.aug_hidden = 64


def emoji_demo_config(objective: str = 'prolip') -> ml_collections.ConfigDict:
  """The tiny model on the bundled emoji hierarchy (``data/emoji.py``).

  OpenMoji glyphs rendered at 64 px, captions drawn per example from five
  levels of specificity (root, group, subgroup, name, templated name);
  held-out names are never trained on. Colour is part of many names ('red
  heart', 'blue heart'), so no colour jitter or grayscale.
  """
  c = tiny_demo_config(objective)
  c.data.name = 'emoji'  # the held-out evaluation follows it
  if objective == 'prolip':
    short_run_uncertainty(c, beta=0.3)
  c.data.jitter_prob = 0.0
  c.data.grayscale_prob = 0.0
  # ~1,500 distinct names: a larger vocabulary than the digits' 256.
  c.tokenizer.vocab_size = 1024
  c.model.text.vocab_size = 1024
  return c


# The emoji study's length: three times the demo's 600 steps (about 14
# minutes alone on the 2-core CPU), warm-up kept at a tenth of the run.
STUDY_STEPS = 1800
# VIB weight of the ProLIP study, chosen on the validation names and
# phrasings (docs/small_scale_uncertainty.md); the demo's is 0.3.
STUDY_BETA = 0.1


def emoji_study_config(objective: str = 'prolip') -> ml_collections.ConfigDict:
  """The emoji study: the demo trained three times longer, on captions whose
  level cannot be read from their form (``data.captions='paraphrases'``),
  with a smaller VIB weight for ProLIP.

  It trains on ``'fit'`` (``'train'`` minus the 163 validation names), so
  that knobs are chosen on ``'val'`` with the validation phrasings, and
  reports on ``'heldout'`` with the same held-out phrasings for every
  objective (the SigLIP twin is ``emoji_study_config('siglip')``).
  """
  c = emoji_demo_config(objective)
  c.data.captions = 'paraphrases'
  c.data.split = 'fit'
  c.total_steps = STUDY_STEPS
  c.optim.warmup_steps = STUDY_STEPS // 10
  if objective == 'prolip':
    c.loss.beta = STUDY_BETA
  return c
