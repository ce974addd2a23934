"""The optimizer: AdamW on a warm-up + cosine schedule, weight decay on
matrices only, an optional global-norm clip and an optional learning-rate
multiplier for the uncertainty parameters (paper 4.1, B.1); the moving
average of the parameters (``optim.ema_decay``)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from prolip_jax.config import keys as config_keys
from prolip_jax.models.transformer import SCANNED_BLOCKS



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


def make_optimizer(optim, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW on ``learning_rate_schedule`` (optionally after a global-norm
  clip). ``optim.unc_lr_mult`` != 1 multiplies the update, weight decay
  included, of the ``UNCERTAINTY_PARAMS`` group: their learning rate is
  ``unc_lr_mult * lr`` (a short-run knob, docs/small_scale_uncertainty.md)."""
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
