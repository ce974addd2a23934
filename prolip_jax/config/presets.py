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
from typing import Any

import ml_collections

from prolip_jax.config import keys as config_keys
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


def short_run_uncertainty(beta: float = 0.3) -> dict[str, Any]:
  """Knobs under which ProLIP's sigma^2 trains in a few hundred steps, as
  dotted config settings (ProLIP's demos declare them:
  ``objectives/prolip.py``'s ``demo_settings``).

  The paper's weights are tuned for 1.28B samples: in 600 steps Adam moves
  the [UNC] heads by about 0.3 in log sigma^2, VIB (beta = 1e-4) and
  L_inc(v ⊂ t) (alpha1 = 1e-7) are invisible, and PPCL shrinks every
  caption's sigma^2. A 10x learning rate for the uncertainty parameters, a
  VIB weight that balances PPCL at sigma^2 ~ 1e-3..1e-2 per dimension and a
  visible image ⊂ text inclusion term let general captions end up more
  uncertain than specific ones. Chosen on validation splits carved from
  training; docs/small_scale_uncertainty.md has every setting tried.
  """
  return {'optim.unc_lr_mult': 10.0, 'loss.beta': beta, 'loss.alpha1': 1e-3}
