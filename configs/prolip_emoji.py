"""ProLIP on the bundled emoji hierarchy (OpenMoji images, Unicode groups >
subgroups > names); held-out names never seen in training.

python -m prolip_jax.main --config configs/prolip_emoji.py --workdir workdirs/prolip_emoji
python -m prolip_jax.evaluate --workdir workdirs/prolip_emoji --config configs/eval/emoji.py
"""

from prolip_jax import demos


def get_config():
  return demos.emoji_demo_config('prolip')
