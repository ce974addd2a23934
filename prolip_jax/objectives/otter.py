"""OTTER (Wu et al., 2021): InfoNCE against Sinkhorn soft targets computed
from an EMA teacher (section 3.4, Algorithm 2).

The teacher is the run's moving average of the parameters (``uses_teacher``:
``optim.ema_decay`` = m > 0, the train state's ``ema``, updated after every
optimizer step as theta~ <- m theta~ + (1 - m) theta by the generic loop); it
embeds the same batch without gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax

from prolip_jax.config import keys as config_keys
from prolip_jax.config.paper import OTTER_EMA_DECAY
from prolip_jax.losses import GaussianBatch
from prolip_jax.losses import otter_loss
from prolip_jax.objectives.base import Objective
from prolip_jax.objectives.clip import CLIP_SCALE_INIT


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
  # The teacher is the run's EMA. The paper's 0.999 suits long runs; over
  # the demo's 600 steps it would leave the teacher at about half its
  # random init.
  demo_settings = {'tiny': {'model.init_logit_scale': CLIP_SCALE_INIT,
                            'optim.ema_decay': 0.99}}

  def validate(self, config) -> None:
    super().validate(config)
    decay = float(config_keys.get(config, 'optim.ema_decay'))
    if not 0 < decay < 1:
      raise ValueError(
          "objective 'otter' distils from a moving average of the "
          f'parameters: set optim.ema_decay in (0, 1) (the paper: '
          f'{OTTER_EMA_DECAY}; the tiny demo: 0.99), got {decay}')

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None):
    kwargs = otter_kwargs(loss_cfg)

    def otter(img, txt, scale, bias, img_t, txt_t):
      del bias
      return otter_loss(img.mu, txt.mu, img_t.mu, txt_t.mu, scale,
                        logvar_img=img.logvar, logvar_txt=txt.logvar,
                        axis_name=axis_name, **kwargs)
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
