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
``uses_teacher``             the towers get the parameters' EMA (OTTER)
``demo_settings``            its settings in the CPU demos (``demos.py``)
``local_loss(...)``          the loss over tower outputs, dense or per shard
``aux_inputs(...)``          extra per-row tower inputs (ProLIP's masked
                             copies: which rows, their masks)
``aux_towers(...)``          extra tower outputs from them (the masked
                             copies' embeddings, the teacher's)
``arrange(...)``             the outputs in the loss's order (ProLIP)
``make_loss_parts(...)``     the step loss as inputs -> towers -> loss
                             (default: the three hooks above around the
                             two towers); ``accum_steps`` splits the middle
``make_embed_fn(...)``       towers + aux embeddings (the loss's inputs)
``make_loss_fn(...)``        the whole step loss, un-split
``encoders(...)``            the space it is scored in (eval, ``load``)
``heldout_metrics(...)``     the objective's own held-out figures (PC-CLIP eq. 2)
===========================  ==============================================

The default ``make_loss_parts`` is the two-tower step every image-text
objective shares, in three parts: ``inputs`` (normalise the images, draw
whatever is random: parameter-free, on the whole global batch), ``towers``
(embed images and captions and add the auxiliary embeddings: row by row, so
it may run on any split of the rows) and ``loss`` (arrange the outputs,
evaluate the loss in ``shard_map`` with the blockwise forms when the batch
is split over devices). ``make_loss_fn`` composes them;
``training.accumulation`` runs the towers micro-batch by micro-batch around
one evaluation of the loss (``accum_steps``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

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


@dataclasses.dataclass(frozen=True)
class LossParts:
  """A step loss in three parts, so that its towers can run on any split of
  the batch's rows (``accum_steps``, the GradCache construction) while its
  loss still sees the whole global batch.

  ``inputs(batch, rng) -> rows``: parameter-free (normalised images, every
  random draw), on the whole global batch; ``{name: (n, ...)}``, each
  leading dimension a multiple of the batch shards.
  ``towers(params, teacher, rows) -> outs``: row-wise (output row i of each
  array depends on input row i of the rows alone), a pytree of arrays with
  leading row dimensions.
  ``loss(params, outs, batch) -> (loss, metrics)``: the objective's loss
  over the whole batch's ``outs`` (``params`` for its own scalars).
  """
  inputs: Callable[[dict, Array], dict]
  towers: Callable[[Any, Any, dict], Any]
  loss: Callable[[Any, Any, dict], tuple[Array, dict]]


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
  ``uses_teacher`` (the towers get the train state's moving average of the
  parameters, ``optim.ema_decay``, as ``teacher``; the evaluators then
  score the parameters themselves),
  ``multi_view`` (several augmented views per image, ``data.num_views``),
  ``exportable`` (the towers alone are the scoring model, so the PyTorch
  export is complete) and ``demo_settings`` (what the CPU demos of
  ``prolip_jax/demos.py`` set for it beyond what every objective shares).
  """

  name: str = ''
  needs_unc: bool = False
  uses_teacher: bool = False
  multi_view: bool = False
  # Whether export to the PyTorch/open_clip layout gives the scoring model.
  exportable: bool = True
  # The CPU demos with this objective: {demo: {dotted config key: value}},
  # laid over the settings every objective shares in that demo (demos.py:
  # 'tiny' on the digits, 'emoji', 'emoji_study'; each demo extends the one
  # before it, so a setting holds in the later ones too). Its [UNC] tokens
  # follow ``needs_unc``, the keys it adds (``config_keys.Key.added_by``)
  # come with their defaults. Settings for a few hundred steps on a CPU,
  # not the paper's.
  demo_settings: Mapping[str, Mapping[str, Any]] = {}

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
    tokenizer work): each share must be a multiple of ``batch_multiple``,
    times ``accum_steps`` (every micro-batch takes its share of them)."""
    multiple = self.batch_multiple(config)
    accum = int(config.get('accum_steps', 1) or 1)
    local_batch = config.batch_size // batch_shards
    if local_batch % (multiple * accum):
      why = self.batch_multiple_why(config, multiple)
      if accum > 1:
        why = (f'must split into accum_steps={accum} equal micro-batches'
               + (f', each of which {why}' if multiple > 1 else ''))
      per_shard = multiple * accum
      # On a resume batch_size is fixed: the slice is what to change.
      fits = (config.batch_size // per_shard
              if config.batch_size % per_shard == 0 else 0)
      raise ValueError(
          f'batch_size {config.batch_size} gives a per-device batch of '
          f'{local_batch} ({batch_shards} batch shards), which {why}: '
          f'choose batch_size a multiple of {per_shard * batch_shards}'
          + (f', or a mesh whose batch shards (mesh.data x mesh.fsdp, '
             f'mesh.num_devices) divide {fits}' if fits else ''))

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
    towers); ``img_aux``/``txt_aux``: what ``aux_towers`` adds, else None.
    With ``axis_name`` the arrays are local shards: the function passes it
    to the losses' entries (``clip_loss(..., axis_name=axis_name)``), which
    then run their blockwise forms; the result is the global-batch loss on
    every device.
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

  def aux_inputs(self, model, config, mesh, mask_id: int
                 ) -> Optional[Callable[..., dict]]:
    """``aux(images, tokens, rng) -> {name: (n, ...)}`` or None: parameter-free
    per-row inputs of ``aux_towers`` drawn on the whole global batch (which
    rows get masked copies, their patch indices and masked captions), so a
    split of the rows changes none of them. Every array's leading dimension
    is a multiple of the batch shards (each device's rows stay its own)."""
    del model, config, mesh, mask_id
    return None

  def aux_towers(self, model, config
                 ) -> Optional[Callable[..., tuple[Any, Any]]]:
    """``aux(params, teacher, rows) -> (img_aux, txt_aux)`` or None: row-wise
    embeddings the loss needs besides the batch's own, from ``rows``
    (``aux_inputs``' arrays and ``images``/``tokens``): output row i
    depends on input row i only."""
    del model, config
    return None

  def arrange(self, config, mesh) -> Optional[Callable[..., tuple]]:
    """``arrange(img, txt, img_aux, txt_aux) -> (img, txt, img_aux,
    txt_aux)`` or None: the tower outputs in the order ``local_loss`` takes
    them (ProLIP pairs each shard's masked copies with its first rows)."""
    del config, mesh
    return None

  def _rows_fn(self, model, config, mesh, mask_id: int) -> Callable:
    """``rows_of(images, tokens, rng)``: the default towers' rows, from
    normalised images (``images``, ``tokens`` and ``aux_inputs``')."""
    aux_in = self.aux_inputs(model, config, mesh, mask_id)

    def rows_of(images, tokens, rng):
      rows = {'images': images, 'tokens': tokens}
      if aux_in is not None:
        rows.update(aux_in(images, tokens, rng))
      return rows

    return rows_of

  def make_loss_parts(self, model, config, mesh, mask_id: int) -> LossParts:
    """The step loss as ``LossParts`` (inputs -> towers -> loss).

    ``batch`` holds ``image`` ``(B, s, s, 3)`` uint8 and ``tokens``
    ``(B, L)``; the towers' outputs are ``(img, txt, img_aux, txt_aux)``
    (``GaussianBatch``es, the aux ones None without ``aux_towers``); the
    metrics always carry ``loss``, ``scale`` (a), ``bias`` (b) and, for
    Gaussian towers, mean sigma^2 of images and captions.
    """
    loss_over = self.loss_over(config.loss, mesh)
    rows_of = self._rows_fn(model, config, mesh, mask_id)
    aux_out = self.aux_towers(model, config)
    arrange = self.arrange(config, mesh)
    mean, std = config.data.mean, config.data.std

    def inputs(batch, rng):
      return rows_of(train_images(batch, mean, std), batch['tokens'], rng)

    def towers(params, teacher, rows):
      apply = functools.partial(model.apply, {'params': params})
      img = GaussianBatch(*apply(rows['images'], method='encode_image'))
      txt = GaussianBatch(*apply(rows['tokens'], method='encode_text'))
      img_aux = txt_aux = None
      if aux_out is not None:
        img_aux, txt_aux = aux_out(params, teacher, rows)
      return img, txt, img_aux, txt_aux

    def loss(params, outs, batch):
      img, txt, img_aux, txt_aux = outs
      stats = gaussian_stats(img, txt)
      if arrange is not None:
        img, txt, img_aux, txt_aux = arrange(img, txt, img_aux, txt_aux)
      scale = jnp.exp(params['logit_scale'])
      bias = params['logit_bias']
      del batch  # (an objective's extra terms read it: PC-CLIP's pairs)
      value, metrics = loss_over(img, txt, scale, bias, img_aux, txt_aux)
      return value, dict(metrics, scale=scale, bias=bias, **stats)

    return LossParts(inputs, towers, loss)

  def make_embed_fn(self, model, config, mesh, mask_id: int) -> Callable:
    """``embed(params, teacher, images, tokens, rng) -> (img, txt, img_aux,
    txt_aux)``: the batch's tower outputs (``GaussianBatch``es) and what
    ``aux_towers`` adds (else None), arranged: the arguments of
    ``local_loss`` besides scale and bias. ``images`` are normalised
    floats."""
    rows_of = self._rows_fn(model, config, mesh, mask_id)
    parts = self.make_loss_parts(model, config, mesh, mask_id)
    arrange = self.arrange(config, mesh)

    def embed(params, teacher, images, tokens, rng):
      outs = parts.towers(params, teacher, rows_of(images, tokens, rng))
      return outs if arrange is None else arrange(*outs)

    return embed

  def make_loss_fn(self, model, config, mesh, mask_id: int) -> LossFn:
    """``loss_fn(params, teacher, batch, rng) -> (loss, metrics)``: the
    ``make_loss_parts`` composed on the whole batch."""
    parts = self.make_loss_parts(model, config, mesh, mask_id)

    def loss_fn(params, teacher, batch, rng):
      outs = parts.towers(params, teacher, parts.inputs(batch, rng))
      return parts.loss(params, outs, batch)

    return loss_fn

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
