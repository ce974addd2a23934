"""Evaluation suite for models trained on the bundled digits (the tiny demo).

python -m prolip_jax.evaluate --workdir /tmp/tiny --config configs/eval/digits.py

Runs on the 1,000 held-out digits (100 per class; never seen in training),
each with the eight captions of ``digits.captions_for``:

  0 'seven'            1 '7'               2 'a seven'
  3 'the handwritten digit seven'          4 'a thin seven'
  5 'a wide handwritten seven with thin strokes'
  6 'a thin and wide digit seven written on the left side'
  7 'a photo of a wide handwritten number seven drawn with thin strokes
     slightly to the left'

Hierarchy levels are captions 0, 4, 5, 6: the bare name, then one, two and
three attributes, each level entailing the previous one.
``--config.data.phrasings=heldout`` words them with phrasings training never
used ('a sketch of seven', 'a sketch of seven with thin strokes', ...: the
same phrasing at every level of an image). Each entry of ``evals`` is an
evaluator (``prolip_jax/evaluation/kinds/``); the settings above ``evals``
are shared by every entry, so ``--config.per_class=20`` makes a quick run
and ``--evals=zero_shot,retrieval`` runs two of them. Outputs go to
WORKDIR/eval (``--out`` elsewhere).
"""

import ml_collections

# Prompts for BPRW: the four zero-shot templates plus caption-style and
# attribute prompts, so that the learned weights have something to choose.
BPRW_TEMPLATES = (
    'a photo of the number {}.', 'a handwritten {}.', 'the digit {}.',
    'a drawing of a {}.', '{}', 'the handwritten digit {}', 'a thin {}',
    'a thick {}', 'a wide handwritten {}', 'a narrow handwritten {}')


def get_config():
  c = ml_collections.ConfigDict()
  # Shared by every entry (each entry reads them by reference).
  c.data = 'digits:heldout'
  c.per_class = 0  # 0: all 100 per class
  # 'heldout': the eight captions worded with phrasings training never
  # uses (data/paraphrases.py VALIDATION), same positions and levels.
  c.phrasings = 'templates'
  c.batch_size = 250
  c.seed = 0
  c.progress = True
  shared = {k: c.get_ref(k) for k in ('data', 'per_class', 'phrasings',
                                      'batch_size', 'seed', 'progress')}

  c.evals = ml_collections.ConfigDict()
  c.evals.zero_shot = dict(
      kind='zero_shot', metrics=('csd', 'cosine'), ks=(1, 5),
      templates=(), **shared)  # (): the dataset's (digits.EVAL_TEMPLATES)
  c.evals.retrieval = dict(
      kind='retrieval', metrics=('csd', 'cosine'), ks=(1, 5, 10),
      # Three captions per image: the attribute captions.
      caption_indices=(5, 6, 7), **shared)
  c.evals.uncertainty = dict(
      kind='uncertainty_report', levels=(0, 4, 5, 6),
      # Partial views for H(orig ⊂ view): 'drop:KEEP' keeps that fraction of
      # patch tokens (training drops 75%), 'occlude:F' zeroes the central F
      # of the image area.
      image_views=('drop:0.25', 'occlude:0.25'),
      # The same digits drawn in another style (blurred; strokes
      # thickened; grey, so no hue change): the fraction whose sigma^2 is
      # not below the original's (uncertainty.restyle).
      style_views=('blur:1', 'thicken:3'),
      text_mask_prob=0.75,  # as in training
      inclusion_eps=0.0,  # eq. 3 without the stability trick
      num_inclusion_images=0,  # 0: all
      num_examples=8, **shared)
  c.evals.bprw = dict(
      kind='bprw', templates=BPRW_TEMPLATES, eps=0.02, max_iters=1000,
      tol=1e-7,
      # C.7: zero-shot alpha 5, 5 nearest images per class, 10 samples each.
      zero_shot={'alpha': 5.0, 'm': 5, 'k': 10},
      # Few-shot: alpha 2, K labelled images per class from the training
      # split, 100 // K samples each.
      few_shot={'shots': 5, 'alpha': 2.0, 'total_samples': 100,
                'split': 'train'}, **shared)
  c.evals.traversal = dict(
      kind='traversal',
      levels=(0, 4, 5, 6),  # ground-truth hierarchy per image
      database_levels=(),  # (): the captions of `levels`
      steps=50,
      # [ROOT] search: 'measure' (inc(Z_c, Z_k), eq. 3, B.4) or 'hypothesis'
      # (H(Z_c ⊂ Z_k), eq. 4).
      score='measure', inclusion_eps=0.0,
      num_images=0,  # 0: all
      num_examples=5, **shared)
  c.evals.filtering = dict(
      kind='filtering',
      caption_index=7,  # the most specific caption
      corrupt_fraction=0.2,  # captions shuffled among these records
      keep_fraction=0.8, w_img=0.0, w_txt=0.0, **shared)
  return c
