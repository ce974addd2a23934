"""Deterministic contrastive baselines: SigLIP's sigmoid loss and CLIP's InfoNCE.

Same conventions as ``ppcl_loss``: row i of the images is paired with row i of
the texts, ``scale`` is the temperature multiplier itself (the model stores its
log), inputs are ``(n, d)`` L2-normalised embeddings, arithmetic in
``probabilistic.compute_dtype`` (float32, or float64 for float64 inputs; where
a docstring says float32, float64 inputs give float64).

Each loss has a dense form and a blockwise form for a batch sharded over the
devices of ``axis_name`` (called inside ``shard_map``; the loss of the global
batch on every device, on the device ring of ``prolip_jax.losses.ring``):

  siglip_loss_blockwise == siglip_loss  (SigLIP eq. 1, bidirectional ring)
  clip_loss_blockwise   == clip_loss    (two one-way rings, online logsumexp)

The dense function is each loss's one entry: with ``axis_name`` it runs the
blockwise form.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from prolip_jax.losses import ring
from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_blockwise
from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_sum
from prolip_jax.losses.probabilistic import to_compute_dtype

Array = jax.Array


def unit_rows(x: Array) -> Array:
  """``x / ||x||`` along the last axis in float32 (a zero row stays zero)."""
  (x,) = to_compute_dtype(x)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def siglip_logits(emb_img: Array, emb_txt: Array, scale: Array,
                  bias: Array) -> Array:
  """``(n, m)`` logits ``scale * img @ txt.T + bias`` in float32."""
  emb_img, emb_txt = to_compute_dtype(emb_img, emb_txt)
  return scale * (emb_img @ emb_txt.T) + bias


def siglip_loss(emb_img: Array, emb_txt: Array, scale: Array,
                bias: Array, *, axis_name: Optional[ring.AxisName] = None
                ) -> Array:
  """SigLIP's pairwise sigmoid loss (Zhai et al., 2023, eq. 1).

  ``-sum_ij log sigmoid(y_ij (t x_i . y_j + b)) / n`` with y_ij = +1 on the
  diagonal and -1 elsewhere; normalised per image like ``ppcl_loss``.

  Args:
    emb_img, emb_txt: ``(n, d)`` L2-normalised embeddings.
    scale: ``t`` (init 10). bias: ``b`` (init -10).
    axis_name: None for the batch on one device; inside ``shard_map``, the
      mesh axis name(s) the batch is sharded over: the arrays are then local
      shards and the result is ``siglip_loss_blockwise``'s global loss.

  Returns:
    scalar float32 loss.
  """
  if axis_name is not None:
    return siglip_loss_blockwise(emb_img, emb_txt, scale, bias, axis_name)
  logits = siglip_logits(emb_img, emb_txt, scale, bias)
  return sigmoid_pairwise_loss_sum(logits) / logits.shape[0]


def siglip_loss_blockwise(emb_img: Array, emb_txt: Array, scale: Array,
                          bias: Array, axis_name: ring.AxisName) -> Array:
  """SigLIP's sigmoid loss (Zhai et al. 2023, eq. 1) of the global batch.

  Call inside ``shard_map``. Equals ``siglip_loss`` on the gathered batch:
  ``-(1/B) sum_{i,j} log sigmoid(y_ij (t x_i . y_j + b))``. ``emb_txt``
  travels the bidirectional device ring (``ring.ring_sum``, SigLIP's
  "chunked" loss of section 3.3); per-device logits memory is
  O(b_local^2).

  Args:
    emb_img, emb_txt: ``(b_local, d)`` local, row-aligned, L2-normalised.
    scale: ``t``, bias: ``b``; replicated scalars.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.

  Returns:
    scalar float32 loss of the global batch, the same on every device.
  """
  return sigmoid_pairwise_loss_blockwise(
      lambda img, txt: siglip_logits(img, txt, scale, bias), emb_img, emb_txt,
      axis_name)


def infonce_terms(lse_negatives: Array, positive: Array) -> Array:
  """Per-anchor InfoNCE term ``-log(e^p / (e^p + sum_n e^l_n))``, stably.

  Computed as ``softplus(lse_n(l_n) - p)`` from the logsumexp of the
  NEGATIVES only. The textbook ``logsumexp(p, l_1, ...) - p`` cancels when
  the positive dominates: that logsumexp is p + log1p(sum_n e^(l_n - p)),
  rounded in float32 to near p before p is subtracted, so a term of 1e-7
  comes out with a relative error of order 1 (as does the positive's
  gradient, softmax - 1). Both are the same function, gradients included
  (sigmoid(lse - p) times the negatives' softmax, minus that on p); this one
  keeps float32's relative precision whatever the size of the term.

  An anchor without negatives (``lse_negatives = -inf``) gets 0 with zero
  gradients. (The -inf logsumexp of an all-masked row sends NaN cotangents
  to its masked entries only; the ``jnp.where`` that masked them drops them.)

  Args:
    lse_negatives: ``(...)`` logsumexp of each anchor's negative logits.
    positive: ``(...)`` the positive logit of each anchor.

  Returns:
    ``(...)`` terms, each >= 0, in the dtype of the inputs.
  """
  return jax.nn.softplus(lse_negatives - positive)


def clip_loss(emb_img: Array, emb_txt: Array, scale: Array, *,
              axis_name: Optional[ring.AxisName] = None) -> Array:
  """CLIP's symmetric InfoNCE (Radford et al., 2021).

  Mean of the image-to-text and text-to-image cross-entropies over logits
  ``L = scale * img @ txt.T`` with the matching pair as target:

    l_i = -log softmax_j(L_ij)[i] = softplus(lse_{j != i} L_ij - L_ii)

  and the same over columns. Each term is taken from the logsumexp of the
  off-diagonal logits (``infonce_terms``), so values and gradients keep
  float32's relative precision on nearly separated batches (tested to 1e-4
  against float64 down to a loss of 1e-7).

  Args:
    emb_img, emb_txt: ``(n, d)`` L2-normalised embeddings.
    scale: the inverse temperature (CLIP initialises it to 1/0.07).
    axis_name: None for the batch on one device; inside ``shard_map``, the
      mesh axis name(s) the batch is sharded over: the arrays are then local
      shards and the result is ``clip_loss_blockwise``'s global loss.

  Returns:
    scalar float32 loss.
  """
  if axis_name is not None:
    return clip_loss_blockwise(emb_img, emb_txt, scale, axis_name)
  logits = siglip_logits(emb_img, emb_txt, scale, 0.0)
  diag = jnp.diagonal(logits)
  negatives = jnp.where(jnp.eye(*logits.shape, dtype=bool), -jnp.inf, logits)
  i2t = infonce_terms(jax.nn.logsumexp(negatives, axis=1), diag)
  t2i = infonce_terms(jax.nn.logsumexp(negatives, axis=0), diag)
  return 0.5 * (jnp.mean(i2t) + jnp.mean(t2i))


def clip_loss_blockwise(emb_img: Array, emb_txt: Array, scale: Array,
                        axis_name: ring.AxisName) -> Array:
  """``clip_loss`` of the global batch from this device's shard.

  CLIP's symmetric InfoNCE needs, per row, a logsumexp over the B - 1
  negatives in each direction; each row's term is then
  ``softplus(lse_negatives - positive)`` (``infonce_terms``: no cancellation
  when the positive dominates, unlike logsumexp over all B minus the
  positive). Two one-way ring passes (``ring.ring_fold``) fold that
  logsumexp online, one ``b_local x b_local`` block of logits at a time:
  texts travel past the local images (image-to-text), then images past the
  local texts (text-to-image); the positives are the own block's diagonal,
  masked out of the logsumexp there. Memory per device is O(b_local^2) for
  logits, as for the sigmoid losses; each pass is N - 1 hops (one
  direction: a running logsumexp cannot merge the two ends of a
  bidirectional ring any cheaper).

  Args:
    emb_img, emb_txt: ``(b_local, d)`` local shards of the L2-normalised
      embeddings, row-aligned.
    scale: the inverse temperature, replicated.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.

  Returns:
    scalar float32 loss of the global batch, identical on every device.
  """
  axis_name = ring.hashable_axis(axis_name)
  emb_img, emb_txt = to_compute_dtype(emb_img, emb_txt)
  b = emb_img.shape[0]
  neg_inf = jnp.full((b,), -jnp.inf, emb_img.dtype)
  zeros = jnp.zeros((b,), emb_img.dtype)

  def direction(rows, cols):
    def fold(acc, blk, is_own):
      lse, diag = acc
      logits = scale * (rows @ blk.T)
      if is_own:
        # The positives leave the logsumexp, which runs over negatives only.
        # With b_local == 1 the own block has none: its logsumexp is -inf
        # (and B == 1 leaves it so: softplus(-inf) == 0, zero gradients).
        diag = diag + jnp.diagonal(logits)
        logits = jnp.where(jnp.eye(*logits.shape, dtype=bool), -jnp.inf,
                           logits)
      return jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=1)), diag
    lse, diag = ring.ring_fold(fold, cols, (neg_inf, zeros), axis_name)
    return jnp.sum(infonce_terms(lse, diag))

  total = direction(emb_img, emb_txt) + direction(emb_txt, emb_img)
  return 0.5 * jax.lax.psum(total, axis_name) / (b * ring.axis_size(axis_name))
