"""ProLIP on the bundled MNIST digits: the CPU demo and the embedded default.

python -m prolip_jax.main --config configs/prolip_tiny.py --workdir /tmp/tiny
"""

from prolip_jax import demos


def get_config():
  return demos.tiny_demo_config('prolip')
