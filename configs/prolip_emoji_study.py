"""The emoji study, ProLIP: the emoji demo trained three times longer
(1,800 steps) on paraphrased captions, with a smaller VIB weight.
Trains on the 'fit' names; knobs are chosen on 'val', figures come from
'heldout' with phrasings training never used.

python -m prolip_jax.main --config configs/prolip_emoji_study.py --workdir workdirs/prolip_emoji_study
python -m prolip_jax.evaluate --workdir workdirs/prolip_emoji_study --config configs/eval/emoji.py --config.data.phrasings=heldout
"""

from prolip_jax import demos


def get_config():
  return demos.emoji_study_config('prolip')
