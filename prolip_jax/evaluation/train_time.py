"""The short evaluation the training loop runs on the held-out digits.

Encoders come from the objective (``Objective.encoders``), so every
objective is scored in the space it trains (UniCLIP through its heads).
``python -m prolip_jax.evaluate`` runs the fuller suites on a checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from prolip_jax.data import digits
from prolip_jax.data import pairs
from prolip_jax.data import pipeline
from prolip_jax.embedding import embed_in_batches
from prolip_jax.embedding import normalize_images
from prolip_jax.evaluation.metrics import retrieval_recall
from prolip_jax.evaluation.metrics import zero_shot_report
from prolip_jax.losses import csd
from prolip_jax.losses import pcclip

Encoders = tuple[Callable, Callable]


def jit_encoders(objective, model, params, config) -> Encoders:
  """Jitted ``(enc_img(uint8 (n, s, s, 3)), enc_txt(tokens (n, L)))``, each
  returning ``(mu, logvar or None)`` in the objective's scoring space."""
  enc_img, enc_txt = objective.encoders(model, jax.device_get(params), config)
  mean, std = config.data.mean, config.data.std
  return (jax.jit(lambda x: enc_img(normalize_images(x, mean, std))),
          jax.jit(enc_txt))


def digits_eval_images(split: str, image_size: int
                       ) -> tuple[np.ndarray, np.ndarray]:
  """Eval views ``(n, s, s, 3)`` uint8 of a digits split, and its labels."""
  images, labels = digits.split(split)
  return pipeline.eval_images(np.repeat(images[..., None], 3, -1),
                              image_size), labels


def zero_shot_digits(encoders: Encoders, tokenizer, config, image_size: int
                     ) -> dict[str, float]:
  """Zero-shot and retrieval on the held-out bundled digits.

  Zero-shot: 1,000 held-out digits against the 10 classes, each the prompt
  ensemble of ``digits.EVAL_TEMPLATES``. Retrieval: each held-out image with
  its most specific caption only (one caption per image; the eval suite's
  ``retrieval`` uses every caption of an image, hence other numbers).
  """
  enc_img, enc_txt = encoders
  images, labels = digits_eval_images('heldout', image_size)
  bs = config.eval.batch_size
  img = embed_in_batches(enc_img, images, bs)
  prompts = [t.format(n) for n in digits.CLASS_NAMES
             for t in digits.EVAL_TEMPLATES]
  p_mu, p_lv = embed_in_batches(enc_txt, tokenizer(prompts), bs)
  shape = (len(digits.CLASS_NAMES), len(digits.EVAL_TEMPLATES), -1)
  out = zero_shot_report(
      img, (p_mu.reshape(shape), None if p_lv is None else p_lv.reshape(shape)),
      labels)
  caps = [c[-1] for c in digits.captions_for(*digits.split('heldout'))]
  t_mu, t_lv = embed_in_batches(enc_txt, tokenizer(caps), bs)
  if img[1] is not None:
    scores = -np.asarray(csd(img[0], img[1], t_mu, t_lv))
    out['sigma2_captions'] = float(np.mean(np.exp(t_lv)))
  else:
    scores = img[0] @ t_mu.T
  out.update(retrieval_recall(scores, np.arange(len(caps))))
  return out


