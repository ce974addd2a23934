"""OTTER (Wu et al., 2021): InfoNCE against Sinkhorn soft targets computed
from an EMA teacher (section 3.4, Algorithm 2).

The teacher lives in the train state (``uses_teacher``), embeds the same
batch without gradients, and follows the student after every optimizer step:
theta~ <- m theta~ + (1 - m) theta with m = ``loss.otter.ema_decay``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from prolip_jax.config.paper import OTTER_EMA_DECAY
from prolip_jax.losses import GaussianBatch
from prolip_jax.losses import otter_loss
from prolip_jax.losses import otter_loss_blockwise
from prolip_jax.objectives.base import Objective


def ema_update(teacher_params: Any, student_params: Any,
               decay: float = OTTER_EMA_DECAY) -> Any:
  """theta~ <- m theta~ + (1 - m) theta (section 3.4), leaf by leaf.

  Keeps each teacher leaf's dtype. Pytrees must have the same structure
  (the parameter tree of the towers, each leaf any shape).
  """
  return jax.tree.map(
      lambda t, s: (decay * t + (1.0 - decay) * s).astype(jnp.asarray(t).dtype),
      teacher_params, student_params)


def otter_kwargs(loss_cfg) -> dict[str, Any]:
  """``otter_loss`` keyword arguments from ``config.loss.otter``."""
  o = loss_cfg.otter
  return dict(alpha=o.alpha, lam=o.lam, n_iter=o.n_iter, gamma_v=o.gamma_v,
              gamma_t=o.gamma_t, eta=o.eta)


class OTTERObjective(Objective):
  """With [UNC] towers the student logits are CSD-based (the probabilistic
  variant); the teacher's Sinkhorn targets use its means only."""

  name = 'otter'
  uses_teacher = True

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None):
    kwargs = otter_kwargs(loss_cfg)

    def otter(img, txt, scale, bias, img_t, txt_t):
      del bias
      lv = dict(logvar_img=img.logvar, logvar_txt=txt.logvar)
      if axis_name is None:
        return otter_loss(img.mu, txt.mu, img_t.mu, txt_t.mu, scale,
                          **kwargs, **lv)
      return otter_loss_blockwise(img.mu, txt.mu, img_t.mu, txt_t.mu, scale,
                                  axis_name, **kwargs, **lv)
    return otter

  def aux_towers(self, model, config):
    del config

    def teacher_embeddings(params, teacher, rows):
      del params
      # Targets come from the EMA teacher, not from gradients.
      apply_t = functools.partial(model.apply,
                                  {'params': jax.lax.stop_gradient(teacher)})
      img_t = GaussianBatch(*apply_t(rows['images'], method='encode_image'))
      txt_t = GaussianBatch(*apply_t(rows['tokens'], method='encode_text'))
      return img_t, txt_t

    return teacher_embeddings

  def update_teacher(self, config, teacher, params):
    return ema_update(teacher, params, config.loss.otter.ema_decay)
