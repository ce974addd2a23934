"""The dual encoder: image tower, text tower and the two loss scalars."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from prolip_jax.config import presets
from prolip_jax.models.attention import IMPLEMENTATIONS
from prolip_jax.models.attention import LOGITS_DTYPES
from prolip_jax.models.towers import ImageTower
from prolip_jax.models.towers import TextConfig
from prolip_jax.models.towers import TextTower
from prolip_jax.models.towers import VisionConfig
from prolip_jax.models.transformer import REMAT_POLICIES
from prolip_jax.models.transformer import StackOptions

Array = jax.Array

# Defaults: ProLIP ViT-B/16, as towers.VisionConfig's and TextConfig's.
_B16 = presets.model_preset('B/16')

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16,
           'float16': jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything that fixes the parameter tree and the forward pass.

  Defaults are ProLIP ViT-B/16 (``presets.model_preset('B/16')``: the B/16
  row of ``config/sizes.py`` and the declared ``model.*`` defaults of
  ``config/keys.py``, which say what each field means)."""
  embed_dim: int = _B16.embed_dim
  vision: VisionConfig = VisionConfig()
  text: TextConfig = TextConfig()
  use_unc: bool = _B16.use_unc
  release_compat: bool = _B16.release_compat
  init_logit_scale: float = _B16.init_logit_scale  # a, stored as log a
  init_logit_bias: float = _B16.init_logit_bias  # b
  # Bias of the log sigma^2 heads (paper 4.1).
  init_unc_bias: float = _B16.init_unc_bias
  compute_dtype: str = _B16.compute_dtype
  # How the towers' block stacks compile (see transformer.StackOptions):
  # remat=True with the default policy is the historical model.remat=True.
  remat: bool = _B16.remat
  remat_policy: str = _B16.remat_policy  # used when remat=True
  # Parameters stacked on a layer axis, see convert/arrays.
  scan: bool = _B16.scan
  # 'auto' | 'xla' | 'cudnn', resolved per device by attention_impl_for.
  attention_impl: str = _B16.attention_impl
  # 'float32' | 'bfloat16': XLA attention's logits (attention.LOGITS_DTYPES).
  attention_logits_dtype: str = _B16.attention_logits_dtype

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any]) -> 'ModelConfig':
    """Builds from a ``config.model`` ConfigDict, rejecting unknown keys."""
    cfg = dict(cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict)
               else cfg)
    vision = dict(cfg.pop('vision', {}))
    text = dict(cfg.pop('text', {}))
    _check_keys('model', cfg, cls)
    _check_keys('model.vision', vision, VisionConfig)
    _check_keys('model.text', text, TextConfig)
    out = cls(vision=VisionConfig(**vision), text=TextConfig(**text), **cfg)
    out.validate()
    return out

  def validate(self):
    """Raises ValueError on an unknown dtype or inconsistent tower sizes."""
    if self.compute_dtype not in _DTYPES:
      raise ValueError(f'model.compute_dtype must be one of {list(_DTYPES)}, '
                       f'got {self.compute_dtype!r}')
    if self.text.pool not in ('cls', 'argmax'):
      raise ValueError(f"model.text.pool must be 'cls' or 'argmax', got "
                       f'{self.text.pool!r}')
    if self.text.pool == 'argmax' and self.use_unc:
      raise ValueError("model.text.pool='argmax' (open_clip CLIP text tower) "
                       'has no [UNC] token: set model.use_unc=False')
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f'model.remat_policy must be one of {REMAT_POLICIES}, '
                       f'got {self.remat_policy!r}')
    if self.attention_impl not in IMPLEMENTATIONS:
      raise ValueError(f'model.attention_impl must be one of '
                       f'{IMPLEMENTATIONS}, got {self.attention_impl!r}')
    if self.attention_logits_dtype not in LOGITS_DTYPES:
      raise ValueError(f'model.attention_logits_dtype must be one of '
                       f'{LOGITS_DTYPES}, got {self.attention_logits_dtype!r}')
    if self.vision.image_size % self.vision.patch_size:
      raise ValueError('model.vision.image_size must be a multiple of '
                       'model.vision.patch_size')

  def to_dict(self) -> dict[str, Any]:
    """Plain nested dict (JSON-able; ``from_config`` reads it back)."""
    return dataclasses.asdict(self)

  @property
  def num_patches(self) -> int:
    """Patch tokens per image, (image_size / patch_size)^2 (196 for B/16)."""
    return (self.vision.image_size // self.vision.patch_size)**2


def _check_keys(where, given, dc):
  known = {f.name for f in dataclasses.fields(dc)}
  unknown = sorted(set(given) - known)
  if unknown:
    raise ValueError(f'unknown {where} config keys {unknown}; known: '
                     f'{sorted(known)}')


class ProLIP(nn.Module):
  """Image tower ``visual``, text tower ``text``, ``logit_scale``, ``logit_bias``.

  ``logit_scale`` holds log a (PPCL/SigLIP temperature, eq. 2) and
  ``logit_bias`` holds b. Call ``encode_image`` / ``encode_text`` through
  ``apply(..., method=...)``; ``__call__`` runs both (used for ``init``).

  ``attention``: 'xla' or 'cudnn', the implementation for the devices the
  model is compiled for: ``attention_impl_for(devices,
  config.attention_impl)``, computed by whoever builds the step (the model
  never looks at devices). Calls cuDNN refuses run on XLA either way.
  """
  config: ModelConfig
  attention: str = 'xla'

  def setup(self):
    cfg = self.config
    if self.attention not in ('xla', 'cudnn'):
      raise ValueError("ProLIP.attention must be 'xla' or 'cudnn' (resolve "
                       f"'auto' with attention_impl_for), got "
                       f'{self.attention!r}')
    dtype = _DTYPES[cfg.compute_dtype]
    options = StackOptions(cfg.remat, cfg.remat_policy, cfg.scan,
                           self.attention, cfg.attention_logits_dtype)
    self.visual = ImageTower(cfg.vision, cfg.embed_dim, cfg.use_unc,
                             cfg.release_compat, dtype, options,
                             cfg.init_unc_bias)
    self.text = TextTower(cfg.text, cfg.embed_dim, cfg.use_unc,
                          cfg.release_compat, dtype, options,
                          cfg.init_unc_bias)
    self.logit_scale = self.param(
        'logit_scale', nn.initializers.constant(math.log(cfg.init_logit_scale)),
        ())
    self.logit_bias = self.param(
        'logit_bias', nn.initializers.constant(cfg.init_logit_bias), ())

  def encode_image(self, images: Array, keep_indices: Optional[Array] = None):
    """``(b, h, w, 3)`` normalised images -> ``(mu, logvar)``, each ``(b, d)``."""
    return self.visual(images, keep_indices)

  def encode_text(self, tokens: Array):
    """``(b, L)`` token ids -> ``(mu, logvar)``, each ``(b, d)``."""
    return self.text(tokens)

  def scale_and_bias(self):
    """``(a, b)``: the exponentiated scale and the bias, float32 scalars."""
    return jnp.exp(self.logit_scale), self.logit_bias

  def __call__(self, images: Array, tokens: Array):
    return self.encode_image(images), self.encode_text(tokens), \
        self.scale_and_bias()


def init_params(model: 'ProLIP | ModelConfig', rng: Array) -> dict[str, Any]:
  """Initial parameters of ``model`` (a ``ProLIP``, or its ``ModelConfig``):
  the one ``model.init`` (a batch of one; only the shapes matter). The
  training state, ``prolip_jax.aot`` and the benchmarks all start here."""
  if isinstance(model, ModelConfig):
    model = ProLIP(model)
  config = model.config
  size = config.vision.image_size
  images = jnp.zeros((1, size, size, 3), jnp.float32)
  tokens = jnp.zeros((1, config.text.context_length), jnp.int32)
  return model.init(rng, images, tokens)['params']


def count_params(tree) -> int:
  """Total number of scalars in a parameter pytree."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))
