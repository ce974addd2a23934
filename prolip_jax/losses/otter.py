"""OTTER: optimal-transport distillation for image-text contrastive learning.

Wu et al., "Data Efficient Language-Supervised Zero-Shot Recognition with
Optimal Transport Distillation" (ICLR 2022). Notation of the paper: a batch of
N row-aligned pairs, student embeddings ``z^v, z^t`` and EMA-teacher
embeddings ``z~^v, z~^t``, all L2-normalised ``(N, d)`` arrays.

Student (eq. 1): p_v(i, j) = softmax_j(z^v_i . z^t_j / tau), p_t likewise
over images. Targets (eq. 2): q^v_i(j) = alpha I_ij + (1 - alpha) M^v_ij with
M^v_ii = 0. Loss (eq. 3), per direction,

  L_v = -(1/N) sum_i sum_j [alpha I_ij + (1 - alpha) M^v_ij] log p_v(i, j),

and the objective is L = L_v + L_t (section 3.1 defines L_InfoNCE = L_v + L_t;
Algorithm 1 sums both directions): so ``alpha = 1`` gives 2 x ``clip_loss``.

M^v is the entropic OT plan of eq. 4-6, ``M = Diag(r) exp(S/lambda) Diag(c)``
with uniform marginals, found by Sinkhorn-Knopp exactly as Algorithm 2 (rows
renormalised to 1 at the end, so 0 iterations is a row softmax of S/lambda),
on the teacher similarity of eq. 7 / Algorithm 1:

  S^v = gamma_v Z~v Z~v^T + gamma_t Z~t Z~t^T + Z~v Z~t^T - eta I
  S^t = gamma_v Z~v Z~v^T + gamma_t Z~t Z~t^T + Z~t Z~v^T - eta I  (= S^v^T)

Paper settings: alpha = 0.5, gamma_v = gamma_t = 1, lambda = 0.15, 5
iterations, eta "a large constant, e.g., 100", EMA decay 0.999.

Both a dense form (one device holds the batch) and a blockwise form (inside
``shard_map``; never more than one ``b_local x b_local`` block of any B x B
matrix per device, on the device ring of ``prolip_jax.losses.ring``) are
provided; see ``otter_loss_blockwise``. ``otter_loss`` is the one entry:
with ``axis_name`` it runs the blockwise form. The EMA teacher itself (section 3.4)
is the run's moving average of the parameters (``optim.ema_decay``,
``prolip_jax.training.optimizer.ema_update``).

Arithmetic in ``probabilistic.compute_dtype``: where a docstring says
float32, float64 inputs give float64.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from prolip_jax.config.paper import OTTER_ALPHA
from prolip_jax.config.paper import OTTER_ETA
from prolip_jax.config.paper import OTTER_GAMMA_T
from prolip_jax.config.paper import OTTER_GAMMA_V
from prolip_jax.config.paper import OTTER_ITERS
from prolip_jax.config.paper import OTTER_LAMBDA
from prolip_jax.losses import ring
from prolip_jax.losses.probabilistic import ppcl_logits
from prolip_jax.losses.probabilistic import to_compute_dtype

Array = jax.Array

# Keyword defaults: the paper's (section 4 / Algorithm 1), the OTTER_*
# constants imported above from prolip_jax.config.paper.

__all__ = ['sinkhorn', 'otter_similarity', 'otter_targets', 'otter_loss',
           'otter_loss_blockwise']


def _lse(x, axis=None, keepdims=False):
  return jax.nn.logsumexp(x, axis=axis, keepdims=keepdims)


# ----------------------------------------------------------------------------
# Sinkhorn-Knopp (Algorithm 2)


def log_sinkhorn(S: Array, lam: float = OTTER_LAMBDA,
                 n_iter: int = OTTER_ITERS) -> Array:
  """Log of ``sinkhorn(S, lam, n_iter)``; see there. ``(N, N)`` float32."""
  (S,) = to_compute_dtype(S)
  n = S.shape[0]
  log_n = math.log(n)
  # T = exp(S / lambda); T = T / T.sum()
  log_t = S / lam
  log_t = log_t - _lse(log_t)

  def body(_, log_t):
    # T /= T.sum(dim=1, keepdim=True) * N   (row normalisation)
    log_t = log_t - (_lse(log_t, 1, True) + log_n)
    # T /= T.sum(dim=0, keepdim=True) * N   (column normalisation)
    return log_t - (_lse(log_t, 0, True) + log_n)

  log_t = jax.lax.fori_loop(0, n_iter, body, log_t)
  # return T / T.sum(dim=1, keepdim=True)  (final row normalisation)
  return log_t - _lse(log_t, 1, True)


def sinkhorn(S: Array, lam: float = OTTER_LAMBDA,
             n_iter: int = OTTER_ITERS) -> Array:
  """Entropic Sinkhorn-Knopp of OTTER's Algorithm 2, in log space.

  Algorithm 2, line by line::

    T = exp(S / lam); T /= T.sum()
    repeat n_iter times:
      T /= T.sum(1, keepdim) * N     # rows sum to 1/N
      T /= T.sum(0, keepdim) * N     # columns sum to 1/N
    return T / T.sum(1, keepdim)     # rows sum to 1

  Every step is done on log T with ``logsumexp``, so S / lam of any range (and
  ``-inf`` entries, e.g. an infinite eta on the diagonal) is safe. The result
  is ``N`` times the entropic OT plan of eq. 4-6 (marginals 1/N) once the
  iterations converge, row-normalised so row i is a distribution over j: the
  conditional M_ij of eq. 2. ``n_iter = 0`` gives ``softmax(S / lam, axis=1)``
  (paper section 3.5). For large ``n_iter`` columns also sum to 1.

  The relation to ``ott-jax``: cost ``C = -S``, ``epsilon = lam`` (absolute,
  ``relative_epsilon=None``), marginals ``a = b = 1/N``; the converged
  ``N * plan`` equals this function's output.

  Args:
    S: ``(N, N)`` similarity (larger = more likely matched).
    lam: entropic regularisation lambda of eq. 4 (paper 0.15).
    n_iter: number of row+column normalisation rounds (paper 5); an int.

  Returns:
    ``(N, N)`` float32 matrix with rows summing to 1.
  """
  return jnp.exp(log_sinkhorn(S, lam, n_iter))


# ----------------------------------------------------------------------------
# Teacher similarity and targets (eq. 7, Algorithm 1)


def otter_similarity(img_t: Array, txt_t: Array, gamma_v: float = OTTER_GAMMA_V,
                     gamma_t: float = OTTER_GAMMA_T, eta: float = OTTER_ETA
                     ) -> tuple[Array, Array]:
  """``(S_v, S_t)`` of eq. 7 / Algorithm 1 from teacher embeddings.

  S_v = gamma_v sim_vv + gamma_t sim_tt + sim_vt - eta I,
  S_t = gamma_v sim_vv + gamma_t sim_tt + sim_tv - eta I,
  sim_ab = Z~a Z~b^T. Row i of S_v scores text j for image i; row i of S_t
  scores image j for text i. The diagonal is set to ``-eta`` through
  ``where`` (so ``eta = inf`` works).

  Args:
    img_t, txt_t: ``(N, d)`` L2-normalised teacher embeddings.

  Returns:
    two ``(N, N)`` float32 matrices.
  """
  img_t, txt_t = to_compute_dtype(img_t, txt_t)
  sim_vv = img_t @ img_t.T
  sim_tt = txt_t @ txt_t.T
  sim_vt = img_t @ txt_t.T
  eye = jnp.eye(img_t.shape[0], dtype=bool)
  base = gamma_v * sim_vv + gamma_t * sim_tt
  s_v = jnp.where(eye, -eta, base + sim_vt)
  s_t = jnp.where(eye, -eta, base + sim_vt.T)
  return s_v, s_t


def otter_targets(img_t: Array, txt_t: Array, lam: float = OTTER_LAMBDA,
                  n_iter: int = OTTER_ITERS, gamma_v: float = OTTER_GAMMA_V,
                  gamma_t: float = OTTER_GAMMA_T, eta: float = OTTER_ETA
                  ) -> tuple[Array, Array]:
  """OT distillation targets ``(M_v, M_t)`` (eq. 2, 6, 7; Algorithm 1).

  ``M_v = sinkhorn(S_v)``, ``M_t = sinkhorn(S_t)`` with the diagonals then set
  to exactly 0 (eq. 2: M_ii = 0; with eta = 100 and lam = 0.15 they are
  already exp(-667) = 0 in float32, and rows still sum to 1). Row i of
  ``M_v`` is a distribution over texts for image i, row i of ``M_t`` over
  images for text i. Gradients are stopped (the teacher is not trained).

  Args:
    img_t, txt_t: ``(N, d)`` L2-normalised EMA-teacher embeddings (N >= 2).
    lam, n_iter: Sinkhorn settings (paper 0.15, 5).
    gamma_v, gamma_t: weights of image-image / text-text similarity (paper 1).
    eta: diagonal penalty (paper: a large constant, e.g. 100; inf allowed).

  Returns:
    ``(M_v, M_t)``, each ``(N, N)`` float32.
  """
  img_t, txt_t = jax.lax.stop_gradient(to_compute_dtype(img_t, txt_t))
  s_v, s_t = otter_similarity(img_t, txt_t, gamma_v, gamma_t, eta)
  eye = jnp.eye(s_v.shape[0], dtype=bool)
  m_v = jnp.where(eye, 0.0, sinkhorn(s_v, lam, n_iter))
  m_t = jnp.where(eye, 0.0, sinkhorn(s_t, lam, n_iter))
  return m_v, m_t


# ----------------------------------------------------------------------------
# Dense loss


def _student_logits(img, txt, scale, logvar_img, logvar_txt):
  """(N, N) student logits, image rows; CSD-based if logvars are given."""
  if (logvar_img is None) != (logvar_txt is None):
    raise ValueError('give both logvar_img and logvar_txt, or neither')
  if logvar_img is None:
    img, txt = to_compute_dtype(img, txt)
    return scale * (img @ txt.T)
  return ppcl_logits(img, logvar_img, txt, logvar_txt, scale, 0.0)


def _soft_ce_rows(logits, targets):
  """sum_i -sum_j targets_ij log softmax_j(logits_ij), per row ``(N,)``."""
  log_p = jax.nn.log_softmax(logits, axis=1)
  return -jnp.sum(targets * log_p, axis=1)


def otter_loss(img: Array, txt: Array, img_t: Array, txt_t: Array,
               scale: Array, alpha: float = OTTER_ALPHA,
               lam: float = OTTER_LAMBDA, n_iter: int = OTTER_ITERS,
               gamma_v: float = OTTER_GAMMA_V, gamma_t: float = OTTER_GAMMA_T,
               eta: float = OTTER_ETA, logvar_img: Optional[Array] = None,
               logvar_txt: Optional[Array] = None, *,
               axis_name: Optional[ring.AxisName] = None
               ) -> tuple[Array, dict[str, Array]]:
  """OTTER's objective (eq. 3, Algorithm 1); blockwise with ``axis_name``.

  L = alpha * L_InfoNCE + (1 - alpha) * L_d with
  L_InfoNCE = CE(p_v, I) + CE(p_t, I) and L_d = CE(p_v, M_v) + CE(p_t, M_t),
  each CE averaged over the N rows (eq. 1, 3: the 1/N), summed over the two
  directions. ``M_v, M_t = otter_targets(img_t, txt_t, ...)`` (diagonals 0).
  This equals eq. 3's L_v + L_t with targets alpha I + (1 - alpha) M.

  Student logits: ``scale * z^v_i . z^t_j`` (``scale`` = 1/tau, the repo's
  convention). Probabilistic variant (supported, dense and blockwise): given
  ``logvar_img`` and ``logvar_txt``, the logits are the CSD-based
  ``ppcl_logits(mu_img, lv_img, mu_txt, lv_txt, scale, 0)`` =
  scale * (mu_i.mu_j - tr(S_i)/2 - tr(S_j)/2) = -scale * CSD_ij / 2 + const
  for unit means; the teacher similarity still uses the teacher means only.
  In p_v the image's own trace cancels in the softmax, so only the candidate
  texts' variances act (and vice versa for p_t).

  Args:
    img, txt: ``(N, d)`` L2-normalised student embeddings (means), row-aligned.
    img_t, txt_t: ``(N, d)`` L2-normalised EMA-teacher embeddings.
    scale: inverse temperature 1/tau (scalar).
    alpha: weight of the hard InfoNCE labels (paper 0.5).
    lam, n_iter, gamma_v, gamma_t, eta: see ``otter_targets``.
    logvar_img, logvar_txt: optional ``(N, d)`` log-variances.
    axis_name: None for the batch on one device; inside ``shard_map``, the
      mesh axis name(s) the batch is sharded over: the arrays are then local
      shards and the result is ``otter_loss_blockwise``'s global loss.

  Returns:
    ``(loss, metrics)`` with metrics ``loss``, ``infonce`` (L_v + L_t with
    one-hot targets) and ``otter_distill`` (L_d).
  """
  if axis_name is not None:
    return otter_loss_blockwise(img, txt, img_t, txt_t, scale, axis_name,
                                alpha=alpha, lam=lam, n_iter=n_iter,
                                gamma_v=gamma_v, gamma_t=gamma_t, eta=eta,
                                logvar_img=logvar_img, logvar_txt=logvar_txt)
  logits = _student_logits(img, txt, scale, logvar_img, logvar_txt)
  m_v, m_t = otter_targets(img_t, txt_t, lam, n_iter, gamma_v, gamma_t, eta)
  eye = jnp.eye(logits.shape[0], dtype=logits.dtype)
  infonce = (jnp.mean(_soft_ce_rows(logits, eye))
             + jnp.mean(_soft_ce_rows(logits.T, eye)))
  distill = (jnp.mean(_soft_ce_rows(logits, m_v))
             + jnp.mean(_soft_ce_rows(logits.T, m_t)))
  loss = alpha * infonce + (1.0 - alpha) * distill
  return loss, {'loss': loss, 'infonce': infonce, 'otter_distill': distill}


# ----------------------------------------------------------------------------
# Blockwise (ring) form


def _row_features(r, o):
  """a_i = [r_i, o_i] for rows of modality r (o: the other modality)."""
  return jnp.concatenate([r, o], axis=-1)


def _col_features(r, o, gamma_row, gamma_col):
  """c_j = [gamma_row r_j + o_j, gamma_col o_j], so that

  a_i . c_j = gamma_row r_i.r_j + r_i.o_j + gamma_col o_i.o_j,

  i.e. eq. 7 without -eta I: S_v for (r, o) = (images, texts) with
  (gamma_row, gamma_col) = (gamma_v, gamma_t), S_t for (texts, images) with
  (gamma_t, gamma_v).
  """
  return jnp.concatenate([gamma_row * r + o, gamma_col * o], axis=-1)


def _s_block(a, c, is_own, eta):
  """A ``(b, b)`` block of S from row / column features; -eta on the own
  block's diagonal (``is_own`` is a Python bool)."""
  s = a @ c.T
  if is_own:
    s = jnp.where(jnp.eye(*s.shape, dtype=bool), -eta, s)
  return s


