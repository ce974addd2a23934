"""PC-CLIP: aligning image-embedding differences with difference texts.

Sam et al., "Finetuning CLIP to Reason about Pairwise Differences" (PC-CLIP).
g is the image encoder, f the text encoder (L2-normalised outputs).

* Eq. 1: min_{f,g} l( g(I_i) - g(I_j), f(T_ij) ), with T_ij a text describing
  how image i differs from image j, and l the CLIP contrastive loss (eq. 4,
  appendix B.2, over a batch of normalised image-difference and text
  embeddings, tau = 1.0 in all the paper's runs) or the squared loss (eq. 5).
* Eq. 2 (difference-based classification): image i is predicted to have more
  of the attribute described by T_ij than image j iff
  (g(I_i) - g(I_j)) . f(T_ij) >= (g(I_j) - g(I_i)) . f(T_ij).
* Eq. 3 (comparative prompting): f'_A = alpha f_A + (1 - alpha)(f_B - f_{B-A}),
  alpha = 0.9 in the paper's reported results.

The paper generates T_ij with an LLM from caption pairs. Here they are built
from structured attributes instead, by ``prolip_jax.data.pairs`` (the data
side). This module holds the objective (eq. 1, 4, 5) only; eq. 2 and eq. 3
use a trained model and live in ``prolip_jax.applications.pcclip``.

Arithmetic in ``probabilistic.compute_dtype``: where a docstring says
float32, float64 inputs give float64.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from prolip_jax.config.paper import PCCLIP_TAU
from prolip_jax.losses import ring
from prolip_jax.losses.contrastive import clip_loss
from prolip_jax.losses.contrastive import unit_rows
from prolip_jax.losses.probabilistic import to_compute_dtype

Array = jax.Array

__all__ = ['difference_alignment_loss']


def difference_alignment_loss(img_i_emb: Array, img_j_emb: Array,
                              diff_txt_emb: Array,
                              scale: Array = 1.0 / PCCLIP_TAU,
                              squared: bool = False,
                              normalize: bool = True,
                              axis_name: Optional[Any] = None) -> Array:
  """PC-CLIP's objective (eq. 1 with eq. 4, or eq. 5 when ``squared``).

  x_k = g(I_i,k) - g(I_j,k) (L2-normalised when ``normalize``: eq. 4 says
  "a batch of normalized image and text (difference) embeddings"),
  y_k = f(T_ij,k), L2-normalised.

  * contrastive (default): CLIP's symmetric InfoNCE between the x's and y's,
    ``clip_loss(x, y, scale)`` with scale = 1/tau: the mean over the batch of
    eq. 4's per-pair term (eq. 4 as printed is the sum; multiply by B).
  * ``squared``: eq. 5, ||x_k - y_k||^2 summed over dimensions and averaged
    over the batch (eq. 5 sums over the batch).

  Args:
    img_i_emb, img_j_emb: ``(B, d)`` image embeddings g(I_i), g(I_j).
    diff_txt_emb: ``(B, d)`` embeddings f(T_ij) of the difference texts.
    scale: 1/tau (paper tau = 1.0).
    squared: use eq. 5 instead of eq. 4.
    normalize: L2-normalise the image difference (default, as eq. 4).
    axis_name: inside ``shard_map``, the mesh axis name(s) the pairs are
      sharded over (equal local batches): the result is then the loss of the
      global batch on every device (``clip_loss_blockwise`` for eq. 4).

  Returns:
    scalar float32 loss.
  """
  img_i_emb, img_j_emb = to_compute_dtype(img_i_emb, img_j_emb)
  x = img_i_emb - img_j_emb
  if normalize:
    x = unit_rows(x)
  y = unit_rows(diff_txt_emb)
  if squared:
    return ring.global_mean(jnp.mean(jnp.sum((x - y)**2, axis=-1)),
                            axis_name)
  return clip_loss(x, y, scale, axis_name=axis_name)