def difference_classification_digits(encoders: Encoders, tokenizer, config,
                                     image_size: int, num_pairs: int = 500,
                                     seed: int = 0, split: str = 'heldout'
                                     ) -> dict[str, float]:
  """PC-CLIP's difference-based classification (eq. 2) on the digits.

  For each ordered attribute of ``losses.pcclip.DIGIT_SCHEMA`` that varies
  over ``split`` (digit value, thickness, width; the bundled digits are all
  centred, so position never differs): ``num_pairs`` random ordered pairs of
  ``split`` images that differ in it, the prompt T = the attribute's "first
  has more" phrase (e.g. "the first digit is larger than the second"), and
  the prediction 1{(g(I_i) - g(I_j)) . f(T) >= 0}. Chance is 50%.

  Returns:
    ``{'diff_acc/<attribute>': accuracy, 'diff_acc': their mean}``.
  """
  enc_img, enc_txt = encoders
  images, _ = digits_eval_images(split, image_size)
  attrs = digits.attributes(split)
  g, _ = embed_in_batches(enc_img, images, config.eval.batch_size)
  out = {}
  for attr in pcclip.DIGIT_SCHEMA:
    if attr.more is None:
      continue
    f_t = np.asarray(enc_txt(tokenizer([attr.more]))[0])[0]
    i, j, truth = pairs.difference_eval_pairs(attrs, attr, num_pairs, seed)
    if not len(i):  # no two images differ in it: nothing to rank
      continue
    pred = np.asarray(pcclip.difference_classify(g[i], g[j], f_t))
    out[f'diff_acc/{attr.name}'] = float(np.mean(pred == truth))
  out['diff_acc'] = float(np.mean(list(out.values())))
  return out


def _pct(x: float) -> str:
  return f'{100 * x:.1f}%'


def format_summary(summary: dict[str, Any]) -> str:
  """The lines printed at the end of a training run: what was reached, the
  held-out evaluation labelled with its protocol, where the checkpoint is
  and the next commands."""
  step = summary['step']
  lines = []
  if summary.get('preempted'):
    lines.append(f'Stopped by SIGTERM at step {step}; resume with the same '
                 'command.')
  else:
    lines.append(f'Finished at step {step} of {summary.get("total_steps", step)}'
                 + (f' ({step * summary["batch_size"]:,} pairs).'
                    if summary.get('batch_size') else '.'))
  ev = dict(summary.get('eval') or {})
  if ev:
    lines.append('Held-out digits (1,000 images never trained on):')
    rows = [
        ('zero-shot top-1, CSD', 'zeroshot_csd_top1'),
        ('zero-shot top-1, cosine', 'zeroshot_cosine_top1'),
        ('zero-shot top-5, CSD', 'zeroshot_csd_top5'),
        ('zero-shot top-5, cosine', 'zeroshot_cosine_top5'),
    ]
    for label, key in rows:
      if key in ev:
        lines.append(f'  {label:36s} {_pct(ev.pop(key))}')
    for direction, name in (('i2t', 'image -> text'), ('t2i', 'text -> image')):
      keys = [f'{direction}_R@{k}' for k in (1, 5, 10)]
      if all(k in ev for k in keys):
        values = ' / '.join(_pct(ev.pop(k)) for k in keys)
        lines.append(f'  {"retrieval " + name + " R@1/5/10":36s} {values}')
    if any(k.startswith(('i2t', 't2i')) for k in summary.get('eval', {})):
      lines.append('    (one caption per image, its most specific; '
                   '`prolip_jax.evaluate` ranks every caption of an image, '
                   'so its recalls differ)')
    sig = [(label, ev.pop(key)) for label, key in (
        ('images', 'sigma2_img'), ('captions', 'sigma2_captions'),
        ('prompts', 'sigma2_prompts')) if key in ev]
    if sig:
      lines.append('  mean sigma^2 per dimension: ' + ', '.join(
          f'{label} {value:.3g}' for label, value in sig))
    for key in sorted(ev):
      value = ev[key]
      shown = _pct(value) if key.startswith(('diff_acc', 'zeroshot')) else (
          f'{value:.4g}')
      lines.append(f'  {key:36s} {shown}')
  workdir = summary.get('workdir')
  lines.append(f"Checkpoint: {summary['checkpoint']}")
  if workdir and not summary.get('preempted'):
    lines.append(f'Next: python -m prolip_jax.evaluate --workdir {workdir}')
    lines.append(f'      python tools/export_pytorch.py --workdir {workdir} '
                 f'--out {workdir}/export')
  return '\n'.join(lines)
