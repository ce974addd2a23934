"""The deterministic SigLIP twin of prolip_emoji.py (no [UNC] tokens), same
data, model size and budget, for comparison.

python -m prolip_jax.main --config configs/siglip_emoji.py --workdir workdirs/siglip_emoji
python -m prolip_jax.evaluate --workdir workdirs/siglip_emoji --config configs/eval/emoji.py
"""

from prolip_jax import demos


def get_config():
  return demos.emoji_demo_config('siglip')
