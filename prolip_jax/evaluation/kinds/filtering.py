"""``filtering``: CSD pair filtering (``applications/filtering.py``) scored
on a bundled set with a fraction of its captions shuffled between images."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from prolip_jax.applications import filtering as F
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation.in_memory import InMemoryEvaluator
from prolip_jax.evaluation.sets import EvalData
from prolip_jax.evaluation.metrics import auc


class Evaluator(InMemoryEvaluator):
  """How many of the shuffled pairs the filter removes.

  ``caption_index``: the caption of each image scored (-1: the last, the
  most specific); ``corrupt_fraction``: pairs whose captions are shuffled
  among themselves; ``keep_fraction``: pairs kept; ``w_img``, ``w_txt``:
  the sigma^2 penalties of ``filtering.pair_scores``.
  """

  OPTIONS = {'caption_index': -1, 'corrupt_fraction': 0.2,
             'keep_fraction': 0.8, 'w_img': 0.0, 'w_txt': 0.0}
  LABELS = (
      report.Label(r'removed_precision', 'removed pairs that were shuffled',
                   report.pct),
      report.Label(r'corrupted_recall', 'shuffled pairs removed', report.pct),
      report.Label(r'auc', 'AUC, original vs shuffled pairs',
                   lambda x: f'{x:.3f}'),
      report.Label(r'kept', 'pairs kept', report.count),
      report.Label(r'total', 'pairs scored', report.count))

  def evaluate_set(self, params: Any, data: EvalData) -> evaluator.Result:
    self.require_probabilistic('CSD filtering')
    cfg = self.cfg
    j = int(cfg.caption_index)
    caps = [c[j] for c in data.captions]
    rng = np.random.default_rng(self.seed)
    n = len(caps)
    bad = np.sort(rng.choice(n, int(round(cfg.corrupt_fraction * n)),
                             replace=False))
    shuffled = list(caps)
    for a, b in zip(bad, rng.permutation(bad)):
      shuffled[a] = caps[b]
    corrupted = np.array([shuffled[i] != caps[i] for i in range(n)])
    img = self.image_embeddings(params)
    txt = self.texts(params, shuffled, 'filtering captions')
    scores = np.asarray(F.pair_scores(*img, *txt, w_img=float(cfg.w_img),
                                      w_txt=float(cfg.w_txt)))
    keys = list(data.keys)
    kept = F.select(keys, scores, float(cfg.keep_fraction))
    details, files = {'caption_index': j}, []
    if self.out_dir:
      details['kept_keys_file'] = F.write_keys(
          os.path.join(self.out_dir, 'filtering_kept_keys.txt'), kept)
      files.append(details['kept_keys_file'])
    kept_set = set(kept)
    removed = np.array([k not in kept_set for k in keys])
    nan = float('nan')
    metrics = {
        'kept': len(kept), 'total': n,
        'removed_precision': (float(corrupted[removed].mean())
                              if removed.any() else nan),
        'corrupted_recall': (float(removed[corrupted].mean())
                             if corrupted.any() else nan),
        'auc': (auc(scores[~corrupted], scores[corrupted])
                if corrupted.any() and (~corrupted).any() else nan),
    }
    threshold = float(np.min(scores[~removed])) if (~removed).any() else 0.0
    details.update({'corrupted_keys': [keys[i] for i in
                                       np.flatnonzero(corrupted)],
                    'threshold': threshold})
    fig = F.fig_scores(scores, threshold, corrupted)
    figs = [self.figure(fig, 'filtering_scores.png', 1)]
    return evaluator.Result(metrics, details, [f for f in figs if f], files)
