"""Config-selected training objectives over tower outputs.

An objective maps the embeddings of one step to ``(loss, metrics)``. When the
batch is split over several devices it runs inside ``shard_map`` with the
blockwise (ring) losses, so no device ever holds the global B x B logits.

UniCLIP ('uniclip') is the exception to the common signature: its loss is over
head embeddings of V views and the captions (``uniclip_train`` builds them),
``f(z_views (b, V, E), z_txt (b, E), temperatures (3,), offsets (3,))``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from jax.sharding import PartitionSpec as P

from prolip_jax import losses
from prolip_jax import sharding as shd

OBJECTIVES = ('prolip', 'siglip', 'clip', 'pcme', 'otter', 'uniclip',
              'pcclip')
# Objectives over Gaussian embeddings: they need model.use_unc=True.
PROBABILISTIC = ('prolip', 'pcme')
# Objectives that also embed masked copies of some samples (eq. 6's
# inclusion terms); PCME++ has none.
MASKED = ('prolip',)
# Objectives distilling from an EMA teacher kept in the train state.
TEACHER = ('otter',)
# Objectives over several augmented views per image (data.num_views >= 2),
# with their own heads and parameters in params[<name>].
MULTI_VIEW = ('uniclip',)
# Objectives that also embed a batch of image pairs and difference texts
# (``data.pairs``) and add a term over them (``add_pair_loss``).
PAIRED = ('pcclip',)
# Fields of config.loss that PC-CLIP reads.
PCCLIP_LOSS_FIELDS = ('pcclip_weight', 'pcclip_tau', 'pcclip_squared',
                      'pcclip_max_phrases')


def _loss_kwargs(loss_cfg) -> dict[str, Any]:
  return dict(alpha1=loss_cfg.alpha1, alpha2=loss_cfg.alpha2,
              beta=loss_cfg.beta, c=loss_cfg.c, eps=loss_cfg.eps,
              vib_release_quirk=loss_cfg.vib_release_quirk,
              guard=loss_cfg.guard)


def local_objective(name: str, loss_cfg, axis_name: Optional[Any] = None
                    ) -> Callable[..., tuple[jax.Array, dict]]:
  """``f(img, txt, scale, bias, img_aux, txt_aux) -> (loss, metrics)``.

  ``img``/``txt`` are ``losses.GaussianBatch`` (logvar None for deterministic
  objectives). ``img_aux``/``txt_aux`` are the embeddings of the masked
  copies for 'prolip' (rows of the ``strided_rows`` samples), the EMA
  teacher's embeddings of the same batch for 'otter', and unused (None)
  otherwise. With ``axis_name`` the function expects local shards and uses
  the blockwise forms; the result is the global-batch loss on every device.
  """
  if name == 'prolip':
    if axis_name is None:
      return lambda *a: losses.prolip_loss(*a, **_loss_kwargs(loss_cfg))
    from prolip_jax.losses import blockwise  # pylint: disable=g-import-not-at-top
    return lambda *a: blockwise.prolip_loss_blockwise(
        *a, axis_name=axis_name, **_loss_kwargs(loss_cfg))
  if name == 'siglip':
    def siglip(img, txt, scale, bias, *_):
      if axis_name is None:
        loss = losses.siglip_loss(img.mu, txt.mu, scale, bias)
      else:
        from prolip_jax.losses import blockwise  # pylint: disable=g-import-not-at-top
        loss = blockwise.siglip_loss_blockwise(img.mu, txt.mu, scale, bias,
                                               axis_name)
      return loss, {'loss': loss, 'siglip': loss}
    return siglip
  if name in ('clip', 'pcclip'):
    def clip(img, txt, scale, bias, *_):
      del bias
      # For 'pcclip' this is the image-caption half; ``add_pair_loss`` adds
      # the difference term.
      if axis_name is None:
        loss = losses.clip_loss(img.mu, txt.mu, scale)
      else:
        loss = losses.clip_loss_blockwise(img.mu, txt.mu, scale, axis_name)
      return loss, {'loss': loss, 'clip': loss}
    return clip
  if name == 'pcme':
    beta = float(loss_cfg.beta)
    quirk = bool(loss_cfg.vib_release_quirk)

    def pcme(img, txt, scale, bias, *_):
      if axis_name is None:
        pml = losses.pcme_pml_loss(img.mu, img.logvar, txt.mu, txt.logvar,
                                   scale, bias)
      else:
        pml = losses.pcme_pml_loss_blockwise(img.mu, img.logvar, txt.mu,
                                             txt.logvar, scale, bias,
                                             axis_name)
      metrics = {'pml': pml}
      loss = pml
      if beta > 0:
        # Each device's VIB is a mean over its rows; averaging over the
        # (equal) shards gives the global-batch mean.
        vib = 0.5 * (losses.vib_loss(img.mu, img.logvar, quirk)
                     + losses.vib_loss(txt.mu, txt.logvar, quirk))
        if axis_name is not None:
          vib = jax.lax.pmean(vib, axis_name)
        metrics['vib'] = vib
        loss = loss + beta * vib
      metrics['loss'] = loss
      return loss, metrics
    return pcme
  if name == 'otter':
    kwargs = otter_kwargs(loss_cfg)

    def otter(img, txt, scale, bias, img_t, txt_t):
      del bias
      # With [UNC] towers the student logits are CSD-based (the probabilistic
      # variant); the teacher's Sinkhorn targets use its means only.
      lv = dict(logvar_img=img.logvar, logvar_txt=txt.logvar)
      if axis_name is None:
        return losses.otter_loss(img.mu, txt.mu, img_t.mu, txt_t.mu, scale,
                                 **kwargs, **lv)
      return losses.otter_loss_blockwise(img.mu, txt.mu, img_t.mu, txt_t.mu,
                                         scale, axis_name, **kwargs, **lv)
    return otter
  if name == 'uniclip':
    return _uniclip_objective(loss_cfg, axis_name)
  raise ValueError(f'unknown objective {name!r}; have {OBJECTIVES}')


def otter_kwargs(loss_cfg) -> dict[str, Any]:
  """``otter_loss`` keyword arguments from ``config.loss.otter``."""
  o = loss_cfg.otter
  return dict(alpha=o.alpha, lam=o.lam, n_iter=o.n_iter, gamma_v=o.gamma_v,
              gamma_t=o.gamma_t, eta=o.eta)


def _uniclip_objective(loss_cfg, axis_name):
  """MP-NCE (UniCLIP eq. 12) with eq. 16's domain scores over head outputs.

  ``f(z_views (b, V, E), z_txt (b, E), temperatures (3,), offsets (3,))``;
  views are batch-major like every other batch array (so they shard along
  axis 0) and turned view-major, as ``mp_nce_loss`` wants, here. With
  ``axis_name`` the arrays are local shards and the loss is the global one
  (``mp_nce_loss_sharded``: local anchors against all-gathered candidates).
  """
  from prolip_jax import uniclip_train  # pylint: disable=g-import-not-at-top
  from prolip_jax.losses import uniclip  # pylint: disable=g-import-not-at-top
  mode = loss_cfg.get('mp_nce_weights', 'balanced')

  def mp_nce(z_views, z_txt, temperatures, offsets):
    views = z_views.transpose(1, 0, 2)  # (V, b, E)
    weights = uniclip_train.resolve_weights(mode, views.shape[0])
    if axis_name is None:
      return uniclip.mp_nce_loss(views, z_txt, temperatures, offsets, weights)
    return uniclip.mp_nce_loss_sharded(views, z_txt, temperatures, offsets,
                                       axis_name, weights)
  return mp_nce


def validate_pcclip_config(config):
  """Clear errors for a PC-CLIP config (called by ``train.validate_config``)."""
  if config.model.use_unc:
    raise ValueError("objective 'pcclip' uses deterministic towers: set "
                     'model.use_unc=False (see configs/pcclip_tiny.py)')
  missing = [k for k in PCCLIP_LOSS_FIELDS if k not in config.loss]
  if missing:
    raise ValueError(f"objective 'pcclip' needs config.loss.{missing[0]} "
                     f'(all of {PCCLIP_LOSS_FIELDS}; defaults in '
                     "presets.tiny_demo_config('pcclip'))")
  if config.loss.pcclip_weight < 0:
    raise ValueError('loss.pcclip_weight must be >= 0, got '
                     f'{config.loss.pcclip_weight}')
  if config.loss.pcclip_tau <= 0:
    raise ValueError('loss.pcclip_tau must be > 0 (the paper uses 1.0), got '
                     f'{config.loss.pcclip_tau}')
  if int(config.loss.pcclip_max_phrases) < 0:
    raise ValueError('loss.pcclip_max_phrases must be >= 0 (0: every '
                     f'difference), got {config.loss.pcclip_max_phrases}')
  if config.data.name != 'digits':
    raise ValueError("objective 'pcclip' builds its difference pairs from "
                     "per-record attributes, which only data.name='digits' "
                     f'has for now (got {config.data.name!r})')


def pcclip_pair_loss(encode_image: Callable, encode_text: Callable,
                     batch: dict, loss_cfg, mesh=None
                     ) -> tuple[jax.Array, dict]:
  """PC-CLIP's difference term (eq. 1 with eq. 4, or eq. 5) on a pair batch.

  Args:
    encode_image: uint8 ``(n, s, s, 3)`` images -> ``(n, d)`` normalised
      embeddings g(I).
    encode_text: ``(n, L)`` tokens -> ``(n, d)`` normalised embeddings f(T).
    batch: with ``pair_image_i``, ``pair_image_j`` ``(B, s, s, 3)`` and
      ``pair_tokens`` ``(B, L)`` (``data.pairs``).
    loss_cfg: ``pcclip_tau`` (1/scale of eq. 4) and ``pcclip_squared``.
    mesh: with several batch shards, the term runs in ``shard_map`` on the
      ring (``difference_alignment_loss(..., axis_name)``).

  Returns:
    the unweighted term (scalar) and ``{'pcclip_diff': term,
    'pcclip_diff_acc': ...}``; the accuracy is eq. 2 with T = T_ij itself (a
    cheap training-time signal, chance 50%).
  """
  b = batch['pair_image_i'].shape[0]
  # One image forward pass for both sides of the pairs.
  g = encode_image(jax.numpy.concatenate([batch['pair_image_i'],
                                          batch['pair_image_j']]))
  g_i, g_j = g[:b], g[b:]
  f = encode_text(batch['pair_tokens'])
  kwargs = dict(scale=1.0 / loss_cfg.pcclip_tau,
                squared=bool(loss_cfg.pcclip_squared))
  if mesh is None or shd.num_batch_shards(mesh) == 1:
    term = losses.difference_alignment_loss(g_i, g_j, f, **kwargs)
  else:
    batch_spec = P(shd.BATCH_AXES)
    term = jax.shard_map(
        lambda a, b_, c: losses.difference_alignment_loss(
            a, b_, c, axis_name=shd.BATCH_AXES, **kwargs),
        mesh=mesh, in_specs=(batch_spec,) * 3, out_specs=P())(g_i, g_j, f)
  acc = jax.numpy.mean(losses.difference_classify(g_i, g_j, f))
  return term, {'pcclip_diff': term, 'pcclip_diff_acc': acc}


def add_pair_loss(name: str, loss_cfg, loss: jax.Array, metrics: dict,
                  encode_image: Callable, encode_text: Callable,
                  batch: dict, mesh=None) -> tuple[jax.Array, dict]:
  """Adds a ``PAIRED`` objective's pair term to the image-text loss.

  PC-CLIP: loss = CLIP(img, txt) + loss.pcclip_weight * eq. 1's term.
  """
  if name != 'pcclip':
    raise ValueError(f'objective {name!r} has no pair term; have {PAIRED}')
  term, extra = pcclip_pair_loss(encode_image, encode_text, batch, loss_cfg,
                                 mesh)
  loss = loss + loss_cfg.pcclip_weight * term
  return loss, dict(metrics, **extra, loss=loss)


def objective(name: str, loss_cfg, mesh) -> Callable[..., tuple[jax.Array,
                                                                 dict]]:
  """The objective over global (sharded) arrays for ``mesh``."""
  if shd.num_batch_shards(mesh) == 1:
    return local_objective(name, loss_cfg)
  fn = local_objective(name, loss_cfg, axis_name=shd.BATCH_AXES)
  batch = P(shd.BATCH_AXES)
  if name == 'uniclip':  # (z_views, z_txt, temperatures, offsets)
    return jax.shard_map(fn, mesh=mesh, in_specs=(batch, batch, P(), P()),
                         out_specs=P())
  # in_specs are pytree prefixes: every array of img/txt (and masked copies)
  # is split along its batch dimension; scale and bias are replicated.
  return jax.shard_map(fn, mesh=mesh,
                       in_specs=(batch, batch, P(), P(), batch, batch),
                       out_specs=P())
