"""The optimizer: AdamW on a warm-up + cosine schedule, weight decay on
matrices only, an optional global-norm clip, an optional learning-rate
multiplier for the uncertainty parameters (paper 4.1, B.1), optionally
frozen (locked) parameters, ``optim.freeze`` (LiT: docs/training.md), and
the moving average of the parameters (``optim.ema_decay``)."""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import optax

from prolip_jax import errors
from prolip_jax.config import keys as config_keys
from prolip_jax.models.transformer import SCANNED_BLOCKS

# The labels of ``optim.freeze``'s partition of the parameters.
TRAIN = 'train'
FREEZE = 'freeze'


def learning_rate_schedule(optim, total_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to ``lr``, then cosine decay to ``lr*end_ratio``."""
  warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=optim.lr * optim.end_lr_ratio)


def weight_decay_mask(params: Any) -> Any:
  """Decay matrices and kernels only: not norms, biases, [CLS]/[UNC] tokens,
  nor the scalars a and b (everything with fewer than two dimensions, not
  counting the layer axis of a scanned block stack)."""
  def decays(path, p):
    stacked = any(getattr(k, 'key', None) == SCANNED_BLOCKS for k in path)
    return p.ndim - int(stacked) >= 2
  return jax.tree_util.tree_map_with_path(decays, params)


# The parameters that produce log sigma^2 and nothing else: the [UNC] tokens
# and the uncertainty heads of both towers (paper 4.1).
UNCERTAINTY_PARAMS = ('unc_embedding', 'uncertainty_proj', 'unc_emb',
                      'text_uncertainty_projection')


def uncertainty_mask(params: Any) -> Any:
  """True for every leaf under one of ``UNCERTAINTY_PARAMS``."""
  def under(path, _):
    return any(getattr(k, 'key', None) in UNCERTAINTY_PARAMS for k in path)
  return jax.tree_util.tree_map_with_path(under, params)


def parameter_path(path) -> str:
  """The '/'-joined keys of a pytree path, e.g. ``'visual/conv1/kernel'``
  or ``'logit_scale'``: what ``optim.freeze`` patterns are matched against."""
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def freeze_patterns(optim) -> tuple[str, ...]:
  """``optim.freeze`` (empty when ``optim`` lacks it), checked: a sequence of
  regular expressions. ``ConfigError`` for a bare string, a non-string
  entry or a pattern ``re`` cannot compile."""
  value = optim.get('freeze', config_keys.default('optim.freeze'))
  if isinstance(value, str) or not isinstance(value, (list, tuple)):
    raise errors.ConfigError(
        f'optim.freeze must be a sequence of patterns, e.g. '
        f"('visual/.*',), got {value!r}")
  for pattern in value:
    if not isinstance(pattern, str):
      raise errors.ConfigError(f'optim.freeze: {pattern!r} is not a string '
                               'pattern')
    try:
      re.compile(pattern)
    except re.error as e:
      raise errors.ConfigError(f'optim.freeze: {pattern!r} is not a regular '
                               f'expression ({e})') from e
  return tuple(value)


def frozen_mask(params: Any, patterns: tuple[str, ...]) -> Any:
  """True for every leaf of ``params`` whose ``parameter_path`` one of
  ``patterns`` matches in full (``re.fullmatch``): the frozen parameters.

  Raises ``ConfigError`` (one line) for a pattern that matches no parameter,
  naming it and a few real paths, and for patterns that freeze every
  parameter (nothing would train). ``params``: arrays or their
  ``jax.eval_shape``; only the paths are read."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = [parameter_path(p) for p, _ in leaves]
  compiled = [re.compile(p) for p in patterns]
  hits = [[c.fullmatch(path) is not None for c in compiled] for path in paths]
  for i, pattern in enumerate(patterns):
    if not any(h[i] for h in hits):
      firsts = {}
      for path in paths:  # the first path under each top-level name
        firsts.setdefault(path.split('/')[0], path)
      raise errors.ConfigError(
          f'optim.freeze pattern {pattern!r} matches no parameter (regular '
          "expressions matched in full against '/'-joined paths such as "
          f"{', '.join(repr(p) for p in list(firsts.values())[:6])})")
  frozen = [any(h) for h in hits]
  if frozen and all(frozen):
    raise errors.ConfigError(f'optim.freeze {tuple(patterns)!r} freezes '
                             'every parameter: nothing would train')
  return jax.tree.unflatten(jax.tree.structure(params), frozen)


def freeze_labels(patterns: tuple[str, ...]) -> Callable[[Any], Any]:
  """``params -> labels``: ``FREEZE`` for the leaves ``frozen_mask`` marks,
  ``TRAIN`` for the rest (``optax.partition``'s labels)."""
  def labels(params):
    return jax.tree.map(lambda f: FREEZE if f else TRAIN,
                        frozen_mask(params, patterns))
  return labels


def stop_frozen_gradients(optim, params: Any) -> Any:
  """``params`` with ``jax.lax.stop_gradient`` on the frozen leaves: their
  gradient is zero and never computed (no backward pass through a locked
  tower). ``params`` itself when ``optim.freeze`` is empty."""
  patterns = freeze_patterns(optim)
  if not patterns:
    return params
  return jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p,
                      params, frozen_mask(params, patterns))


