"""``zero_shot``: top-k accuracy against the prompt ensemble's class
Gaussians (paper 4.2), by CSD and cosine."""

from __future__ import annotations

from typing import Any

import numpy as np

from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.metrics import topk_accuracy
from prolip_jax.evaluation.metrics import zero_shot_scores
from prolip_jax.evaluation.prompts import class_ensemble


class Evaluator(evaluator.Evaluator):
  """Every image against every class; names ``{metric}_top{k}``.

  ``templates``: () (the set's own), an asset name (``'imagenet'``) or a
  list of ``str.format`` templates; ``class_names``: () (the set's own), an
  asset name or a list.
  """

  OPTIONS = {'metrics': ('csd', 'cosine'), 'ks': (1, 5), 'templates': (),
             'class_names': ()}
  LABELS = (report.Label(r'(csd|cosine)_top(\d+)', 'zero-shot top-{1}, {0}',
                          report.pct),)

  def evaluate(self, params: Any) -> evaluator.Result:
    zs = self.opened(sets.zero_shot_set)
    emb = self.embed_images(params, zs.images)
    cls_mu, cls_var = class_ensemble(
        lambda p: self.embed_texts(params, p, 'prompts'), zs.class_names,
        zs.templates)
    metrics, per_class = {}, {}
    for metric in self.metric_names():
      scores = np.asarray(zero_shot_scores(emb.mu, emb.logvar, cls_mu,
                                           cls_var, metric))
      for k, v in topk_accuracy(scores, emb.labels,
                                tuple(self.cfg.ks)).items():
        metrics[f'{metric}_{k}'] = v
      pred = scores.argmax(1)
      per_class[metric] = {
          name: float((pred[emb.labels == c] == c).mean())
          for c, name in enumerate(zs.class_names)
          if (emb.labels == c).any()}
    details = {'images': zs.images.size, 'classes': len(zs.class_names),
               'templates': list(zs.templates),
               'images_per_sec': zs.images.size / max(emb.seconds, 1e-9),
               'per_class_top1': per_class}
    return evaluator.Result(metrics, details)
