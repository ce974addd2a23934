"""ProLIP on a weighted mixture: your array_record shards and the bundled digits.

The tiny demo's model and schedule with ``data.sources`` (docs/data.md,
"Mixtures"); set the shards' path (and any weight) on the command line:

python -m prolip_jax.main --config configs/prolip_tiny_mixture.py \
    --config.data.sources.web.path='/data/shards/*.array_record' \
    --config.data.sources.web.weight=0.8 --workdir /tmp/mixture
"""

from prolip_jax import demos


def get_config():
  c = demos.tiny_demo_config('prolip')
  # Weights are floats (a command-line override must keep the type); Grain
  # mixes them as integer proportions, the smallest scaled to 100.
  c.data.sources = {
      'web': {'name': 'array_record', 'path': '', 'weight': 0.7},
      'digits': {'name': 'digits', 'weight': 0.3},
  }
  return c
