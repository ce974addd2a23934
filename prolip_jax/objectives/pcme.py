"""PCME++ (Chun, ICLR 2024): the probabilistic matching loss with VIB."""

from __future__ import annotations

from typing import Any, Optional

from prolip_jax.config import paper
from prolip_jax.losses import pcme_pml_loss
from prolip_jax.losses import ring
from prolip_jax.losses import vib_loss
from prolip_jax.objectives.base import Objective


class PCMEObjective(Objective):
  """PML over CSD logits (no inclusion terms, so no masked copies) plus
  ``loss.beta`` times VIB."""

  name = 'pcme'
  needs_unc = True
  # PCME++'s release inits a = 5, b = 5 (the model stores log a).
  demo_settings = {'tiny': {'model.init_logit_scale': paper.PCME_SCALE_INIT,
                            'model.init_logit_bias': paper.PCME_BIAS_INIT}}

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None):
    beta = float(loss_cfg.beta)
    quirk = bool(loss_cfg.vib_release_quirk)

    def pcme(img, txt, scale, bias, *_):
      pml = pcme_pml_loss(img.mu, img.logvar, txt.mu, txt.logvar, scale,
                          bias, axis_name=axis_name)
      metrics = {'pml': pml}
      loss = pml
      if beta > 0:
        # Each device's VIB is a mean over its rows (the global one
        # without axis_name).
        vib = ring.global_mean(0.5 * (vib_loss(img.mu, img.logvar, quirk)
                                      + vib_loss(txt.mu, txt.logvar, quirk)),
                               axis_name)
        metrics['vib'] = vib
        loss = loss + beta * vib
      metrics['loss'] = loss
      return loss, metrics
    return pcme
