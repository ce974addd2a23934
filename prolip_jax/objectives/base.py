"""The objective interface: everything one training objective adds to the
generic loop of ``train.py``.

An ``Objective`` is a small class whose hooks have working defaults, so an
objective overrides only what it needs:

===========================  ==============================================
hook                         used for
===========================  ==============================================
``validate(config)``         clear errors for settings it cannot train with
``batch_multiple(config)``   each device's batch is a multiple of it (ProLIP)
``masked_copies(config)``    the masked copies the FLOP count adds (ProLIP)
``extend_corpus(corpus)``    extra tokenizer-training text (PC-CLIP)
``wrap_dataset(...)``        extra batch entries (PC-CLIP's difference pairs)
``init_extra_params(...)``   parameters beside the towers (UniCLIP's heads)
``uses_teacher``             keep an EMA teacher in the train state (OTTER)
``local_loss(...)``          the loss over tower outputs, dense or per shard
``make_aux_fn(...)``         extra embeddings for the loss (masked copies,
                             the teacher's embeddings)
``make_extra_fn(...)``       extra loss terms over other batch entries
``make_embed_fn(...)``       towers + aux embeddings (the loss's inputs)
``make_loss_fn(...)``        the whole step loss (default: towers -> loss)
``update_teacher(...)``      after the optimizer step (OTTER's EMA)
``encoders(...)``            the space it is scored in (eval, ``load``)
``heldout_metrics(...)``     the objective's own held-out figures (PC-CLIP eq. 2)
===========================  ==============================================

The default ``make_loss_fn`` is the two-tower step every image-text objective
shares: normalise the images, embed images and captions and add the auxiliary
embeddings (``make_embed_fn``, which ``prolip_jax.aot`` also compiles the loss
alone over), evaluate the loss (in ``shard_map`` with the blockwise forms when
the batch is split over devices), add the extra terms.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from prolip_jax.config import keys as config_keys
from prolip_jax import sharding as shd
from prolip_jax.embedding import train_images
from prolip_jax.losses import GaussianBatch

Array = jax.Array
# (params, teacher, batch, rng) -> (loss, metrics)
LossFn = Callable[[Any, Any, dict, Array], tuple[Array, dict]]


def loss_kwargs(loss_cfg) -> dict[str, Any]:
  """The keyword arguments ``prolip_loss`` takes from ``config.loss``."""
  return dict(alpha1=loss_cfg.alpha1, alpha2=loss_cfg.alpha2,
              beta=loss_cfg.beta, c=loss_cfg.c, eps=loss_cfg.eps,
              vib_release_quirk=loss_cfg.vib_release_quirk,
              guard=loss_cfg.guard)


def gaussian_stats(img: GaussianBatch, txt: GaussianBatch) -> dict[str, Any]:
  """Mean sigma^2 per dimension of the images and captions of a step."""
  if img.logvar is None:
    return {}
  return {'sigma2_img': jnp.mean(jnp.exp(img.logvar)),
          'sigma2_txt': jnp.mean(jnp.exp(txt.logvar))}


def tower_encoders(model, params) -> tuple[Callable, Callable]:
  """``(enc_img(images, keep=None), enc_txt(tokens))`` of the two towers,
  each -> ``(mu, logvar or None)``; images are normalised floats."""
  apply = functools.partial(model.apply, {'params': params})
  return (lambda x, keep=None: apply(x, keep, method='encode_image'),
          lambda t: apply(t, method='encode_text'))


class Objective:
  """Base class: a two-tower image-text objective with no extras.

  Subclasses set ``name`` and implement ``local_loss``; class attributes
  ``needs_unc`` (the loss needs [UNC] variances: ``model.use_unc=True``),
  ``uses_teacher`` (keep an EMA teacher in the train state),
  ``multi_view`` (several augmented views per image, ``data.num_views``) and
  ``exportable`` (the towers alone are the scoring model, so the PyTorch
  export is complete).
  """

  name: str = ''
  needs_unc: bool = False
  uses_teacher: bool = False
  multi_view: bool = False
  # Whether export to the PyTorch/open_clip layout gives the scoring model.
  exportable: bool = True

  # -- configuration and data ------------------------------------------------

  def validate(self, config) -> None:
    """Raises ``ValueError`` for settings this objective cannot train with."""
    if self.needs_unc and not config.model.use_unc:
      raise ValueError(f'objective {self.name!r} needs model.use_unc=True')
    if not self.multi_view and config_keys.get(config, 'data.num_views') != 1:
      raise ValueError(f'data.num_views={config.data.num_views} but objective '
                       f'{self.name!r} takes one view per image')

  def batch_multiple(self, config) -> int:
    """Each device's share of ``config.batch_size`` must be a multiple of
    this (default 1; ProLIP: the masking stride). ``prolip_jax.aot`` steps
    its batch search by it."""
    del config
    return 1

  def batch_multiple_why(self, config, multiple: int) -> str:
    """The end of ``validate_batch``'s message: why each device's share must
    be a multiple of ``multiple`` (``batch_multiple(config)``)."""
    del config
    return f'objective {self.name!r} needs a multiple of {multiple}'

  def validate_batch(self, config, batch_shards: int) -> None:
    """Raises ``ValueError`` for a ``config.batch_size`` this objective
    cannot split over ``batch_shards`` devices (checked before any data or
    tokenizer work): each share must be a multiple of ``batch_multiple``."""
    multiple = self.batch_multiple(config)
    local_batch = config.batch_size // batch_shards
    if local_batch % multiple:
      raise ValueError(
          f'batch_size {config.batch_size} gives a per-device batch of '
          f'{local_batch} ({batch_shards} batch shards), which '
          f'{self.batch_multiple_why(config, multiple)}: choose batch_size '
          f'a multiple of {multiple * batch_shards}')

  def masked_copies(self, config) -> Optional[dict[str, Any]]:
    """The masked copies this objective embeds besides the batch, for the
    model FLOP count (``training.mfu.run_flops_per_pair``):
    ``{'fraction', 'image_keep_ratio', ...}`` (a ``fraction`` of the pairs
    embedded again with ``image_keep_ratio`` of their patches), or None
    (default: none)."""
    del config
    return None

  def extend_corpus(self, corpus: Callable[[], list]) -> Callable[[], list]:
    """The tokenizer-training corpus for this objective (default: as is)."""
    return corpus

  def wrap_dataset(self, config, dataset, source, tokenizer, image_size: int,
                   process_index: int, process_count: int):
    """The training dataset with this objective's extra entries."""
    del config, source, tokenizer, image_size, process_index, process_count
    return dataset

  def init_extra_params(self, config, model_cfg, rng: Array
                        ) -> dict[str, Any]:
    """``{key: subtree}`` trained and saved beside the towers' parameters."""
    del config, model_cfg, rng
    return {}

  # -- the loss -------------------------------------------------------------

  def local_loss(self, loss_cfg, axis_name: Optional[Any] = None
                 ) -> Callable[..., tuple[Array, dict]]:
    """``f(img, txt, scale, bias, img_aux, txt_aux) -> (loss, metrics)``.

    ``img``/``txt``: ``losses.GaussianBatch`` (logvar None for deterministic
    towers); ``img_aux``/``txt_aux``: what ``make_aux_fn`` adds, else None.
    With ``axis_name`` the arrays are local shards and the function uses the
    blockwise forms; the result is the global-batch loss on every device.
    """
    raise NotImplementedError

  def shard_specs(self) -> tuple:
    """``shard_map`` in_specs of ``local_loss``'s arguments (pytree prefixes:
    every array of img/txt and the aux embeddings is split along its batch
    dimension; scale and bias are replicated)."""
    batch = P(shd.BATCH_AXES)
    return (batch, batch, P(), P(), batch, batch)

  def loss_over(self, loss_cfg, mesh) -> Callable[..., tuple[Array, dict]]:
    """``local_loss`` over global (sharded) arrays for ``mesh``."""
    if shd.num_batch_shards(mesh) == 1:
      return self.local_loss(loss_cfg)
    return jax.shard_map(
        self.local_loss(loss_cfg, axis_name=shd.BATCH_AXES), mesh=mesh,
        in_specs=self.shard_specs(), out_specs=P())

  def make_aux_fn(self, model, config, mesh, mask_id: int
                  ) -> Optional[Callable]:
    """``aux(model, params, teacher, images, tokens, img, txt, rng) -> (img,
    txt, img_aux, txt_aux)`` or None: embeddings the loss needs besides the
    batch's own (may also reorder the batch rows of img and txt)."""
    del model, config, mesh, mask_id
    return None

  def make_extra_fn(self, model, config, mesh) -> Optional[Callable]:
    """``extra(loss, metrics, apply, batch) -> (loss, metrics)`` or None:
    terms over other batch entries (``apply`` is the bound model apply)."""
    del model, config, mesh
    return None

  def make_embed_fn(self, model, config, mesh, mask_id: int) -> Callable:
    """``embed(params, teacher, images, tokens, rng) -> (img, txt, img_aux,
    txt_aux)``: the batch's tower outputs (``GaussianBatch``es) and what
    ``make_aux_fn`` adds (else None), i.e. the arguments of ``local_loss``
    besides scale and bias. ``images`` are normalised floats."""
    aux = self.make_aux_fn(model, config, mesh, mask_id)

    def embed(params, teacher, images, tokens, rng):
      apply = functools.partial(model.apply, {'params': params})
      img = GaussianBatch(*apply(images, method='encode_image'))
      txt = GaussianBatch(*apply(tokens, method='encode_text'))
      img_aux = txt_aux = None
      if aux is not None:
        img, txt, img_aux, txt_aux = aux(model, params, teacher, images,
                                         tokens, img, txt, rng)
      return img, txt, img_aux, txt_aux

    return embed

  def make_loss_fn(self, model, config, mesh, mask_id: int) -> LossFn:
    """``loss_fn(params, teacher, batch, rng) -> (loss, metrics)``.

    ``batch`` holds ``image`` ``(B, s, s, 3)`` uint8 and ``tokens``
    ``(B, L)``; the metrics always carry ``loss``, ``scale`` (a), ``bias``
    (b) and, for Gaussian towers, mean sigma^2 of images and captions.
    """
    loss_over = self.loss_over(config.loss, mesh)
    embed = self.make_embed_fn(model, config, mesh, mask_id)
    extra = self.make_extra_fn(model, config, mesh)
    mean, std = config.data.mean, config.data.std

    def loss_fn(params, teacher, batch, rng):
      images = train_images(batch, mean, std)
      img, txt, img_aux, txt_aux = embed(params, teacher, images,
                                         batch['tokens'], rng)
      scale = jnp.exp(params['logit_scale'])
      bias = params['logit_bias']
      loss, metrics = loss_over(img, txt, scale, bias, img_aux, txt_aux)
      if extra is not None:
        apply = functools.partial(model.apply, {'params': params})
        loss, metrics = extra(loss, metrics, apply, batch)
      metrics = dict(metrics, scale=scale, bias=bias,
                     **gaussian_stats(img, txt))
      return loss, metrics

    return loss_fn

  def update_teacher(self, config, teacher, params):
    """The teacher after an optimizer step (default: unchanged)."""
    del config, params
    return teacher

  # -- evaluation -----------------------------------------------------------

  def encoders(self, model, params, config) -> tuple[Callable, Callable]:
    """``(enc_img(images, keep=None), enc_txt(tokens))`` into the space this
    objective is scored in; images are normalised floats ``(n, s, s, 3)``,
    ``keep`` optional patch indices; each returns ``(mu, logvar or None)``.
    ``config`` is the run config (a ConfigDict or the dict in a checkpoint).
    """
    del config
    return tower_encoders(model, params)

  def heldout_metrics(self, embed_images: Callable, embed_texts: Callable,
                      image_size: int) -> dict[str, float]:
    """The objective's own figures in the ``heldout`` evaluation (default
    none): ``embed_images(uint8 (n, s, s, 3))`` and
    ``embed_texts(list of str)`` return ``(mu, logvar or None)``."""
    del embed_images, embed_texts, image_size
    return {}
