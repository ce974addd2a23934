"""A seconds-long smoke test of the whole loop (tests and multi-host checks).

Not a useful model: one-layer 32-wide towers on the bundled digits.
"""

from prolip_jax.config import presets


def get_config():
  c = presets.base_config()
  c.model = presets.model_preset('tiny')
  c.model.vision.width = 32
  c.model.vision.layers = 1
  c.model.vision.heads = 2
  c.model.text.width = 32
  c.model.text.layers = 1
  c.model.text.heads = 2
  c.model.text.context_length = 16
  c.model.embed_dim = 16
  c.batch_size = 16
  c.total_steps = 6
  c.optim.warmup_steps = 2
  c.log_every_steps = 1
  c.checkpoint_every_steps = 3
  c.evals = presets.heldout_evals(every_steps=0)
  c.evals.eval.batch_size = 500
  c.data.num_threads = 1
  return c
