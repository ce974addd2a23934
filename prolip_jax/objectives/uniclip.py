"""UniCLIP on the ProLIP towers: heads, parameters, loss, eval encoders.

Lee et al., "UniCLIP: Unified Framework for Contrastive Language-Image
Pre-training" (NeurIPS 2022); the loss itself is ``losses.uniclip``.

One step, for a batch of N pairs with V augmented views per image:

1. The (augmentation-agnostic) encoders are the deterministic ProLIP towers:
   h_img = f_I(A_v(x)) for every view, h_txt = f_T(t), each ``(., D)``
   (the L2-normalised [CLS] projection, ``mu``; section 2.1).
2. The heads map them into ONE space: z_img = g_I(h_img, f_A(a_v)) with the
   11-number augmentation vector a_v of the view (augmentation-aware head,
   section 2.1), z_txt = g_T(h_txt) (linear).
3. MP-NCE (eq. 12) over all (V + 1) N embeddings with the domain-dependent
   scores of eq. 16: learnable tau_D, b_D for D in (II, IT, TT).

Everything UniCLIP adds lives in ``params['uniclip']`` = ``{'image_head',
'text_head', 'log_tau', 'offset'}``, so the optimizer, the FSDP shardings and
the checkpoints treat it like the towers. ProLIP's own ``logit_scale`` and
``logit_bias`` are carried along unused.

Settings come from ``config.uniclip`` (all optional, see ``DEFAULTS``), the
view count from ``config.data.num_views`` and the domain weights from
``config.loss.mp_nce_weights``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from prolip_jax.config import keys as config_keys
from prolip_jax import sharding as shd
from prolip_jax.data import transforms
from prolip_jax.embedding import train_images
from prolip_jax.losses import uniclip as uniclip_loss
from prolip_jax.models import heads as heads_lib
from prolip_jax.objectives.base import LossParts
from prolip_jax.objectives.base import Objective

Array = jax.Array

PARAMS_KEY = 'uniclip'

# config.uniclip defaults, declared in config_keys.KEYS. embed_dim 0: the
# towers' embed_dim. The paper gives neither widths nor inits: three residual
# blocks (Table 4a), CLIP's 0.07.
DEFAULTS = {k[len(PARAMS_KEY) + 1:]: v for k, v in config_keys.defaults(
    PARAMS_KEY + '.', added_by='uniclip').items()}


def settings(config) -> dict[str, Any]:
  """``DEFAULTS`` updated with ``config.uniclip`` (which may be absent)."""
  given = config.get('uniclip', None)
  given = {} if given is None else dict(given)
  unknown = sorted(set(given) - set(DEFAULTS))
  if unknown:
    raise ValueError(f'unknown uniclip config keys {unknown}; known: '
                     f'{sorted(DEFAULTS)}')
  return dict(DEFAULTS, **given)


def make_heads(config, model_cfg
               ) -> tuple[heads_lib.AugAwareImageHead, heads_lib.TextHead]:
  """(g_I, g_T) of section 2.1 for this run."""
  s = settings(config)
  dim = s['embed_dim'] or model_cfg.embed_dim
  image_head = heads_lib.AugAwareImageHead(
      dim, num_blocks=s['num_blocks'], mlp_ratio=s['mlp_ratio'],
      aug_features=s['aug_features'], aug_hidden=s['aug_hidden'],
      use_aug=s['use_aug'])
  return image_head, heads_lib.TextHead(dim)


def init_uniclip_params(tau: float = DEFAULTS['init_tau'],
                        offset: float = DEFAULTS['init_offset']
                        ) -> dict[str, Array]:
  """Learnable eq. 16 parameters: ``log_tau`` and ``offset``, each ``(3,)``
  float32 in the order (II, IT, TT). The paper gives no initial values; the
  defaults are CLIP's tau = 0.07 and b = 0 (eq. 16 then starts as eq. 13).
  Train ``log_tau`` (tau = exp(log_tau) stays positive); see
  ``uniclip_scalars``."""
  return {'log_tau': jnp.full((3,), math.log(tau), jnp.float32),
          'offset': jnp.full((3,), offset, jnp.float32)}


def uniclip_scalars(params) -> tuple[Array, Array]:
  """``(temperatures (3,), offsets (3,))`` from ``init_uniclip_params``-style
  params (``{'log_tau': (3,), 'offset': (3,)}``)."""
  return jnp.exp(params['log_tau']), params['offset']


def init_params(config, model_cfg, rng: Array) -> dict[str, Any]:
  """``params['uniclip']``: both heads and the eq. 16 scalars (each ``(3,)``,
  order II, IT, TT; tau stored as log tau so it stays positive)."""
  image_head, text_head = make_heads(config, model_cfg)
  s = settings(config)
  r_img, r_txt = jax.random.split(rng)
  h = jnp.zeros((1, model_cfg.embed_dim), jnp.float32)
  aug = jnp.zeros((1, transforms.AUG_DIM), jnp.float32)
  return dict(
      image_head=image_head.init(r_img, h, aug)['params'],
      text_head=text_head.init(r_txt, h)['params'],
      **init_uniclip_params(s['init_tau'], s['init_offset']))


def domain_scalars(uparams, min_tau: float) -> tuple[Array, Array]:
  """``(temperatures (3,), offsets (3,))`` of eq. 16 with tau >= ``min_tau``.

  The floor plays the role of CLIP's clamp of the logit scale at 100: a tau
  that runs to zero makes every logit explode. ``jnp.maximum`` stops the
  gradient below the floor, so log tau stops moving down there.
  """
  tau, offset = uniclip_scalars(uparams)
  return jnp.maximum(tau, min_tau), offset


def resolve_weights(mode, num_views: int):
  """``config.loss.mp_nce_weights`` -> the ``weights`` of ``mp_nce_loss``.

  'balanced': (1/V^2, 1/(2V), 1), each domain pair contributing equally
  (eq. 12's w_D; the paper's (1/9, 1/6, 1) at V = 3); 'uniform': all ones
  (eq. 11); or an explicit (w_II, w_IT, w_TT).
  """
  if isinstance(mode, str):
    if mode == 'balanced':
      return uniclip_loss.default_weights(num_views)
    if mode == 'uniform':
      return None
    raise ValueError("loss.mp_nce_weights must be 'balanced', 'uniform' or "
                     f'three numbers, got {mode!r}')
  weights = tuple(float(w) for w in mode)
  if len(weights) != 3:
    raise ValueError(f'loss.mp_nce_weights needs 3 numbers (II, IT, TT), got '
                     f'{mode!r}')
  return weights


def embed(model, params, config, images: Array, aug: Array, tokens: Array
          ) -> tuple[Array, Array]:
  """Head embeddings of V views and of the captions.

  Args:
    model: the ``ProLIP`` module (deterministic towers).
    params: the full parameter tree, with ``params['uniclip']``.
    config: the run config.
    images: ``(b, V, s, s, 3)`` normalised float images.
    aug: ``(b, V, AUG_DIM)`` augmentation vectors of the views.
    tokens: ``(b, L)`` token ids.

  Returns:
    ``z_views (b, V, E)`` and ``z_txt (b, E)``, not normalised (eq. 16 takes
    cosines).
  """
  return (embed_images(model, params, config, images, aug),
          embed_texts(model, params, config, tokens))


def embed_texts(model, params, config, tokens: Array) -> Array:
  """``(b, L)`` token ids -> z ``(b, E)``: text tower, then the linear head."""
  h, _ = model.apply({'params': params}, tokens, method='encode_text')
  _, text_head = make_heads(config, model.config)
  return text_head.apply({'params': params[PARAMS_KEY]['text_head']}, h)


def embed_images(model, params, config, images: Array, aug: Array,
                 keep: Optional[Array] = None) -> Array:
  """``(b, V, s, s, 3)`` normalised views + ``(b, V, AUG_DIM)`` -> z ``(b, V, E)``.

  The views go through the tower as one batch of b * V images: the batch
  dimension stays leading, so a batch-sharded array keeps each device's rows
  (and all their views) on that device. ``keep``: optional ``(b * V, k)``
  patch indices (token drop, as ``encode_image`` takes them).
  """
  b, v = images.shape[:2]
  h, _ = model.apply({'params': params},
                     images.reshape(b * v, *images.shape[2:]), keep,
                     method='encode_image')
  image_head, _ = make_heads(config, model.config)
  z = image_head.apply({'params': params[PARAMS_KEY]['image_head']}, h,
                       aug.reshape(b * v, -1).astype(jnp.float32))
  return z.reshape(b, v, -1)


class UniCLIPObjective(Objective):
  """MP-NCE (eq. 12) with eq. 16's domain scores over head embeddings of
  ``data.num_views`` views and the captions; parameters in
  ``params['uniclip']``; scored through the heads."""

  name = 'uniclip'
  multi_view = True
  # The digits: the paper's positive group of 3 views + 1 caption. Views
  # must differ (image-image positives) and the head must see how: crops
  # and, since grey digits have no colour, brightness/contrast jitter only
  # (saturation/hue factors stay at identity). The other uniclip.* keys at
  # their declared defaults: balanced (1/V^2, 1/(2V), 1) weights (eq. 12's
  # w_D), an image head of 3 residual blocks, eq. 16 starting as eq. 13.
  demo_settings = {'tiny': {'data.num_views': 3,
                            'data.crop_scale': (0.6, 1.0),
                            'data.jitter': (0.4, 0.4, 0.0, 0.0),
                            'data.jitter_prob': 0.8,
                            # f_A: the digits need less than 128.
                            'uniclip.aug_features': 64,
                            'uniclip.aug_hidden': 64}}
  # The PyTorch/open_clip layout has no place for the heads.
  exportable = False

  def validate(self, config) -> None:
    if config.model.use_unc:
      raise ValueError(f'objective {self.name!r} is deterministic (its heads '
                       'take the tower means; [UNC] would get no gradient): '
                       'set model.use_unc=False')
    num_views = config_keys.get(config, 'data.num_views')
    if num_views < 2:
      raise ValueError(f'objective {self.name!r} needs data.num_views >= 2 '
                       'augmented views per image (its image-image '
                       f'positives; paper: 3), got {num_views}')
    settings(config)  # unknown config.uniclip keys
    resolve_weights(config_keys.get(config, 'loss.mp_nce_weights'),
                    num_views)

  def init_extra_params(self, config, model_cfg, rng):
    return {PARAMS_KEY: init_params(config, model_cfg, rng)}

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None):
    """``f(z_views (b, V, E), z_txt (b, E), temperatures (3,), offsets (3,))``.

    Views are batch-major like every other batch array (so they shard along
    axis 0) and turned view-major, as ``mp_nce_loss`` wants, here. With
    ``axis_name`` the arrays are local shards and the loss is the global one
    (``mp_nce_loss_sharded``: local anchors against all-gathered candidates).
    """
    mode = loss_cfg.get('mp_nce_weights',
                        config_keys.default('loss.mp_nce_weights'))

    def mp_nce(z_views, z_txt, temperatures, offsets):
      views = z_views.transpose(1, 0, 2)  # (V, b, E)
      weights = resolve_weights(mode, views.shape[0])
      return uniclip_loss.mp_nce_loss(views, z_txt, temperatures, offsets,
                                      weights, axis_name=axis_name)
    return mp_nce

  def shard_specs(self) -> tuple:
    batch = P(shd.BATCH_AXES)
    return (batch, batch, P(), P())

  def make_loss_parts(self, model, config, mesh, mask_id: int):
    """``batch`` holds ``image (B, V, s, s, 3)`` uint8, ``aug (B, V,
    AUG_DIM)`` and ``tokens (B, L)``; the towers' outputs are the head
    embeddings ``(z_views (B, V, E), z_txt (B, E))``. Metrics: the loss,
    its three domain-pair parts, tau_D and b_D, and, for the log line,
    ``scale`` = 1 / tau_IT and ``bias`` = b_IT (the image-text analogues
    of a and b)."""
    del mask_id
    loss_over = self.loss_over(config.loss, mesh)
    min_tau = 1.0 / config.optim.max_logit_scale

    def inputs(batch, rng):
      del rng  # nothing random on device (the views come from the pipeline)
      return {'images': train_images(batch, config.data.mean,
                                     config.data.std),
              'aug': batch['aug'], 'tokens': batch['tokens']}

    def towers(params, teacher, rows):
      del teacher
      return embed(model, params, config, rows['images'], rows['aug'],
                   rows['tokens'])

    def loss(params, outs, batch):
      del batch
      tau, offset = domain_scalars(params[PARAMS_KEY], min_tau)
      value, metrics = loss_over(*outs, tau, offset)
      for k, name in enumerate(('ii', 'it', 'tt')):
        metrics[f'tau_{name}'] = tau[k]
        metrics[f'offset_{name}'] = offset[k]
      metrics['scale'] = 1.0 / tau[uniclip_loss.IT]
      metrics['bias'] = offset[uniclip_loss.IT]
      return value, metrics

    return LossParts(inputs, towers, loss)

  def encoders(self, model, params, config):
    """Into the shared head space, unit-normalised, logvar None.

    The tower features are not comparable across modalities here (only the
    head outputs are trained to match), so images go through the image head
    fed ``identity_aug_vector()`` (an un-augmented view, as the eval
    transform gives) and texts through the text head.
    """
    identity = jnp.asarray(transforms.identity_aug_vector())
    unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)

    def enc_img(x, keep=None):
      aug = jnp.broadcast_to(identity, (x.shape[0], 1, identity.shape[0]))
      z = embed_images(model, params, config, x[:, None], aug, keep)
      return unit(z[:, 0]), None

    def enc_txt(tokens):
      return unit(embed_texts(model, params, config, tokens)), None

    return enc_img, enc_txt
