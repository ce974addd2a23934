"""PC-CLIP's uses of a trained model: difference-based classification (eq. 2)
and comparative prompting (eq. 3).

Sam et al., "Finetuning CLIP to Reason about Pairwise Differences" (PC-CLIP).
g is the image encoder, f the text encoder (L2-normalised outputs). The
training objective (eq. 1, 4, 5) is ``prolip_jax.losses.pcclip``; the
objective that trains with it, ``prolip_jax.objectives.pcclip``, reports
eq. 2's accuracy in the held-out evaluation (``evaluation/kinds/heldout.py``).

* Eq. 2: image i is predicted to have more of the attribute described by
  T_ij than image j iff
  (g(I_i) - g(I_j)) . f(T_ij) >= (g(I_j) - g(I_i)) . f(T_ij).
* Eq. 3: f'_A = alpha f_A + (1 - alpha)(f_B - f_{B-A}), alpha = 0.9 in the
  paper's reported results.

Arithmetic in ``losses.probabilistic.compute_dtype``: float32, or float64 for
float64 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prolip_jax.losses.contrastive import unit_rows
from prolip_jax.losses.probabilistic import to_compute_dtype

Array = jax.Array

PCCLIP_ALPHA = 0.9  # appendix C.1: comparative prompting weight reported

__all__ = ['difference_classify', 'comparative_prompt']


def difference_classify(img_i_emb: Array, img_j_emb: Array,
                        attr_txt_emb: Array) -> Array:
  """Eq. 2: does image i have more of the attribute than image j?

  1{ (g(I_i) - g(I_j)) . f(T) >= (g(I_j) - g(I_i)) . f(T) }, equivalently
  (g(I_i) - g(I_j)) . f(T) >= 0. ``T`` is phrased about the FIRST image
  ("the first image is larger"); True predicts that image i is the one.

  Args:
    img_i_emb, img_j_emb: ``(..., d)`` image embeddings.
    attr_txt_emb: ``(..., d)`` attribute text embeddings (broadcastable, e.g.
      one ``(d,)`` prompt for every pair).

  Returns:
    bool array of the broadcast batch shape.
  """
  gi, gj, f = to_compute_dtype(img_i_emb, img_j_emb, attr_txt_emb)
  return jnp.sum((gi - gj) * f, -1) >= jnp.sum((gj - gi) * f, -1)


def comparative_prompt(f_a: Array, f_b: Array, f_b_minus_a: Array,
                       alpha: float = PCCLIP_ALPHA,
                       normalize: bool = False) -> Array:
  """Eq. 3: f'_A = alpha f_A + (1 - alpha)(f_B - f_{B-A}).

  Args:
    f_a, f_b: ``(..., d)`` class-prompt text embeddings of classes A and B.
    f_b_minus_a: ``(..., d)`` embedding of the text describing how B differs
      from A.
    alpha: reliance on the original prompt (paper reports 0.9).
    normalize: L2-normalise the result (the paper does not; cosine-based
      zero-shot classification is unaffected either way).

  Returns:
    the updated class prompt embedding, ``(..., d)`` float32.
  """
  f_a, f_b, f_ba = to_compute_dtype(f_a, f_b, f_b_minus_a)
  out = alpha * f_a + (1.0 - alpha) * (f_b - f_ba)
  return unit_rows(out) if normalize else out
