"""Losses of ProLIP and its family, as pure JAX functions.

``from prolip_jax import losses`` gives every public objective; none of them
holds state or touches devices, so they can be used under ``jit``, ``grad``,
``vmap`` or a user's own ``shard_map``.
"""

from prolip_jax.losses.blockwise import ppcl_loss_blockwise
from prolip_jax.losses.blockwise import prolip_loss_blockwise
from prolip_jax.losses.blockwise import siglip_loss_blockwise
from prolip_jax.losses.contrastive import clip_loss
from prolip_jax.losses.contrastive import siglip_logits
from prolip_jax.losses.contrastive import siglip_loss
from prolip_jax.losses.probabilistic import combine_prolip_terms
from prolip_jax.losses.probabilistic import csd
from prolip_jax.losses.probabilistic import GaussianBatch
from prolip_jax.losses.probabilistic import inclusion_hypothesis
from prolip_jax.losses.probabilistic import inclusion_loss
from prolip_jax.losses.probabilistic import log_inclusion
from prolip_jax.losses.probabilistic import log_inclusion_exact
from prolip_jax.losses.probabilistic import ppcl_logits
from prolip_jax.losses.probabilistic import ppcl_loss
from prolip_jax.losses.probabilistic import prolip_loss
from prolip_jax.losses.probabilistic import prolip_regularizers
from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_sum
from prolip_jax.losses.probabilistic import vib_loss

__all__ = [
    'clip_loss', 'combine_prolip_terms', 'csd', 'GaussianBatch',
    'inclusion_hypothesis', 'inclusion_loss', 'log_inclusion',
    'log_inclusion_exact', 'ppcl_logits', 'ppcl_loss', 'ppcl_loss_blockwise',
    'prolip_loss', 'prolip_loss_blockwise', 'prolip_regularizers',
    'sigmoid_pairwise_loss_sum', 'siglip_logits', 'siglip_loss',
    'siglip_loss_blockwise', 'vib_loss',
]
