"""Suites for the applications of ``prolip_jax.applications``: Bayesian
prompt re-weighting (A.8, C.7), inclusion-based traversal (4.4, B.4) and CSD
pair filtering."""

from __future__ import annotations

import os

import numpy as np

from prolip_jax import sharding as sharding_lib
from prolip_jax import uncertainty as U
from prolip_jax.applications import bprw
from prolip_jax.applications import filtering as F
from prolip_jax.applications import traversal as T
from prolip_jax.evaluation.context import Context
from prolip_jax.evaluation.context import SkipSuite
from prolip_jax.evaluation.data import load_data
from prolip_jax.evaluation.embedder import Progress
from prolip_jax.evaluation.metrics import auc
from prolip_jax.evaluation.metrics import class_gaussians
from prolip_jax.evaluation.metrics import topk_accuracy
from prolip_jax.evaluation.metrics import zero_shot_scores
from prolip_jax.evaluation.zero_shot import class_prompts


def suite_bprw(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """BPRW before/after accuracy, zero-shot and few-shot (A.8, C.7)."""
  data = ctx.data
  templates = tuple(cfg.get('templates') or data.templates)
  p_mu, p_lv = class_prompts(ctx, templates)
  if p_lv is None:
    raise SkipSuite('BPRW needs a probabilistic model')
  img = ctx.image_embeddings()
  ks = (1, 5)

  def acc(mu, var):
    s = np.asarray(zero_shot_scores(img[0], img[1], mu, var, 'csd'))
    return topk_accuracy(s, data.labels, ks)

  metrics, details, pis = {}, {'templates': list(templates)}, {}
  u_mu, u_var = class_gaussians(p_mu, p_lv)
  for k, v in acc(u_mu, u_var).items():
    metrics[f'uniform_{k}'] = v
  pi0 = np.asarray(bprw.initial_weights(p_lv))
  for k, v in acc(*bprw.reweighted_classifier(p_mu, p_lv, pi0)).items():
    metrics[f'inv_trace_{k}'] = v
  em_kw = {'max_iters': int(cfg.get('max_iters', 1000)),
           'tol': float(cfg.get('tol', 1e-7))}

  zs = cfg.zero_shot
  res, index = bprw.zero_shot_bprw(
      p_mu, p_lv, img[0], img[1], alpha=zs.alpha, eps=cfg.eps, m=zs.m,
      k=zs.k, seed=ctx.seed, **em_kw)
  for k, v in acc(res.mu, res.var).items():
    metrics[f'zeroshot_{k}'] = v
  metrics['zeroshot_neighbour_precision'] = float(np.mean(
      data.labels[index] == np.arange(len(index))[:, None]))
  details['zero_shot'] = {'pi': res.pi.tolist(), **bprw.summarize(res)}
  pis['zero-shot BPRW'] = res.pi

  fs = cfg.get('few_shot')
  if fs is not None and fs.shots > 0:
    if fs.split in ('', 'same'):  # labelled images from the eval set itself
      support = data
    else:
      support_cfg = ctx.data_cfg.copy_and_resolve_references()
      with support_cfg.unlocked():
        support_cfg.split = fs.split
        support_cfg.per_class = 0
      support = load_data(support_cfg)
    idx = bprw.few_shot_indices(support.labels, len(data.class_names),
                                fs.shots, ctx.seed).ravel()
    s_img = ctx.embedder.images(support.images[idx], desc='few-shot support')
    res_f, _ = bprw.few_shot_bprw(
        p_mu, p_lv, s_img[0], s_img[1], support.labels[idx], fs.shots,
        alpha=fs.alpha, eps=cfg.eps, total_samples=fs.total_samples,
        seed=ctx.seed, **em_kw)
    for k, v in acc(res_f.mu, res_f.var).items():
      metrics[f'fewshot{fs.shots}_{k}'] = v
    details['few_shot'] = {'pi': res_f.pi.tolist(), 'split': fs.split,
                           **bprw.summarize(res_f)}
    pis[f'{fs.shots}-shot BPRW'] = res_f.pi
  fig = bprw.fig_weights(pis, data.class_names, templates)
  figs = [ctx.figure(fig, 'bprw_weights.png', 2 * len(pis))]
  return metrics, details, figs


def suite_traversal(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """Inclusion-based traversal vs the empty-caption [ROOT] baseline (the
  embedding of "" as the root; 4.4, B.4)."""
  data = ctx.data
  if not ctx.embedder.probabilistic:
    raise SkipSuite('the inclusion traversal needs a probabilistic model')
  levels = tuple(cfg.levels)
  n = int(cfg.get('num_images', 0)) or len(data.images)
  sel = np.arange(min(n, len(data.images)))
  db_levels = tuple(cfg.get('database_levels') or levels)
  texts, level_of = [], {}
  for caps in data.captions:
    for j in db_levels:
      if caps[j] not in level_of:
        level_of[caps[j]] = levels.index(j) if j in levels else -1
        texts.append(caps[j])
  pos = {t: i for i, t in enumerate(texts)}
  db = ctx.embedder.texts(texts, desc='traversal captions')
  empty = ctx.embedder.texts([''], desc='empty caption')
  img = ctx.image_embeddings()
  img = (img[0][sel], img[1][sel])
  gt = [[pos[data.captions[i][j]] for j in levels] for i in sel]
  gt_root = [g[0] for g in gt]
  steps = int(cfg.get('steps', T.STEPS))
  eps = float(cfg.get('inclusion_eps', 0.0))
  score = cfg.get('score', 'measure')
  runs = {
      'inclusion': T.traverse(img, db, empty, steps, 'inclusion', 'csd', eps,
                              score),
      'null': T.traverse(img, db, empty, steps, 'null', 'csd'),
  }
  metrics, details = {}, {}
  for name, tr in runs.items():
    m = T.traversal_metrics(tr, gt, gt_root)
    for k, v in m.items():
      metrics[f'{name}_{k}'] = v
  tr = runs['inclusion']
  roots, counts = np.unique(tr.root, return_counts=True)
  top = np.argsort(-counts)[:10]
  details['root_captions'] = [[texts[roots[i]], int(counts[i])] for i in top]
  details['root_is_level0'] = float(np.mean(tr.root == np.asarray(gt_root)))
  metrics['inclusion_root_is_gt_level0'] = details['root_is_level0']
  details['examples'] = [
      {'key': data.keys[sel[i]],
       'ground_truth': [texts[g] for g in gt[i]],
       'root': texts[tr.root[i]],
       'path': [texts[j] for j in tr.paths[i]],
       'null_path': [texts[j] for j in runs['null'].paths[i]]}
      for i in range(min(int(cfg.get('num_examples', 5)), len(sel)))]
  details['database_size'] = len(texts)
  db_s2 = U.sigma2(db[1])
  db_level = np.array([level_of[t] for t in texts])
  fig = T.fig_traversal(runs['inclusion'], db_s2, db_level,
                        'inclusion-based [ROOT]',
                        {'empty-caption [ROOT]': runs['null']})
  figs = [ctx.figure(fig, 'traversal.png', 2)]
  return metrics, details, figs


def suite_filtering(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """CSD pair filtering on the data with a fraction of captions shuffled
  between images: how many of the shuffled pairs the filter removes."""
  data = ctx.data
  if not ctx.embedder.probabilistic:
    raise SkipSuite('CSD filtering needs a probabilistic model')
  j = int(cfg.get('caption_index', -1))
  caps = [c[j] for c in data.captions]
  rng = np.random.default_rng(ctx.seed)
  n = len(caps)
  bad = np.sort(rng.choice(n, int(round(cfg.corrupt_fraction * n)),
                           replace=False))
  shuffled = list(caps)
  for a, b in zip(bad, rng.permutation(bad)):
    shuffled[a] = caps[b]
  corrupted = np.array([shuffled[i] != caps[i] for i in range(n)])
  records = [{'image': data.images[i], 'caption': shuffled[i],
              'key': data.keys[i]} for i in range(n)]
  mesh = None
  bs = int(cfg.get('batch_size', 256))
  if cfg.get('use_mesh', True):
    mesh = sharding_lib.make_mesh({'data': -1, 'fsdp': 1})
    shards = sharding_lib.num_batch_shards(mesh)
    bs = -(-bs // shards) * shards
  keys, scores = F.score_records(
      ctx.model, records, bs, mesh, w_img=cfg.get('w_img', 0.0),
      w_txt=cfg.get('w_txt', 0.0),
      progress=Progress('filtering', ctx.embedder.progress))
  kept = F.select(keys, scores, cfg.keep_fraction)
  path = F.write_keys(os.path.join(ctx.out_dir, 'filtering_kept_keys.txt'),
                      kept)
  kept_set = set(kept)
  removed = np.array([k not in kept_set for k in keys])
  metrics = {
      'kept': len(kept), 'total': n,
      'removed_precision': float(corrupted[removed].mean()) if removed.any()
                           else float('nan'),
      'corrupted_recall': float(removed[corrupted].mean()) if corrupted.any()
                          else float('nan'),
      'auc': (auc(scores[~corrupted], scores[corrupted])
              if corrupted.any() and (~corrupted).any() else float('nan')),
  }
  threshold = float(np.min(scores[~removed])) if (~removed).any() else 0.0
  details = {'kept_keys_file': path, 'corrupted_keys': [
      keys[i] for i in np.flatnonzero(corrupted)], 'threshold': threshold,
             'caption_index': j}
  fig = F.fig_scores(scores, threshold, corrupted)
  figs = [ctx.figure(fig, 'filtering_scores.png', 1)]
  return metrics, details, figs


