"""PCME++ matching loss on the bundled digits (ProLIP paper, Table C.3 ablation).

Probabilistic towers with [UNC] (use_unc=True) but no masked copies; the loss
is PCME++'s pairwise BCE over closed-form sampled distance logits,
-a * CSD + b with a = b = 5 at init, plus beta * VIB (config.loss.beta).
"""

from prolip_jax import demos


def get_config():
  return demos.tiny_demo_config('pcme')