def _direction_blockwise(stu_row, stu_col, logits_fn, tea_row, tea_other,
                         gamma_row, gamma_col, lam, n_iter, eta, axis_name):
  """Sum over local rows of eq. 3's row loss, for one direction.

  Rows are this device's anchors (images for L_v); columns are the
  candidates (texts for L_v), visited block by block around the ring.
  ``tea_row`` is the local teacher embedding of the rows' modality and
  ``tea_other`` of the other modality, with ``gamma_row`` / ``gamma_col``
  their weights, so one function serves both directions (S_t is S_v with the
  modalities swapped). Returns the local sums (over this device's rows) of
  the InfoNCE and the distillation cross-entropies.
  """
  b = tea_row.shape[0]
  n_dev = ring.axis_size(axis_name)
  log_n = math.log(b * n_dev)
  # This device's samples are both its rows and its columns of S.
  a_loc = jax.lax.stop_gradient(_row_features(tea_row, tea_other))
  c_loc = jax.lax.stop_gradient(
      _col_features(tea_row, tea_other, gamma_row, gamma_col))
  dtype = tea_row.dtype
  neg_inf = jnp.full((b,), -jnp.inf, dtype)

  def row_lse(g):
    """lse_j (S_ij / lam + g_j) for the local rows i; g over columns."""
    def fn(acc, blk, is_own):
      c, g_blk = blk
      s = _s_block(a_loc, c, is_own, eta) / lam + g_blk[None, :]
      return jnp.logaddexp(acc, _lse(s, 1))
    return ring.ring_fold(fn, (c_loc, g), neg_inf, axis_name)

  def col_lse(f):
    """lse_i (S_ij / lam + f_i) for the local columns j; f over rows."""
    def fn(acc, blk, is_own):
      a, f_blk = blk
      s = _s_block(a, c_loc, is_own, eta) / lam + f_blk[:, None]
      return jnp.logaddexp(acc, _lse(s, 0))
    return ring.ring_fold(fn, (a_loc, f), neg_inf, axis_name)

  # Algorithm 2 as potentials: log T_ij = S_ij / lam + f_i + g_j. The global
  # normalisation T /= T.sum() only shifts f and is undone exactly by the
  # first row normalisation, so it is skipped.
  def sinkhorn_iter(_, g):
    f = -(row_lse(g) + log_n)  # T /= T.sum(1) * N
    return -(col_lse(f) + log_n)  # T /= T.sum(0) * N

  g = jax.lax.fori_loop(0, n_iter, sinkhorn_iter,
                        ring.varying(jnp.zeros((b,), dtype), axis_name))
  f = -row_lse(g)  # final row normalisation: rows of M sum to 1

  # Loss pass: per row, lse of the student logits, sum_j M_ij logit_ij,
  # sum_j M_ij and the positive logit (own block's diagonal).
  def loss_fn(acc, blk, is_own):
    lse_acc, m_logit, m_sum, diag = acc
    stu, c, g_blk = blk
    logits = logits_fn(stu_row, stu)
    log_m = _s_block(a_loc, c, is_own, eta) / lam + f[:, None] + g_blk[None]
    m = jnp.exp(log_m)
    if is_own:  # eq. 2: M_ii = 0 exactly
      eye = jnp.eye(*m.shape, dtype=bool)
      m = jnp.where(eye, 0.0, m)
      diag = diag + jnp.diagonal(logits)
    m = jax.lax.stop_gradient(m)
    return (jnp.logaddexp(lse_acc, _lse(logits, 1)),
            m_logit + jnp.sum(m * logits, 1), m_sum + jnp.sum(m, 1), diag)

  zeros = jnp.zeros((b,), dtype)
  lse, m_logit, m_sum, diag = ring.ring_fold(
      loss_fn, (stu_col, c_loc, g), (neg_inf, zeros, zeros, zeros),
      axis_name)
  infonce = jnp.sum(lse - diag)
  distill = jnp.sum(m_sum * lse - m_logit)
  return infonce, distill


