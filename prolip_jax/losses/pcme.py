"""PCME++'s probabilistic matching loss (PML), the baseline of ProLIP A.3.

Chun, "Improved Probabilistic Image-Text Representations" (PCME++, ICLR 2024),
as summarised in ProLIP (section 3.2, appendix A.3, Table C.3): a pairwise
binary cross-entropy over all image-text pairs of the batch with logits

  logit_ij = -a * d_CSD(Z_i, Z_j) + b,
  d_CSD = ||mu_i - mu_j||^2 + tr(Sigma_i) + tr(Sigma_j)     (ProLIP eq. 1),

labels y_ij = 1 for matched pairs (the diagonal) and 0 otherwise. Unlike
PPCL (``ppcl_loss``), PML uses the original CSD -- a distance, not a
similarity -- and BCE averaged over pairs, which is why its gradients vanish
quickly at scale (A.3); ProLIP's Table C.3 shows it does not train stand-alone
without a CLIP loss added.

Normalisation: the MEAN over all n*m pairs (``BCEWithLogitsLoss()`` in the
PCME++ release). The release then returns ``2 * mean`` -- one copy for i2t and
one for t2i, which are the same number since the pair set is symmetric -- so
``2 * pcme_pml_loss`` is the release's value; this function returns the mean
itself. Release initial values: a = 5, b = 5
(``prolip_jax.config.paper.PCME_SCALE_INIT``, ``PCME_BIAS_INIT``). The
release's optional extras (pseudo-positives via ``smoothness_alpha``,
Mixup/CutMix, VIB) are not included here; VIB is ``vib_loss``.

``pcme_pml_loss`` is the one entry: with ``axis_name`` (inside
``shard_map``) it runs ``pcme_pml_loss_blockwise`` on the device ring.

Arithmetic in ``probabilistic.compute_dtype``: where a docstring says
float32, float64 inputs give float64.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from prolip_jax.losses import ring
from prolip_jax.losses.probabilistic import csd
from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_blockwise
from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_sum
from prolip_jax.losses.probabilistic import to_compute_dtype

Array = jax.Array

__all__ = ['pcme_pml_logits', 'pcme_pml_loss', 'pcme_pml_loss_blockwise']


def pcme_pml_logits(mu_img: Array, logvar_img: Array, mu_txt: Array,
                    logvar_txt: Array, scale: Array, bias: Array) -> Array:
  """``(n, m)`` float32 logits ``-scale * csd(...) + bias`` (PCME++ eq. 1-2).

  Args:
    mu_img, logvar_img: ``(n, d)`` image means and log sigma^2.
    mu_txt, logvar_txt: ``(m, d)`` text means and log sigma^2.
    scale: ``a`` itself (positive), bias: ``b``.
  """
  return -scale * csd(mu_img, logvar_img, mu_txt, logvar_txt) + bias


def pcme_pml_loss(mu_img: Array, logvar_img: Array, mu_txt: Array,
                  logvar_txt: Array, scale: Array, bias: Array,
                  matched: Optional[Array] = None, *,
                  axis_name: Optional[ring.AxisName] = None) -> Array:
  """PCME++'s probabilistic matching loss: mean pairwise BCE over CSD logits.

  L = -(1/(n m)) sum_ij [y_ij log sig(l_ij) + (1 - y_ij) log sig(-l_ij)]
  with l_ij = -a * d_CSD(Z_i, Z_j) + b (``pcme_pml_logits``).

  Args:
    mu_img, logvar_img: ``(n, d)``; mu_txt, logvar_txt: ``(m, d)``.
    scale: ``a`` (release init 5). bias: ``b`` (release init 5).
    matched: optional ``(n, m)`` labels in [0, 1]; default the identity
      (row i matches column i), which needs n == m.
    axis_name: None for the batch on one device; inside ``shard_map``, the
      mesh axis name(s) the batch is sharded over: the arrays are then local
      shards and the result is ``pcme_pml_loss_blockwise``'s global loss
      (diagonal positives only: ``matched`` must be None).

  Returns:
    scalar float32 loss, averaged over the n*m pairs (the release's value is
    twice this, see the module docstring).
  """
  if axis_name is not None:
    if matched is not None:
      raise ValueError('pcme_pml_loss with axis_name takes the diagonal '
                       'positives only: matched must be None')
    return pcme_pml_loss_blockwise(mu_img, logvar_img, mu_txt, logvar_txt,
                                   scale, bias, axis_name)
  logits = pcme_pml_logits(mu_img, logvar_img, mu_txt, logvar_txt, scale,
                           bias)
  if matched is None:
    return sigmoid_pairwise_loss_sum(logits) / logits.size
  logits, y = to_compute_dtype(logits, matched)
  bce = -(y * jax.nn.log_sigmoid(logits)
          + (1.0 - y) * jax.nn.log_sigmoid(-logits))
  return jnp.mean(bce)


def pcme_pml_loss_blockwise(mu_img: Array, logvar_img: Array, mu_txt: Array,
                            logvar_txt: Array, scale: Array, bias: Array,
                            axis_name: ring.AxisName) -> Array:
  """``pcme_pml_loss`` (diagonal positives) of the global batch, from shards.

  Call inside ``shard_map``; same ring as ``ppcl_loss_blockwise`` (texts
  travel, one ``b_local x b_local`` block of logits at a time), with the
  CSD-distance logits and the mean over the B*B pairs.

  Args:
    mu_img, logvar_img, mu_txt, logvar_txt: ``(b_local, d)`` local,
      row-aligned shards.
    scale, bias: replicated scalars ``a`` and ``b``.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.

  Returns:
    scalar float32 loss of the global batch, the same on every device.
  """
  axis_name = ring.hashable_axis(axis_name)
  per_image = sigmoid_pairwise_loss_blockwise(
      lambda img, txt: pcme_pml_logits(img[0], img[1], txt[0], txt[1], scale,
                                       bias),
      (mu_img, logvar_img), (mu_txt, logvar_txt), axis_name)
  # The per-image sum over B texts, divided by B again: the mean over pairs.
  return per_image / (mu_img.shape[0] * ring.axis_size(axis_name))
