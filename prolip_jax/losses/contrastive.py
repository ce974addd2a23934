"""Deterministic contrastive baselines: SigLIP's sigmoid loss and CLIP's InfoNCE.

Same conventions as ``ppcl_loss``: row i of the images is paired with row i of
the texts, ``scale`` is the temperature multiplier itself (the model stores its
log), inputs are ``(n, d)`` L2-normalised embeddings, arithmetic in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_sum

Array = jax.Array


def unit_rows(x: Array) -> Array:
  """``x / ||x||`` along the last axis in float32 (a zero row stays zero)."""
  x = jnp.asarray(x, jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def siglip_logits(emb_img: Array, emb_txt: Array, scale: Array,
                  bias: Array) -> Array:
  """``(n, m)`` logits ``scale * img @ txt.T + bias`` in float32."""
  emb_img = jnp.asarray(emb_img, jnp.float32)
  emb_txt = jnp.asarray(emb_txt, jnp.float32)
  return scale * (emb_img @ emb_txt.T) + bias


def siglip_loss(emb_img: Array, emb_txt: Array, scale: Array,
                bias: Array) -> Array:
  """SigLIP's pairwise sigmoid loss (Zhai et al., 2023, eq. 1).

  ``-sum_ij log sigmoid(y_ij (t x_i . y_j + b)) / n`` with y_ij = +1 on the
  diagonal and -1 elsewhere; normalised per image like ``ppcl_loss``.

  Args:
    emb_img, emb_txt: ``(n, d)`` L2-normalised embeddings.
    scale: ``t`` (init 10). bias: ``b`` (init -10).

  Returns:
    scalar float32 loss.
  """
  logits = siglip_logits(emb_img, emb_txt, scale, bias)
  return sigmoid_pairwise_loss_sum(logits) / logits.shape[0]


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


def clip_loss(emb_img: Array, emb_txt: Array, scale: Array) -> Array:
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

  Returns:
    scalar float32 loss.
  """
  logits = siglip_logits(emb_img, emb_txt, scale, 0.0)
  diag = jnp.diagonal(logits)
  negatives = jnp.where(jnp.eye(*logits.shape, dtype=bool), -jnp.inf, logits)
  i2t = infonce_terms(jax.nn.logsumexp(negatives, axis=1), diag)
  t2i = infonce_terms(jax.nn.logsumexp(negatives, axis=0), diag)
  return 0.5 * (jnp.mean(i2t) + jnp.mean(t2i))
