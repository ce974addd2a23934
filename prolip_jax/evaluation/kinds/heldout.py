"""``heldout``: the short evaluation a training run makes on the held-out
part of the bundled set it trains on (digits: the 1,000 held-out digits;
emoji: the emoji whose names were never trained on).

Zero-shot over the set's classes with its templates, retrieval with each
image's most specific (last) caption only (one caption per image; the
``retrieval`` kind ranks every caption of an image, hence other numbers),
sigma^2 of images, prompts and captions, and the objective's own figures
(``Objective.heldout_metrics``: PC-CLIP's difference classification).
Training's demo configs declare it as ``c.evals.eval`` (metrics
``eval/zeroshot_csd_top1``, ...), run at the end of training by default.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.encoders import in_memory
from prolip_jax.evaluation.metrics import retrieval_recall
from prolip_jax.evaluation.metrics import zero_shot_report
from prolip_jax.evaluation.prompts import prompt_ensemble
from prolip_jax.losses import csd


class Evaluator(evaluator.Evaluator):
  """``data`` '' (default): the held-out split of the set the model was
  trained on (``digits:heldout`` or ``emoji:heldout``)."""

  DEFAULTS = {'every_steps': 0, 'batch_size': 250}
  NEEDS_DATA = False
  # Labels shared with training's summary are spelled as it spells them.
  LABELS = (
      report.Label(r'zeroshot_(csd|cosine)_top(\d+)',
                   'zero-shot top-{1}, {0}', report.pct),
      report.Label(r'sigma2_img', 'mean sigma^2 per dimension, images',
                   report.number),
      report.Label(r'sigma2_(captions|prompts)',
                   'mean sigma^2 per dimension, {0}', report.number),
      report.Label(r'diff_acc', 'difference classification (PC-CLIP eq. 2)',
                   report.pct),
      report.Label(r'diff_acc/(.+)', 'difference classification, {0}',
                   report.pct))

  def __init__(self, encoders, name: str = '', **cfg):
    super().__init__(encoders, name, **cfg)
    if not self.cfg.data and encoders.train_data in sets.bundled():
      self.cfg.data = f'{encoders.train_data}:heldout'

  def available(self) -> Optional[str]:
    if not self.cfg.data:
      return (f'{self.encoders.train_data or "the training data"} has no '
              'held-out part (the bundled digits and emoji have): set '
              'data, or use the zero_shot and retrieval kinds')
    return super().available()

  def evaluate(self, params: Any) -> evaluator.Result:
    reason = self.available()
    if reason:
      raise evaluator.SkipEvaluator(reason)
    data = self.opened(sets.bundled_data)
    embed_images = lambda x: self.encoders.embed_images(
        params, in_memory(data.name, x), self.batch_size,
        num_threads=int(self.cfg.num_threads)).pair
    embed_texts = lambda t: self.encoders.embed_texts(params, t,
                                                      self.batch_size)
    img = embed_images(data.images)
    prompts = prompt_ensemble(embed_texts, data.class_names, data.templates)
    metrics = zero_shot_report(img, prompts, data.labels)
    t_mu, t_lv = embed_texts([c[-1] for c in data.captions])
    if img[1] is not None:
      scores = -np.asarray(csd(img[0], img[1], t_mu, t_lv))
      metrics['sigma2_captions'] = float(np.mean(np.exp(t_lv)))
    else:
      scores = img[0] @ t_mu.T
    metrics.update(retrieval_recall(scores, np.arange(len(data.captions))))
    if self.encoders.extra_metrics is not None:
      metrics.update(self.encoders.extra_metrics(embed_images, embed_texts))
    return evaluator.Result(metrics, {'images': len(data.images),
                                      'dataset': data.name})
