"""Losses of ProLIP and its family, as pure JAX functions.

``from prolip_jax import losses`` gives every public objective; none of them
holds state or touches devices, so they can be used under ``jit``, ``grad``,
``vmap`` or a user's own ``shard_map``. Each module holds a loss's dense form
and its blockwise form (``*_blockwise``, inside ``shard_map``), which runs on
the device ring of ``losses.ring``. Inputs in bf16, float16 or float32 are
computed in float32, float64 inputs (under ``jax_enable_x64``) in float64.
"""

from prolip_jax.losses.contrastive import clip_loss
from prolip_jax.losses.contrastive import clip_loss_blockwise
from prolip_jax.losses.contrastive import siglip_logits
from prolip_jax.losses.contrastive import siglip_loss
from prolip_jax.losses.contrastive import siglip_loss_blockwise
from prolip_jax.losses.probabilistic import combine_prolip_terms
from prolip_jax.losses.probabilistic import csd
from prolip_jax.losses.probabilistic import GaussianBatch
from prolip_jax.losses.probabilistic import inclusion_hypothesis
from prolip_jax.losses.probabilistic import inclusion_loss
from prolip_jax.losses.probabilistic import log_inclusion
from prolip_jax.losses.probabilistic import log_inclusion_exact
from prolip_jax.losses.probabilistic import ppcl_logits
from prolip_jax.losses.probabilistic import ppcl_loss
from prolip_jax.losses.probabilistic import ppcl_loss_blockwise
from prolip_jax.losses.probabilistic import prolip_loss
from prolip_jax.losses.probabilistic import prolip_loss_blockwise
from prolip_jax.losses.probabilistic import prolip_regularizers
from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_sum
from prolip_jax.losses.probabilistic import vib_loss
from prolip_jax.losses.otter import otter_loss
from prolip_jax.losses.otter import otter_loss_blockwise
from prolip_jax.losses.otter import otter_similarity
from prolip_jax.losses.otter import otter_targets
from prolip_jax.losses.otter import sinkhorn
from prolip_jax.losses.pcclip import difference_alignment_loss
from prolip_jax.losses.pcme import pcme_pml_logits
from prolip_jax.losses.pcme import pcme_pml_loss
from prolip_jax.losses.pcme import pcme_pml_loss_blockwise
from prolip_jax.losses.uniclip import mp_nce_loss
from prolip_jax.losses.uniclip import mp_nce_loss_sharded

__all__ = [
    'clip_loss', 'clip_loss_blockwise', 'combine_prolip_terms', 'csd',
    'GaussianBatch',
    'inclusion_hypothesis', 'inclusion_loss', 'log_inclusion',
    'log_inclusion_exact', 'ppcl_logits', 'ppcl_loss', 'ppcl_loss_blockwise',
    'prolip_loss', 'prolip_loss_blockwise', 'prolip_regularizers',
    'sigmoid_pairwise_loss_sum', 'siglip_logits', 'siglip_loss',
    'siglip_loss_blockwise', 'vib_loss',
    'difference_alignment_loss', 'mp_nce_loss', 'mp_nce_loss_sharded',
    'otter_loss', 'otter_loss_blockwise', 'otter_similarity', 'otter_targets',
    'pcme_pml_logits', 'pcme_pml_loss', 'pcme_pml_loss_blockwise', 'sinkhorn',
]
