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


def clip_loss(emb_img: Array, emb_txt: Array, scale: Array) -> Array:
  """CLIP's symmetric InfoNCE (Radford et al., 2021).

  Mean of the image-to-text and text-to-image cross-entropies over logits
  ``scale * img @ txt.T`` with the matching pair as target.

  Args:
    emb_img, emb_txt: ``(n, d)`` L2-normalised embeddings.
    scale: the inverse temperature (CLIP initialises it to 1/0.07).

  Returns:
    scalar float32 loss.
  """
  logits = siglip_logits(emb_img, emb_txt, scale, 0.0)
  diag = jnp.diagonal(logits)
  i2t = jax.nn.logsumexp(logits, axis=1) - diag
  t2i = jax.nn.logsumexp(logits, axis=0) - diag
  return 0.5 * (jnp.mean(i2t) + jnp.mean(t2i))
