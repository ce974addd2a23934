"""Deterministic CLIP baseline on the bundled digits (no [UNC] tokens)."""

from prolip_jax import presets


def get_config():
  c = presets.base_config()
  c.objective = 'clip'
  c.model = presets.model_preset('tiny', use_unc=False)
  c.model.init_logit_scale = 1 / 0.07  # CLIP's temperature init
  c.batch_size = 128
  c.total_steps = 600
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 60
  c.optim.weight_decay = 0.05
  c.data.mean = (0.5, 0.5, 0.5)
  c.data.std = (0.5, 0.5, 0.5)
  c.data.jitter_prob = 0.0
  c.data.grayscale_prob = 0.0
  c.log_every_steps = 25
  c.eval.every_steps = 300
  return c
