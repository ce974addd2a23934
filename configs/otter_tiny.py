"""OTTER (optimal-transport distillation) on the bundled digits.

Deterministic towers, InfoNCE student logits at CLIP's temperature init, and
soft targets from entropic OT (Sinkhorn, lambda 0.15, 5 iterations) over an
EMA teacher's image-image + text-text + image-text similarities (Wu et al.,
ICLR 2022, eq. 2-7 and Algorithm 1; settings in ``config.loss.otter``). The
teacher is the run's moving average, ``optim.ema_decay`` = 0.99 here (paper
0.999, for far longer runs). Set
``model.use_unc=True`` for the probabilistic variant (CSD-based logits).
"""

from prolip_jax import demos


def get_config():
  return demos.tiny_demo_config('otter')
