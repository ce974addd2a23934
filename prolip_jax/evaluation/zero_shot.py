"""The zero-shot suite: top-k by CSD / cosine against prompt-ensemble class
Gaussians (paper 4.2), and flat hit@k for multi-label data."""

from __future__ import annotations

import numpy as np

from prolip_jax.evaluation.context import class_prompts
from prolip_jax.evaluation.context import Context
from prolip_jax.evaluation.context import metrics_for
from prolip_jax.evaluation.metrics import class_gaussians
from prolip_jax.evaluation.metrics import flat_hit_at_k
from prolip_jax.evaluation.metrics import topk_accuracy
from prolip_jax.evaluation.metrics import zero_shot_scores


def suite_zero_shot(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """Top-k by CSD / cosine against the prompt-ensemble class Gaussians."""
  data = ctx.data
  if data.class_names is None or data.labels is None:
    raise ValueError(f'{data.name} has no class labels for zero-shot')
  templates = tuple(cfg.get('templates') or data.templates)
  img = ctx.image_embeddings()
  p_mu, p_lv = class_prompts(ctx, templates)
  cls_mu, cls_var = class_gaussians(p_mu, p_lv)
  ks = tuple(cfg.get('ks', (1, 5)))
  metrics, details = {}, {'templates': list(templates), 'per_class_top1': {}}
  for metric in metrics_for(ctx, cfg):
    scores = np.asarray(zero_shot_scores(img[0], img[1], cls_mu, cls_var,
                                         metric))
    for k, v in topk_accuracy(scores, data.labels, ks).items():
      metrics[f'{metric}_{k}'] = v
    if data.label_sets is not None:
      for k, v in flat_hit_at_k(scores, data.label_sets, ks).items():
        metrics[f'{metric}_{k}'] = v
    pred = scores.argmax(1)
    details['per_class_top1'][metric] = {
        name: float((pred[data.labels == c] == c).mean())
        for c, name in enumerate(data.class_names)
        if (data.labels == c).any()}
  return metrics, details, []

