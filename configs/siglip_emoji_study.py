"""The emoji study, its deterministic SigLIP twin: the same data, model size,
captions and budget as prolip_emoji_study.py, without [UNC] tokens.
Trains on the 'fit' names; knobs are chosen on 'val', figures come from
'heldout' with phrasings training never used.

python -m prolip_jax.main --config configs/siglip_emoji_study.py --workdir workdirs/siglip_emoji_study
python -m prolip_jax.evaluate --workdir workdirs/siglip_emoji_study --config configs/eval/emoji.py --config.data.phrasings=heldout
"""

from prolip_jax import demos


def get_config():
  return demos.emoji_study_config('siglip')