def otter_loss_blockwise(img: Array, txt: Array, img_t: Array, txt_t: Array,
                         scale: Array, axis_name: ring.AxisName,
                         alpha: float = OTTER_ALPHA,
                         lam: float = OTTER_LAMBDA,
                         n_iter: int = OTTER_ITERS,
                         gamma_v: float = OTTER_GAMMA_V,
                         gamma_t: float = OTTER_GAMMA_T, eta: float = OTTER_ETA,
                         logvar_img: Optional[Array] = None,
                         logvar_txt: Optional[Array] = None
                         ) -> tuple[Array, dict[str, Array]]:
  """``otter_loss`` of the global batch from this device's shard.

  Call inside ``shard_map`` with every array argument batch-sharded over
  ``axis_name`` (a name or tuple of names) and ``scale`` replicated. Returns
  the same ``(loss, metrics)`` as ``otter_loss`` on the gathered batch, on
  every device (device k's local rows are global rows k*b .. k*b+b-1 in the
  linear order of ``axis_name``, the order ``shard_map`` uses).

  Nothing of size B x B, nor b_local x B, is ever held: Sinkhorn runs on
  potentials, log T_ij = S_ij/lam + f_i + g_j, with f the local rows' and g
  the local columns' (this device's samples are both its rows and its
  columns). Each half-iteration is one ring pass:

  * row normalisation, f_i = -lse_j(S_ij/lam + g_j) - log N: the column
    features and g of every device visit this device, which scores one
    ``b x b`` block of S at a time and folds its logsumexp online;
  * column normalisation, g_j = -lse_i(S_ij/lam + f_i) - log N: the row
    features and f travel instead, folded over rows for the local columns.

  S is factorised as S_ij = a_i . c_j with a_i = [v_i, t_i] and
  c_j = [gamma_v v_j + t_j, gamma_t t_j] (eq. 7), so a pass moves one
  ``(b, 2d)`` feature block and a ``(b,)`` potential per hop. A final pass
  carries the student text block too and accumulates, per local row, the
  logsumexp of the student logits, sum_j M_ij logit_ij, sum_j M_ij and the
  positive logit, from which both CE terms follow. Per direction that is
  ``2 * n_iter + 2`` ring passes of N - 1 hops; both directions run (S_t is S_v
  with the modalities swapped, and the student block that travels is the
  images for L_t). Per device: O(b^2) for one block, O(b d) per payload.
  The price is compute and latency: with the paper's 5 iterations that is
  24 ring passes in all, each re-scoring its B x B / N share of S (2d-wide
  dot products), where an all-gather form would score a b x B slab once --
  at O(b B) memory. At OTTER's d and batch sizes the S passes cost about as
  much as 24 extra logits evaluations of a CLIP loss, small next to the
  towers.

  Gradients flow to the student arrays and ``scale`` (through ``ppermute``
  and the final ``psum``, see ``ring``); the targets are constants.

  Args:
    img, txt, img_t, txt_t: ``(b_local, d)`` local shards (see otter_loss).
    scale: inverse temperature, replicated.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.
    alpha, lam, n_iter, gamma_v, gamma_t, eta: see ``otter_loss``.
    logvar_img, logvar_txt: optional local log-variances (CSD logits).

  Returns:
    ``(loss, metrics)`` of the global batch, identical on every device.
  """
  axis_name = ring.hashable_axis(axis_name)
  if (logvar_img is None) != (logvar_txt is None):
    raise ValueError('give both logvar_img and logvar_txt, or neither')
  b = img.shape[0]
  n_dev = ring.axis_size(axis_name)
  img_t, txt_t = jax.lax.stop_gradient(to_compute_dtype(img_t, txt_t))
  if logvar_img is None:
    stu_img, stu_txt = to_compute_dtype(img, txt)
    logits_fn = lambda rows, cols: scale * (rows @ cols.T)
  else:
    stu_img = to_compute_dtype(img, logvar_img)
    stu_txt = to_compute_dtype(txt, logvar_txt)
    logits_fn = lambda rows, cols: ppcl_logits(rows[0], rows[1], cols[0],
                                               cols[1], scale, 0.0)
  common = dict(lam=lam, n_iter=n_iter, eta=eta, axis_name=axis_name)
  # L_v: image rows, text columns; S_v = g_v vv + g_t tt + v.t.
  nce_v, dis_v = _direction_blockwise(stu_img, stu_txt, logits_fn, img_t,
                                      txt_t, gamma_v, gamma_t, **common)
  # L_t: text rows, image columns; S_t = g_t tt + g_v vv + t.v.
  nce_t, dis_t = _direction_blockwise(stu_txt, stu_img, logits_fn, txt_t,
                                      img_t, gamma_t, gamma_v, **common)
  total_b = b * n_dev
  infonce = jax.lax.psum(nce_v + nce_t, axis_name) / total_b
  distill = jax.lax.psum(dis_v + dis_t, axis_name) / total_b
  loss = alpha * infonce + (1.0 - alpha) * distill
  return loss, {'loss': loss, 'infonce': infonce, 'otter_distill': distill}
