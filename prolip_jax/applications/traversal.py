"""Inclusion-based image traversal (paper 4.4, B.4; after Alper &
Averbuch-Elor, 2024).

For an image Z_v:

1. retrieve its nearest caption Z_c in a caption database by CSD (eq. 1);
2. find the database caption that includes Z_c most (B.4): by default the
   inclusion measure inc(Z_c, Z_k) of eq. 3 (``score='measure'``; Z_c itself
   is not a candidate). ``score='hypothesis'`` ranks by
   the inclusion hypothesis H(Z_c ⊂ Z_k) of eq. 4 instead (Fig. 9's wording);
   H grows with the candidate's width *and* its distance once the candidate
   is wider than Z_c, so on weakly trained models it tends to pick the same
   wide, unrelated caption for every image;
3. [ROOT] = the average of that caption's Gaussian and the empty caption's
   ("" embedding): mean of the means and of the variances (paper 4.4: the
   average keeps the traversal diverse);
4. interpolate [ROOT] -> Z_c linearly in (mu, sigma^2) over ``steps`` (50)
   equally spaced points and retrieve the nearest caption (CSD) at each.

``root='null'`` is the deterministic baseline: [ROOT] = the "" embedding
alone (with ``metric='cosine'`` it is the CLIP protocol).

Metrics (``traversal_metrics``), per image then averaged, against the ground
truth hierarchy of each image (a set of database captions, plus its most
general one):

* ``root_R@1``: the caption retrieved at the [ROOT] end (step 0) is the
  image's ground-truth most general caption;
* ``precision``: |distinct retrieved ∩ GT| / |distinct retrieved|;
* ``recall``: |distinct retrieved ∩ GT| / |GT|.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax import plotting

from prolip_jax.losses import csd
from prolip_jax.losses import inclusion_hypothesis
from prolip_jax.losses import log_inclusion

STEPS = 50


@jax.jit
def _pair_scores_h(q_mu, q_lv, d_mu, d_lv, eps):
  return inclusion_hypothesis(q_mu[:, None], q_lv[:, None], d_mu[None],
                              d_lv[None], eps=eps)


@jax.jit
def _pair_scores_inc(q_mu, q_lv, d_mu, d_lv, eps):
  return jnp.sum(log_inclusion(q_mu[:, None], q_lv[:, None], d_mu[None],
                               d_lv[None], eps=eps), -1)


def inclusion_matrix(query: tuple, database: tuple, eps: float = 0.0,
                     score: str = 'measure', chunk: int = 256
                     ) -> np.ndarray:
  """``(n, T)``: H(query_i ⊂ db_k) (or inc(query_i, db_k)), chunked over
  queries so memory stays ``chunk * T * d``."""
  fn = {'hypothesis': _pair_scores_h, 'measure': _pair_scores_inc}.get(score)
  if fn is None:
    raise ValueError(f"score must be 'hypothesis' or 'measure', got {score!r}")
  q_mu, q_lv = (np.asarray(a, np.float32) for a in query)
  d_mu, d_lv = (jnp.asarray(a, jnp.float32) for a in database)
  out = []
  for i in range(0, len(q_mu), chunk):
    out.append(np.asarray(fn(q_mu[i:i + chunk], q_lv[i:i + chunk], d_mu,
                             d_lv, jnp.float32(eps))))
  return np.concatenate(out) if out else np.zeros((0, len(d_mu)), np.float32)


def most_inclusive(query_index: np.ndarray, database: tuple, eps: float = 0.0,
                   score: str = 'measure') -> np.ndarray:
  """For database captions ``query_index`` ``(n,)``, the index of the database
  caption that includes each most (``score='measure'`` skips the query
  itself)."""
  query_index = np.asarray(query_index)
  uniq, inv = np.unique(query_index, return_inverse=True)
  mu, lv = (np.asarray(a) for a in database)
  m = inclusion_matrix((mu[uniq], lv[uniq]), (mu, lv), eps, score)
  if score == 'measure':
    m[np.arange(len(uniq)), uniq] = -np.inf
  return np.argmax(m, axis=1)[inv]


def nearest(query: tuple, database: tuple, metric: str = 'csd',
            chunk: int = 1024) -> np.ndarray:
  """Index of the nearest database entry for each query: smallest CSD or
  largest cosine of the means."""
  q_mu, q_lv = query
  d_mu, d_lv = database
  out = []
  for i in range(0, len(q_mu), chunk):
    if metric == 'csd':
      d = np.asarray(csd(q_mu[i:i + chunk], q_lv[i:i + chunk], d_mu, d_lv))
      out.append(np.argmin(d, axis=1))
    elif metric == 'cosine':
      qn = q_mu[i:i + chunk] / np.linalg.norm(q_mu[i:i + chunk], axis=1,
                                              keepdims=True)
      dn = d_mu / np.linalg.norm(d_mu, axis=1, keepdims=True)
      out.append(np.argmax(qn @ dn.T, axis=1))
    else:
      raise ValueError(f"metric must be 'csd' or 'cosine', got {metric!r}")
  return np.concatenate(out)


@dataclasses.dataclass
class Traversal:
  """``nearest``: ``(n,)`` caption nearest each image; ``root``: ``(n,)`` the
  most inclusive caption (-1 for ``root='null'``); ``steps``: ``(n, S)``
  caption retrieved at each interpolation step (step 0 = [ROOT] end);
  ``paths``: the distinct captions of ``steps`` in order of appearance."""
  nearest: np.ndarray
  root: np.ndarray
  steps: np.ndarray
  paths: list[list[int]]


def traverse(images: tuple, database: tuple, empty: tuple,
             steps: int = STEPS, root: str = 'inclusion',
             metric: str = 'csd', eps: float = 0.0,
             score: str = 'measure') -> Traversal:
  """Image traversals from [ROOT] to each image's nearest caption.

  Args:
    images: ``(mu, logvar)`` ``(n, d)``.
    database: ``(mu, logvar)`` ``(T, d)`` caption embeddings (distinct
      captions).
    empty: ``(mu, logvar)`` ``(d,)`` or ``(1, d)``, the "" caption.
    steps: interpolation points, both ends included.
    root: ``'inclusion'`` (paper) or ``'null'`` (the "" embedding alone).
    metric: retrieval distance, ``'csd'`` or ``'cosine'``.
    eps, score: see ``most_inclusive``.

  Returns:
    ``Traversal``.
  """
  img_mu, img_lv = (np.asarray(a, np.float32) for a in images)
  db_mu, db_lv = (np.asarray(a, np.float32) for a in database)
  e_mu = np.asarray(empty[0], np.float32).reshape(-1)
  e_var = np.exp(np.asarray(empty[1], np.float32).reshape(-1))
  db_var = np.exp(db_lv)
  near = nearest((img_mu, img_lv), (db_mu, db_lv), metric)
  if root == 'inclusion':
    r = most_inclusive(near, (db_mu, db_lv), eps, score)
    root_mu = 0.5 * (db_mu[r] + e_mu)
    root_var = 0.5 * (db_var[r] + e_var)
  elif root == 'null':
    r = np.full(len(near), -1)
    root_mu = np.broadcast_to(e_mu, db_mu[near].shape)
    root_var = np.broadcast_to(e_var, db_mu[near].shape)
  else:
    raise ValueError(f"root must be 'inclusion' or 'null', got {root!r}")
  t = np.linspace(0.0, 1.0, steps, dtype=np.float32)[None, :, None]
  mu_t = (1 - t) * root_mu[:, None] + t * db_mu[near][:, None]
  var_t = (1 - t) * root_var[:, None] + t * db_var[near][:, None]
  n, d = len(near), db_mu.shape[1]
  idx = nearest((mu_t.reshape(-1, d), np.log(var_t).reshape(-1, d)),
                (db_mu, db_lv), metric).reshape(n, steps)
  paths = [list(dict.fromkeys(row.tolist())) for row in idx]
  return Traversal(near, r, idx, paths)


def traversal_metrics(trav: Traversal, gt: Sequence[Sequence[int]],
                      gt_root: Optional[Sequence[int]] = None) -> dict:
  """Precision / recall of the distinct retrieved captions against each
  image's ground-truth caption set ``gt`` (database indices), and
  ``root_R@1`` against ``gt_root`` (the GT most general caption)."""
  prec, rec = [], []
  for path, g in zip(trav.paths, gt):
    g = set(int(x) for x in g)
    hit = len(set(path) & g)
    prec.append(hit / max(len(set(path)), 1))
    rec.append(hit / max(len(g), 1))
  out = {'precision': float(np.mean(prec)), 'recall': float(np.mean(rec)),
         'path_length': float(np.mean([len(p) for p in trav.paths]))}
  if gt_root is not None:
    out['root_R@1'] = float(np.mean(trav.steps[:, 0] == np.asarray(gt_root)))
  return out


@plotting.styled
def fig_traversal(trav: Traversal, db_sigma2: np.ndarray,
                  db_level: Optional[np.ndarray] = None,
                  label: str = 'inclusion-based [ROOT]',
                  others: Optional[dict] = None):
  """Mean sigma_t^2 of the caption retrieved at each step (axis 1) and, when
  ``db_level`` (level of each database caption, -1 unknown) is given, its mean
  hierarchy level (axis 2): 1 or 2 axes. ``others``: extra label ->
  Traversal drawn on the same axes."""
  plt = plotting.pyplot()
  ncols = 1 if db_level is None else 2
  fig, axes = plt.subplots(1, ncols, figsize=(4.5 * ncols, 3.4),
                           squeeze=False)
  runs = {label: trav, **(others or {})}
  for name, tr in runs.items():
    s = np.asarray(db_sigma2)[tr.steps]
    axes[0, 0].plot(np.linspace(0, 1, s.shape[1]), s.mean(0), label=name)
    if db_level is not None:
      lv = np.asarray(db_level, np.float64)[tr.steps]
      lv = np.where(lv < 0, np.nan, lv)
      axes[0, 1].plot(np.linspace(0, 1, lv.shape[1]), np.nanmean(lv, 0),
                      label=name)
  axes[0, 0].set_xlabel('t ([ROOT] → nearest caption)')
  axes[0, 0].set_ylabel(r'mean $\sigma_t^2$ of retrieved caption')
  plotting.log_axis(axes[0, 0], 'y')
  axes[0, 0].legend()
  if db_level is not None:
    axes[0, 1].set_xlabel('t ([ROOT] → nearest caption)')
    axes[0, 1].set_ylabel('mean hierarchy level retrieved')
    axes[0, 1].legend()
  return fig
