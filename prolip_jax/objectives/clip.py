"""CLIP (Radford et al., 2021): symmetric InfoNCE over the means."""

from __future__ import annotations

from typing import Any, Optional

from prolip_jax.losses import clip_loss
from prolip_jax.objectives.base import Objective


class CLIPObjective(Objective):
  """Deterministic baseline; the logit bias is carried along unused."""

  name = 'clip'

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None):
    del loss_cfg

    def clip(img, txt, scale, bias, *_):
      del bias
      loss = clip_loss(img.mu, txt.mu, scale, axis_name=axis_name)
      return loss, {'loss': loss, 'clip': loss}
    return clip
