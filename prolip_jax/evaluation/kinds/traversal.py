"""``traversal``: inclusion-based traversal (paper 4.4, B.4) on a bundled
set, against the empty-caption [ROOT] baseline."""

from __future__ import annotations

from typing import Any

import numpy as np

from prolip_jax.applications import traversal as T
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation import uncertainty as U
from prolip_jax.evaluation.in_memory import InMemoryEvaluator
from prolip_jax.evaluation.sets import EvalData

# The two roots' names in the report.
ROOTS = {'inclusion': 'inclusion-based', 'null': 'empty-caption'}


class Evaluator(InMemoryEvaluator):
  """Inclusion-based traversal vs the embedding of "" as the root.

  ``levels``: the ground-truth hierarchy's caption positions per image;
  ``database_levels``: the captions searched (() for ``levels``);
  ``steps``; ``score``: 'measure' (inc(Z_c, Z_k), eq. 3, B.4) or
  'hypothesis' (H(Z_c ⊂ Z_k), eq. 4); ``inclusion_eps``; ``num_images``
  (0: all); ``num_examples`` listed.
  """

  OPTIONS = {'levels': (0,), 'database_levels': (), 'steps': T.STEPS,
             'score': 'measure', 'inclusion_eps': 0.0, 'num_images': 0,
             'num_examples': 5}
  LABELS = (
      report.Label(r'inclusion_root_is_gt_level0',
                   'inclusion-based [ROOT] is the level-0 caption',
                   report.pct),
      report.Label(r'(inclusion|null)_root_R@1', '{0} [ROOT] R@1',
                   report.pct, ROOTS),
      report.Label(r'(inclusion|null)_(precision|recall)', '{0} [ROOT] {1}',
                   report.pct, ROOTS),
      report.Label(r'(inclusion|null)_path_length',
                   '{0} [ROOT] path length (captions)', lambda x: f'{x:.1f}',
                   ROOTS))

  def evaluate_set(self, params: Any, data: EvalData) -> evaluator.Result:
    self.require_probabilistic('the inclusion traversal')
    cfg = self.cfg
    levels = tuple(cfg.levels)
    n = int(cfg.num_images) or len(data.images)
    sel = np.arange(min(n, len(data.images)))
    texts, level_of = [], {}
    for caps in data.captions:
      for j in tuple(cfg.database_levels) or levels:
        if caps[j] not in level_of:
          level_of[caps[j]] = levels.index(j) if j in levels else -1
          texts.append(caps[j])
    pos = {t: i for i, t in enumerate(texts)}
    db = self.texts(params, texts, 'traversal captions')
    empty = self.texts(params, [''], 'empty caption')
    img = self.image_embeddings(params)
    img = (img[0][sel], img[1][sel])
    gt = [[pos[data.captions[i][j]] for j in levels] for i in sel]
    gt_root = [g[0] for g in gt]
    runs = {
        'inclusion': T.traverse(img, db, empty, int(cfg.steps), 'inclusion',
                                'csd', float(cfg.inclusion_eps), cfg.score),
        'null': T.traverse(img, db, empty, int(cfg.steps), 'null', 'csd'),
    }
    metrics, details = {}, {}
    for name, tr in runs.items():
      for k, v in T.traversal_metrics(tr, gt, gt_root).items():
        metrics[f'{name}_{k}'] = v
    tr = runs['inclusion']
    roots, counts = np.unique(tr.root, return_counts=True)
    top = np.argsort(-counts)[:10]
    details['root_captions'] = [[texts[roots[i]], int(counts[i])]
                                for i in top]
    details['root_is_level0'] = float(np.mean(tr.root == np.asarray(gt_root)))
    metrics['inclusion_root_is_gt_level0'] = details['root_is_level0']
    details['examples'] = [
        {'key': data.keys[sel[i]],
         'ground_truth': [texts[g] for g in gt[i]],
         'root': texts[tr.root[i]],
         'path': [texts[j] for j in tr.paths[i]],
         'null_path': [texts[j] for j in runs['null'].paths[i]]}
        for i in range(min(int(cfg.num_examples), len(sel)))]
    details['database_size'] = len(texts)
    db_level = np.array([level_of[t] for t in texts])
    fig = T.fig_traversal(tr, U.sigma2(db[1]), db_level,
                          'inclusion-based [ROOT]',
                          {'empty-caption [ROOT]': runs['null']})
    figs = [self.figure(fig, 'traversal.png', 2)]
    return evaluator.Result(metrics, details, [f for f in figs if f])
