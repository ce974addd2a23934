"""Zero-shot classification: the one prompt ensemble (paper 4.2) and the
zero-shot suite (top-k by CSD / cosine against the prompt-ensemble class
Gaussians, and flat hit@k for multi-label data).

``prompt_ensemble`` / ``class_ensemble`` are what every zero-shot path
embeds its classes with: the ``zero_shot`` evaluator kind
(``evaluators.py``), the bundled suites (``class_prompts``: this suite and
BPRW), the training loop's held-out evaluation (``train_time.py``) and
``LoadedModel.zero_shot_classifier`` (``interop/load.py``). Only the text
embedder differs between them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from prolip_jax.evaluation.context import Context
from prolip_jax.evaluation.context import metrics_for
from prolip_jax.evaluation.metrics import class_gaussians
from prolip_jax.evaluation.metrics import flat_hit_at_k
from prolip_jax.evaluation.metrics import topk_accuracy
from prolip_jax.evaluation.metrics import zero_shot_scores

# ``embed_texts(prompts: list[str]) -> (mu (P, d), logvar (P, d) or None)``.
TextEmbedder = Callable[[list[str]], tuple]


def prompt_ensemble(embed_texts: TextEmbedder, class_names: Sequence[str],
                    templates: Sequence[str]) -> tuple:
  """The prompt ensemble's embeddings (paper 4.2), per prompt.

  Every ``template.format(name)``, class-major (class c, template t is
  prompt ``c * N + t``), embedded in one call of ``embed_texts``.

  Returns:
    (mu ``(C, N, d)``, logvar ``(C, N, d)`` or None), C classes, N
    templates; ``metrics.class_gaussians`` averages them per class.
  """
  prompts = [t.format(c) for c in class_names for t in templates]
  mu, logvar = embed_texts(prompts)
  shape = (len(class_names), len(templates), -1)
  return mu.reshape(shape), None if logvar is None else logvar.reshape(shape)


def class_ensemble(embed_texts: TextEmbedder, class_names: Sequence[str],
                   templates: Sequence[str]) -> tuple:
  """Per-class Gaussians of the prompt ensemble: (mean mu ``(C, d)``, mean
  sigma^2 ``(C, d)`` or None) of ``prompt_ensemble`` (``class_gaussians``:
  the plain mean of the N prompt variances)."""
  return class_gaussians(*prompt_ensemble(embed_texts, class_names,
                                          templates))


def class_prompts(ctx: Context, templates: Sequence[str]) -> tuple:
  """``prompt_ensemble`` of a suite's classes through its embedder."""
  return prompt_ensemble(lambda p: ctx.embedder.texts(p, desc='prompts'),
                         ctx.data.class_names, templates)


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

