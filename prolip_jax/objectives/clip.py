"""CLIP (Radford et al., 2021): symmetric InfoNCE over the means."""

from __future__ import annotations

from typing import Any, Optional

from prolip_jax.losses import clip_loss
from prolip_jax.objectives.base import Objective

# CLIP's initial temperature 0.07 as the model's logit scale a = 1 / 0.07.
CLIP_SCALE_INIT = 1 / 0.07


class CLIPObjective(Objective):
  """Deterministic baseline; the logit bias is carried along unused."""

  name = 'clip'
  demo_settings = {'tiny': {'model.init_logit_scale': CLIP_SCALE_INIT}}

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None):
    del loss_cfg

    def clip(img, txt, scale, bias, *_):
      del bias
      loss = clip_loss(img.mu, txt.mu, scale, axis_name=axis_name)
      return loss, {'loss': loss, 'clip': loss}
    return clip
