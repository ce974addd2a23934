"""``bprw``: Bayesian prompt re-weighting (paper A.8, C.7) on a bundled set:
zero-shot accuracy with uniform, 1/tr(Sigma), zero-shot EM and few-shot EM
prompt weights."""

from __future__ import annotations

from typing import Any

import numpy as np

from prolip_jax.applications import bprw
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.in_memory import InMemoryEvaluator
from prolip_jax.evaluation.sets import EvalData
from prolip_jax.evaluation.metrics import class_gaussians
from prolip_jax.evaluation.metrics import topk_accuracy
from prolip_jax.evaluation.metrics import zero_shot_scores
from prolip_jax.evaluation.prompts import prompt_ensemble


class Evaluator(InMemoryEvaluator):
  """BPRW before/after accuracy, zero-shot and few-shot (A.8, C.7).

  ``templates``: the prompts to weigh (() for the set's); ``eps``,
  ``max_iters``, ``tol``: the EM's; ``zero_shot``: ``{alpha, m, k}`` (C.7:
  alpha 5, the 5 nearest images per class, 10 samples each);
  ``few_shot``: ``{shots, alpha, total_samples, split}`` (``shots`` 0: none;
  ``split`` '' or 'same': labelled images of the set itself).
  """

  OPTIONS = {'templates': (), 'eps': 0.02, 'max_iters': 1000, 'tol': 1e-7,
             'zero_shot': {'alpha': 5.0, 'm': 5, 'k': 10},
             'few_shot': {'shots': 0, 'alpha': 2.0, 'total_samples': 100,
                          'split': 'train'}}
  LABELS = (
      report.Label(r'uniform_top(\d+)', 'top-{0}, uniform prompt weights',
                   report.pct),
      report.Label(r'inv_trace_top(\d+)',
                   'top-{0}, 1/tr(Sigma) initial weights', report.pct),
      report.Label(r'zeroshot_top(\d+)', 'top-{0}, zero-shot EM weights',
                   report.pct),
      report.Label(r'fewshot(\d+)_top(\d+)', 'top-{1}, {0}-shot EM weights',
                   report.pct),
      report.Label(r'zeroshot_neighbour_precision',
                   'zero-shot EM neighbours of the right class', report.pct))

  def evaluate_set(self, params: Any, data: EvalData) -> evaluator.Result:
    cfg = self.cfg
    templates = tuple(cfg.templates or data.templates)
    p_mu, p_lv = prompt_ensemble(
        lambda p: self.texts(params, p, 'prompts'), data.class_names,
        templates)
    if p_lv is None:
      raise evaluator.SkipEvaluator('BPRW needs a probabilistic model')
    img = self.image_embeddings(params)

    def acc(mu, var):
      s = np.asarray(zero_shot_scores(img[0], img[1], mu, var, 'csd'))
      return topk_accuracy(s, data.labels, (1, 5))

    metrics, details, pis = {}, {'templates': list(templates)}, {}
    for k, v in acc(*class_gaussians(p_mu, p_lv)).items():
      metrics[f'uniform_{k}'] = v
    pi0 = np.asarray(bprw.initial_weights(p_lv))
    for k, v in acc(*bprw.reweighted_classifier(p_mu, p_lv, pi0)).items():
      metrics[f'inv_trace_{k}'] = v
    em_kw = {'max_iters': int(cfg.max_iters), 'tol': float(cfg.tol)}
    zs = cfg.zero_shot
    res, index = bprw.zero_shot_bprw(
        p_mu, p_lv, img[0], img[1], alpha=zs.alpha, eps=cfg.eps, m=zs.m,
        k=zs.k, seed=self.seed, **em_kw)
    for k, v in acc(res.mu, res.var).items():
      metrics[f'zeroshot_{k}'] = v
    metrics['zeroshot_neighbour_precision'] = float(np.mean(
        data.labels[index] == np.arange(len(index))[:, None]))
    details['zero_shot'] = {'pi': res.pi.tolist(), **bprw.summarize(res)}
    pis['zero-shot BPRW'] = res.pi
    fs = cfg.few_shot
    if fs.shots > 0:
      support = data if fs.split in ('', 'same') else self._support(fs.split)
      idx = bprw.few_shot_indices(support.labels, len(data.class_names),
                                  fs.shots, self.seed).ravel()
      s_img = self.images(params, support.images[idx], desc='few-shot support')
      res_f, _ = bprw.few_shot_bprw(
          p_mu, p_lv, s_img[0], s_img[1], support.labels[idx], fs.shots,
          alpha=fs.alpha, eps=cfg.eps, total_samples=fs.total_samples,
          seed=self.seed, **em_kw)
      for k, v in acc(res_f.mu, res_f.var).items():
        metrics[f'fewshot{fs.shots}_{k}'] = v
      details['few_shot'] = {'pi': res_f.pi.tolist(), 'split': fs.split,
                             **bprw.summarize(res_f)}
      pis[f'{fs.shots}-shot BPRW'] = res_f.pi
    fig = bprw.fig_weights(pis, data.class_names, templates)
    figs = [self.figure(fig, 'bprw_weights.png', 2 * len(pis))]
    return evaluator.Result(metrics, details, [f for f in figs if f])

  def _support(self, split: str) -> EvalData:
    """The labelled images of another split of the set (all of them)."""
    cfg = self.cfg.copy_and_resolve_references()
    cfg.data = f'{sets.parse(cfg.data)[0]}:{split}'
    cfg.per_class = 0
    return sets.bundled_data(cfg)
