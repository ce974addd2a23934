"""ProLIP on the bundled MNIST digits: the CPU demo and the embedded default.

python -m prolip_jax.main --config configs/prolip_tiny.py --workdir /tmp/tiny
"""

from prolip_jax import presets


def get_config():
  c = presets.base_config()
  c.model = presets.model_preset('tiny')
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
  c.eval.every_steps = 300
  return c
