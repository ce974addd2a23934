"""The CPU demos' configs, for any objective: the tiny model on the bundled
digits (``tiny_demo_config``), on the bundled emoji hierarchy
(``emoji_demo_config``) and the emoji study, three times longer on
paraphrased captions (``emoji_study_config``).

What every objective shares is written here. What one objective needs
beyond it, it declares itself (``objectives/base.py``): its [UNC] tokens
(``needs_unc``), the config keys it adds (``config_keys.Key.added_by``,
at their declared defaults) and its ``demo_settings`` per demo (CLIP's
temperature init, OTTER's teacher decay, ProLIP's short-run uncertainty
knobs, UniCLIP's views). A new objective gets every demo with no change
here. The demos import the objectives, hence this module above them;
``config/presets.py`` (the base config, the model presets), below them,
is what models and objectives read.
"""

from __future__ import annotations

from typing import Any, Mapping

import ml_collections

from prolip_jax import objectives
from prolip_jax.config import keys as config_keys
from prolip_jax.config import presets

# The demos, as ``Objective.demo_settings`` names them; each extends the
# one before it.
TINY = 'tiny'
EMOJI = 'emoji'
EMOJI_STUDY = 'emoji_study'
DEMOS = (TINY, EMOJI, EMOJI_STUDY)

# The emoji study's length: three times the demo's 600 steps (about 14
# minutes alone on the 2-core CPU), warm-up kept at a tenth of the run.
STUDY_STEPS = 1800

# The objective of a demo called without one: the declared default.
DEFAULT_OBJECTIVE = config_keys.default('objective')


def apply(config: ml_collections.ConfigDict, settings: Mapping[str, Any]):
  """Sets each dotted key of ``settings`` in ``config``; a key that is not
  declared (``config_keys.declaration``) is a ``KeyError``, so an
  objective's misspelt setting fails here, not as a silently new field."""
  for key, value in settings.items():
    if config_keys.declaration(key) is None:
      raise KeyError(f'{key!r} is not a declared config key')
    node = config
    *parents, last = key.split('.')
    for part in parents:
      node = node[part]
    node[last] = value


def _objective_settings(config: ml_collections.ConfigDict, objective: str,
                        demo: str):
  """Lays ``objective``'s own settings of ``demo`` over ``config``."""
  apply(config, objectives.get(objective).demo_settings.get(demo, {}))


def tiny_demo_config(objective: str = DEFAULT_OBJECTIVE
                     ) -> ml_collections.ConfigDict:
  """The CPU demo on the bundled MNIST digits, for any objective.

  Objectives without ``needs_unc`` get towers without [UNC]; set
  ``model.use_unc`` for OTTER's probabilistic (CSD-logit) variant.
  """
  chosen = objectives.get(objective)  # an unknown name: one ConfigError
  c = presets.base_config()
  c.objective = objective
  c.model = presets.model_preset('tiny', use_unc=chosen.needs_unc)
  c.batch_size = 128
  c.total_steps = 600
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 60
  c.optim.weight_decay = 0.05
  c.data.name = 'digits'
  c.data.mean = (0.5, 0.5, 0.5)
  c.data.std = (0.5, 0.5, 0.5)
  # Grayscale digits: colour jitter and grayscale do nothing useful.
  c.data.jitter_prob = 0.0
  c.data.grayscale_prob = 0.0
  c.log_every_steps = 25
  c.checkpoint_every_steps = 200
  c.evals = presets.heldout_evals(every_steps=300)
  config_keys.add(c, objective)  # the keys it adds, at their defaults
  _objective_settings(c, objective, TINY)
  return c


def emoji_demo_config(objective: str = DEFAULT_OBJECTIVE
                      ) -> ml_collections.ConfigDict:
  """The tiny model on the bundled emoji hierarchy (``data/emoji.py``).

  OpenMoji glyphs rendered at 64 px, captions drawn per example from five
  levels of specificity (root, group, subgroup, name, templated name);
  held-out names are never trained on. Colour is part of many names ('red
  heart', 'blue heart'), so no colour jitter or grayscale.
  """
  c = tiny_demo_config(objective)
  c.data.name = 'emoji'  # the held-out evaluation follows it
  c.data.jitter_prob = 0.0
  c.data.grayscale_prob = 0.0
  # ~1,500 distinct names: a larger vocabulary than the digits' 256.
  c.tokenizer.vocab_size = 1024
  c.model.text.vocab_size = 1024
  _objective_settings(c, objective, EMOJI)
  return c


def emoji_study_config(objective: str = DEFAULT_OBJECTIVE
                       ) -> ml_collections.ConfigDict:
  """The emoji study: the demo trained three times longer, on captions whose
  level cannot be read from their form (``data.captions='paraphrases'``),
  with the objective's own settings of the study (ProLIP: a smaller VIB
  weight).

  It trains on ``'fit'`` (``'train'`` minus the 163 validation names), so
  that knobs are chosen on ``'val'`` with the validation phrasings, and
  reports on ``'heldout'`` with the same held-out phrasings for every
  objective (``configs/*_emoji_study.py``: one per objective compared).
  """
  c = emoji_demo_config(objective)
  c.data.captions = 'paraphrases'
  c.data.split = 'fit'
  c.total_steps = STUDY_STEPS
  c.optim.warmup_steps = STUDY_STEPS // 10
  _objective_settings(c, objective, EMOJI_STUDY)
  return c
