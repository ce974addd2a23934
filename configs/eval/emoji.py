"""Evaluation suite for models trained on the bundled emoji (prolip_emoji).

python -m prolip_jax.evaluate --workdir workdirs/prolip_emoji --config configs/eval/emoji.py

Runs on the held-out emoji: one OpenMoji image per Unicode name that training
never saw (``emoji.split('heldout')``; their groups and subgroups are seen
with other names). Each image has the five captions of
``emoji.captions_for``, general to specific:

  0 root 'an emoji'                 1 group 'a smileys and emotion emoji'
  2 subgroup 'a face smiling emoji' 3 name 'grinning face'
  4 templated name

Hierarchy levels are group > subgroup > name (1, 2, 3): sigma^2 should fall
along them, and each name's Gaussian should lie inside its subgroup's, inside
its group's (H > 0). Zero-shot classifies each held-out image among all
held-out names. Choose knobs on ``--config.data=emoji:val`` (names carved
from training), never on 'heldout'. ``--config.phrasings=heldout``
words every level with phrasings that training never used (the same
phrasing at every level of an image, so only the content words differ):
sigma^2 then has to follow the meaning, not the template.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  # Shared by every entry (each entry reads them by reference).
  c.data = 'emoji:heldout'
  c.render_size = 64
  # 'heldout': the five captions worded with phrasings training never
  # uses (data/paraphrases.py VALIDATION), same positions and levels.
  c.phrasings = 'templates'
  c.batch_size = 250
  c.seed = 0
  c.progress = True
  shared = {k: c.get_ref(k) for k in ('data', 'render_size', 'phrasings',
                                      'batch_size', 'seed', 'progress')}

  c.evals = ml_collections.ConfigDict()
  c.evals.zero_shot = dict(
      kind='zero_shot', metrics=('csd', 'cosine'), ks=(1, 5),
      templates=(), **shared)  # (): emoji.EVAL_TEMPLATES
  c.evals.retrieval = dict(
      kind='retrieval', metrics=('csd', 'cosine'), ks=(1, 5, 10),
      caption_indices=(3, 4), **shared)  # the name, plain and templated
  c.evals.uncertainty = dict(
      kind='uncertainty_report',
      levels=(1, 2, 3),  # group > subgroup > name
      # H(original ⊂ partial view): 75% of patch tokens dropped, and the
      # central half of the image area blacked out.
      image_views=('drop:0.25', 'occlude:0.5'),
      # The same images drawn in another style (blurred; strokes
      # thickened; colours turned half way round the hue circle): the
      # fraction whose sigma^2 is not below the original's
      # (uncertainty.restyle).
      style_views=('blur:1.5', 'thicken:3', 'hue:0.5'),
      text_mask_prob=0.75, inclusion_eps=0.0, num_inclusion_images=0,
      num_examples=8, **shared)
  c.evals.traversal = dict(
      kind='traversal',
      levels=(1, 2, 3),  # the true path: group > subgroup > name
      database_levels=(), steps=50, score='measure', inclusion_eps=0.0,
      num_images=0, num_examples=5, **shared)
  return c
