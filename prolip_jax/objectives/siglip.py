"""SigLIP (Zhai et al., 2023): the pairwise sigmoid loss over the means."""

from __future__ import annotations

from typing import Any, Optional

from prolip_jax.losses import siglip_loss
from prolip_jax.objectives.base import Objective


class SigLIPObjective(Objective):
  """Deterministic baseline; [UNC] outputs, if any, are ignored."""

  name = 'siglip'

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None):
    del loss_cfg

    def siglip(img, txt, scale, bias, *_):
      loss = siglip_loss(img.mu, txt.mu, scale, bias, axis_name=axis_name)
      return loss, {'loss': loss, 'siglip': loss}
    return siglip
