"""UniCLIP's MP-NCE loss with domain-dependent similarity.

Lee, Kim, Shon, Kim, Kim, Lee, Kim, "UniCLIP: Unified Framework for
Contrastive Language-Image Pre-training" (NeurIPS 2022). Read from the
Chinese translation of the paper, whose equations
are garbled; the reading below was reconstructed from the surrounding text and
checked against the gradient the paper states (eq. 10).

All image views and texts live in ONE embedding space. A batch of N image-text
pairs with V augmented views per image gives M = (V + 1) N embeddings z_k,
each with a domain (image or text) and the id of its pair. For anchor i:

* P_i ∪ {i}: every embedding with the same id -- the other views of its image,
  its text, and the trivial pair (z_i, z_i) itself (section 2.2, eq. 11: "no
  reason to exclude the trivial pair"; it is the easiest positive);
* N_i: every embedding with a different id (all domains).

Domain-dependent similarity (eq. 16, generalising eq. 13-14):

  s_ij = exp( (cos(z_i, z_j) - b_D(i,j)) / tau_D(i,j) ),

with a learnable temperature tau_D and offset b_D for each of the three
domain pairs D in {image-image, image-text, text-text} (order of the arrays
here: II, IT, TT; IT and TI share one pair of parameters). In a one-domain
InfoNCE the offset cancels (eq. 15); with negatives from several domains it
does not, which is the point of eq. 16: the model learns relative thresholds.

MP-NCE (eq. 12), each positive contributing its own InfoNCE term against the
negatives only (the other positives are NOT in the denominator -- unlike
SupCon, eq. 6):

  L_i = E_{p in P_i ∪ {i}} [-w_D(i,p) log(s_ip / (s_ip + sum_{n in N_i} s_in))],

E being the mean over the anchor's positives (eq. 7 and 10 carry the 1/|P_i|),
and the batch loss the mean of L_i over all M anchors. Eq. 10's gradient,
dL_i/ds_iq = -(1/|P|) sum_n s_in / (s_iq (s_iq + sum_n s_in)), is negative for
every positive, so easy positives are never pushed apart (eq. 8, SupCon's
flaw). Weights w_D balance the domain pairs: with V = 3 views and one text per
pair a batch has 9N image-image, 6N image-text and N text-text positive
(ordered, trivial included) pairs, hence w = (1/9, 1/6, 1) -- in general
(1/V^2, 1/(2V), 1).

Initial values of tau_D, b_D are not in the text we have;
``prolip_jax.objectives.uniclip.init_uniclip_params`` uses CLIP's tau = 0.07
and b = 0 (eq. 16 then starts as eq. 13).

``mp_nce_loss`` is the one entry: with ``axis_name`` (inside ``shard_map``)
it runs ``mp_nce_loss_sharded`` (local anchors, gathered candidates).

Arithmetic in ``probabilistic.compute_dtype``: where a docstring says
float32, float64 embeddings give float64.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from prolip_jax.losses import ring
from prolip_jax.losses.contrastive import infonce_terms
from prolip_jax.losses.contrastive import unit_rows
from prolip_jax.losses.probabilistic import compute_dtype
from prolip_jax.losses.probabilistic import to_compute_dtype

Array = jax.Array

# Domain-pair indices: D(i, j) = domain_i + domain_j with image 0, text 1.
II, IT, TT = 0, 1, 2
DOMAIN_PAIRS = ('image_image', 'image_text', 'text_text')
UNICLIP_WEIGHTS = (1.0 / 9.0, 1.0 / 6.0, 1.0)  # V = 3 views, 1 text

__all__ = ['mp_nce_loss', 'mp_nce_loss_sharded', 'mp_nce_from_logits',
           'domain_logits', 'default_weights']


def default_weights(num_views: int) -> tuple[float, float, float]:
  """(w_II, w_IT, w_TT) = (1/V^2, 1/(2V), 1): equal total weight per domain
  pair for V views and one text per sample (V = 3 gives the paper's
  (1/9, 1/6, 1))."""
  return (1.0 / num_views**2, 1.0 / (2 * num_views), 1.0)


def _pair_logits(z_rows, dom_rows, z_cols, dom_cols, temperatures, offsets):
  """(cos - b_D) / tau_D between two sets of embeddings."""
  cos = unit_rows(z_rows) @ unit_rows(z_cols).T
  pair = dom_rows[:, None] + dom_cols[None, :]  # 0 II, 1 IT/TI, 2 TT
  temperatures, offsets = to_compute_dtype(temperatures, offsets)
  tau, b = temperatures[pair], offsets[pair]
  return (cos - b) / tau, pair


def domain_logits(z: Array, domains: Array, temperatures: Array,
                  offsets: Array) -> Array:
  """log s_ij of eq. 16: (cos(z_i, z_j) - b_D(i,j)) / tau_D(i,j).

  Args:
    z: ``(M, d)`` embeddings (any norm; cosine is taken).
    domains: ``(M,)`` ints, 0 for images and 1 for texts.
    temperatures: ``(3,)`` tau for (II, IT, TT), positive.
    offsets: ``(3,)`` b for (II, IT, TT).

  Returns:
    ``(M, M)`` float32 logits.
  """
  return _pair_logits(z, domains, z, domains, temperatures, offsets)[0]


def _per_positive(logits: Array, positives: Array) -> Array:
  """-log(s_ip / (s_ip + sum_{n in N_i} s_in)) on positives, 0 elsewhere."""
  (logits,) = to_compute_dtype(logits)
  neg_lse = jax.nn.logsumexp(jnp.where(positives, -jnp.inf, logits), axis=1,
                             keepdims=True)  # -inf if a row has no negatives
  # softplus(neg_lse - l_ip), not logaddexp(l_ip, neg_lse) - l_ip: the same
  # value, without the cancellation when the positive dominates.
  return jnp.where(positives, infonce_terms(neg_lse, logits), 0.0)


def mp_nce_from_logits(logits: Array, positives: Array,
                       weights: Array) -> Array:
  """Per-anchor MP-NCE L_i of eq. 12 from log-scores.

  L_i = (1/|P_i|) sum_{p in P_i} w_ip [ -l_ip + log(exp l_ip + sum_{n in N_i}
  exp l_in) ], N_i = the complement of P_i in row i.

  Args:
    logits: ``(M, M)`` l_ij = log s_ij.
    positives: ``(M, M)`` bool, P_i ∪ {i} per row (must include the diagonal
      for eq. 11-12; every row needs at least one positive).
    weights: ``(M, M)`` w_D(i,j) (only read on positives).

  Returns:
    ``(M,)`` float32 per-anchor losses.
  """
  per_pos = _per_positive(logits, positives)
  return jnp.sum(weights * per_pos, axis=1) / jnp.sum(positives, axis=1)


def mp_nce_loss(z_img_views: Array, z_txt: Array, temperatures: Array,
                offsets: Array,
                weights: Optional[Sequence[float]] = UNICLIP_WEIGHTS,
                sample_ids: Optional[Array] = None, *,
                axis_name: Optional[ring.AxisName] = None
                ) -> tuple[Array, dict[str, Array]]:
  """UniCLIP's MP-NCE loss (eq. 12) with domain-dependent scores (eq. 16).

  Over all image-image, image-text and text-text pairs of the batch in one
  space; see the module docstring for the exact reading.

  Args:
    z_img_views: ``(V, N, d)`` embeddings of V augmented views of N images
      (output of the augmentation-aware head, ``models.heads``).
    z_txt: ``(N, d)`` text embeddings; row n pairs with images ``[:, n]``.
    temperatures: ``(3,)`` tau_D for (II, IT, TT), positive.
    offsets: ``(3,)`` b_D for (II, IT, TT).
    weights: ``(w_II, w_IT, w_TT)``; default (1/9, 1/6, 1) (V = 3); use
      ``default_weights(V)`` for other V, or None for all ones (eq. 11).
    sample_ids: optional ``(N,)`` ints; samples sharing an id are positives
      of each other across all views and texts (e.g. duplicated captions or
      images). Default: every sample its own id.
    axis_name: None for the batch on one device; inside ``shard_map``, the
      mesh axis name(s) the batch is sharded over: the arrays are then local
      shards (``sample_ids`` their GLOBAL ids) and the result is
      ``mp_nce_loss_sharded``'s global loss.

  Returns:
    ``(loss, metrics)``: the mean over the M = (V + 1) N anchors of L_i, and
    metrics ``loss`` plus ``mp_nce_image_image`` / ``_image_text`` /
    ``_text_text``, the parts of the loss from each domain pair (they sum to
    the loss).
  """
  if axis_name is not None:
    return mp_nce_loss_sharded(z_img_views, z_txt, temperatures, offsets,
                               axis_name, weights, sample_ids)
  z_img_views, z_txt = to_compute_dtype(z_img_views, z_txt)
  v, n, d = z_img_views.shape
  if z_txt.shape != (n, d):
    raise ValueError(f'z_txt must be {(n, d)}, got {z_txt.shape}')
  ids = jnp.arange(n) if sample_ids is None else jnp.asarray(sample_ids)
  rows = _flatten(z_img_views, z_txt, ids)
  sums = _anchor_sums(rows, rows, temperatures, offsets, weights)
  return _finish(sums, (v + 1) * n)


def _flatten(z_img_views, z_txt, ids):
  """(V, n, d) views + (n, d) texts -> embeddings, domains, ids of the
  (V + 1) n items, views first (view-major), then texts."""
  z_img_views, z_txt = to_compute_dtype(z_img_views, z_txt)
  v, n, d = z_img_views.shape
  z = jnp.concatenate([z_img_views.reshape(v * n, d), z_txt], axis=0)
  domains = jnp.concatenate([jnp.zeros((v * n,), jnp.int32),
                             jnp.ones((n,), jnp.int32)])
  return z, domains, jnp.concatenate([jnp.tile(ids, v), ids])


def _anchor_sums(rows, cols, temperatures, offsets, weights):
  """Per domain pair, the sum over the row anchors of their weighted terms
  w_D(i,p) l_ip / |P_i ∪ {i}| (eq. 12 before the mean over anchors)."""
  z_r, dom_r, ids_r = rows
  z_c, dom_c, ids_c = cols
  positives = ids_r[:, None] == ids_c[None, :]
  logits, pair = _pair_logits(z_r, dom_r, z_c, dom_c, temperatures, offsets)
  # In the logits' dtype: 1/9 rounded to float32 would cap a float64 loss
  # at float32's precision.
  w = jnp.ones((3,), logits.dtype) if weights is None else jnp.asarray(
      weights, compute_dtype(weights, logits))
  terms = (w[pair] * _per_positive(logits, positives)
           / jnp.sum(positives, axis=1, keepdims=True))
  return jnp.stack([jnp.sum(jnp.where(pair == k, terms, 0.0))
                    for k in range(3)])


def _finish(sums, num_anchors):
  parts = sums / num_anchors
  metrics = {f'mp_nce_{name}': parts[k]
             for k, name in enumerate(DOMAIN_PAIRS)}
  loss = jnp.sum(parts)
  metrics['loss'] = loss
  return loss, metrics


def mp_nce_loss_sharded(z_img_views: Array, z_txt: Array, temperatures: Array,
                        offsets: Array, axis_name: ring.AxisName,
                        weights: Optional[Sequence[float]] = UNICLIP_WEIGHTS,
                        sample_ids: Optional[Array] = None
                        ) -> tuple[Array, dict[str, Array]]:
  """``mp_nce_loss`` of the global batch from this device's shard.

  Call inside ``shard_map`` with ``z_img_views`` sharded on its batch axis 1,
  ``z_txt`` (and ``sample_ids``) on axis 0, over ``axis_name`` (a name or a
  tuple of names); ``temperatures``/``offsets`` replicated. L_i only needs
  row i of the scores, so each device scores its own (V + 1) b anchors
  against the all-gathered (V + 1) B candidates and the per-anchor sums are
  ``psum``-ed: O(b B (V + 1)^2) logits per device (the gather form; no ring
  here). Gradients reach every shard through the gather's transpose.

  Args:
    z_img_views: ``(V, b, d)`` local views. z_txt: ``(b, d)`` local texts.
    temperatures, offsets, weights: as ``mp_nce_loss``.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.
    sample_ids: optional ``(b,)`` GLOBAL ids of the local samples; default
      the global row index (device index * b + local row).

  Returns:
    ``(loss, metrics)`` of the global batch, identical on every device.
  """
  axis_name = ring.hashable_axis(axis_name)
  v, b, _ = z_img_views.shape
  n_dev = ring.axis_size(axis_name)
  if sample_ids is None:
    sample_ids = jax.lax.axis_index(axis_name) * b + jnp.arange(b)
  rows = _flatten(z_img_views, z_txt, jnp.asarray(sample_ids))
  gather = lambda x, axis: jax.lax.all_gather(x, axis_name, axis=axis,
                                              tiled=True)
  z_img_views, z_txt = to_compute_dtype(z_img_views, z_txt)
  cols = _flatten(gather(z_img_views, 1), gather(z_txt, 0),
                  gather(jnp.asarray(sample_ids), 0))
  sums = _anchor_sums(rows, cols, temperatures, offsets, weights)
  return _finish(jax.lax.psum(sums, axis_name), (v + 1) * b * n_dev)