def make_optimizer(optim, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW on ``learning_rate_schedule`` (optionally after a global-norm
  clip). ``optim.unc_lr_mult`` != 1 multiplies the update, weight decay
  included, of the ``UNCERTAINTY_PARAMS`` group: their learning rate is
  ``unc_lr_mult * lr`` (a short-run knob, docs/small_scale_uncertainty.md).

  ``optim.freeze`` (patterns, ``frozen_mask``) partitions the parameters:
  the frozen ones get ``optax.set_to_zero`` (no update, no weight decay, no
  optimizer state), the rest all of the above; the clip's global norm
  counts the trainable gradients only. ``tx.init`` raises ``ConfigError``
  for a pattern that matches no parameter."""
  schedule = learning_rate_schedule(optim, total_steps)
  tx = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                   weight_decay=optim.weight_decay, mask=weight_decay_mask)
  unc_lr_mult = float(optim.get('unc_lr_mult',
                                config_keys.default('optim.unc_lr_mult')))
  if unc_lr_mult <= 0:
    raise ValueError(f'optim.unc_lr_mult must be > 0, got {unc_lr_mult}')
  if unc_lr_mult != 1.0:
    # Only when set, so the optimizer state of existing runs keeps its shape.
    tx = optax.chain(tx, optax.masked(optax.scale(unc_lr_mult),
                                      uncertainty_mask))
  if optim.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(optim.grad_clip), tx)
  patterns = freeze_patterns(optim)
  if patterns:
    # Only when set, so the optimizer state of existing runs keeps its shape.
    tx = optax.partition({TRAIN: tx, FREEZE: optax.set_to_zero()},
                         freeze_labels(patterns))
  return tx, schedule


def keeps_ema(config) -> bool:
  """Whether the train state keeps a moving average of the parameters
  (``optim.ema_decay`` > 0)."""
  return float(config_keys.get(config, 'optim.ema_decay')) > 0


def ema_update(ema: Any, params: Any, decay: float) -> Any:
  """theta~ <- m theta~ + (1 - m) theta, leaf by leaf (OTTER's section 3.4
  teacher update; the usual weight EMA), in each average leaf's dtype."""
  return jax.tree.map(
      lambda t, p: (decay * t + (1.0 - decay) * p).astype(t.dtype), ema,
      params)


def evaluates_ema(config, objective) -> bool:
  """Whether the evaluators score the moving average rather than the
  parameters: it is kept and the objective does not distil from it (OTTER's
  is its teacher; the paper scores the student)."""
  return keeps_ema(config) and not objective.uses_teacher
