"""Flax models: the ProLIP dual encoder and its towers."""

from prolip_jax.models.attention import attention_impl_for
from prolip_jax.models.attention import cudnn_refusal
from prolip_jax.models.masking import mask_text_tokens
from prolip_jax.models.masking import random_keep_indices
from prolip_jax.models.prolip import count_params
from prolip_jax.models.prolip import init_params
from prolip_jax.models.prolip import ModelConfig
from prolip_jax.models.prolip import ProLIP
from prolip_jax.models.towers import ImageTower
from prolip_jax.models.towers import TextConfig
from prolip_jax.models.towers import TextTower
from prolip_jax.models.towers import VisionConfig
