"""The train state and the train step.

One jitted ``train_step`` (read it top to bottom: the objective's loss and
gradients, AdamW update, clamp the scale, the parameters' moving average),
its state created sharded (``run_state_initializer``) and its jit with the
state's shardings (``jit_train_step``): what ``train_and_evaluate`` runs and
``prolip_jax.aot`` and the benchmarks compile. Nothing here is specific to
one objective: ``objectives.get(config.objective)`` supplies the loss
(``prolip_jax/objectives/base.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax

from prolip_jax import models
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.config import keys as config_keys
from prolip_jax.models import ProLIP
from prolip_jax.objectives.base import LossParts
from prolip_jax.objectives.base import Objective
from prolip_jax.training import accumulation
from prolip_jax.training import optimizer
from prolip_jax.training.optimizer import freeze_patterns
from prolip_jax.training.optimizer import stop_frozen_gradients


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates done so far
  params: Any
  opt_state: Any
  # Exponential moving average of the parameters (``optim.ema_decay``; the
  # teacher of an objective that distils from it, OTTER), else None.
  ema: Any = None


# ----------------------------------------------------------------------------
# The train step


def resolve_objective(config, objective: Optional[Objective]) -> Objective:
  """``objective``, or ``config.objective``'s when None (callers outside the
  training loop that have not resolved it)."""
  return objective if objective is not None else objectives.get(
      config.objective)


def _frozen_parts(parts: LossParts, optim) -> LossParts:
  """``parts`` reading the frozen parameters (``optim.freeze``) through
  ``stop_gradient``: their gradient is zero and its backward pass (a locked
  tower's) is never traced. ``parts`` itself when nothing is frozen."""
  if not freeze_patterns(optim):
    return parts
  stop = functools.partial(stop_frozen_gradients, optim)
  return dataclasses.replace(
      parts,
      towers=lambda params, teacher, rows: parts.towers(stop(params), teacher,
                                                        rows),
      loss=lambda params, outs, batch: parts.loss(stop(params), outs, batch))


def make_train_step(model: ProLIP, config: ml_collections.ConfigDict,
                    tx: optax.GradientTransformation, schedule: optax.Schedule,
                    mesh, mask_id: int, objective: Optional[Objective] = None
                    ) -> Callable:
  """``train_step(state, batch, rng) -> (state, metrics)``, not yet jitted.

  A step whose loss or gradient is not finite changes nothing but the step
  counter (parameters, optimizer state and EMA stay as they were) and
  reports ``metrics['nonfinite'] = 1``. ``objective``: ``config.objective``'s
  (resolved here when None). ``metrics['grad_norm']`` is the global norm of
  the trainable parameters' gradient (a frozen one, ``optim.freeze``, is
  zero and never computed).
  """
  objective = resolve_objective(config, objective)
  value_and_grad = accumulation.value_and_grad(
      _frozen_parts(objective.make_loss_parts(model, config, mesh, mask_id),
                    config.optim),
      config_keys.get(config, 'accum_steps'), mesh)
  max_log_scale = math.log(config.optim.max_logit_scale)
  nan_steps = tuple(config_keys.get(config, 'debug_nan_steps'))
  ema_decay = float(config_keys.get(config, 'optim.ema_decay'))

  def train_step(state: TrainState, batch, rng):
    rng = jax.random.fold_in(rng, state.step)
    (_, metrics), grads = value_and_grad(state.params, state.ema, batch,
                                         rng)
    if nan_steps:  # fault injection for tests: these steps become NaN
      poison = jnp.where(jnp.isin(state.step + 1, jnp.asarray(nan_steps)),
                         jnp.nan, 1.0)
      metrics = dict(metrics, loss=metrics['loss'] * poison)
      grads = jax.tree.map(lambda g: g * poison, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # As in the release: keep the temperature a = exp(log a) within [1, 100].
    params = dict(params, logit_scale=jnp.clip(params['logit_scale'], 0.0,
                                               max_log_scale))
    ema = (None if state.ema is None
           else optimizer.ema_update(state.ema, params, ema_decay))
    metrics['grad_norm'] = optax.tree.norm(grads)
    metrics['lr'] = schedule(state.step)
    finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
    metrics['nonfinite'] = (~finite).astype(jnp.float32)
    keep_old = functools.partial(jax.tree.map,
                                 lambda new, old: jnp.where(finite, new, old))
    return TrainState(state.step + 1, keep_old(params, state.params),
                      keep_old(opt_state, state.opt_state),
                      keep_old(ema, state.ema)), metrics

  return train_step


# ----------------------------------------------------------------------------
# The state, created sharded, and the jitted step


def train_state_initializer(model: ProLIP, tx: optax.GradientTransformation,
                            mesh, with_ema: bool = False,
                            extra_params: Optional[Callable] = None,
                            fsdp_min_size_mb: float = shd.FSDP_MIN_SIZE_MB
                            ) -> tuple[Callable, TrainState]:
  """A jitted ``rng -> TrainState`` creating every array with its sharding.

  Parameters and optimizer state follow the FSDP rule of ``sharding.py``; no
  device ever holds an unsharded copy. Also returns the state's shardings.
  ``with_ema``: add a moving average of the parameters (``optim.ema_decay``;
  OTTER's teacher) starting equal to them.
  ``extra_params(rng) -> {key: subtree}`` adds an objective's own parameters
  (``Objective.init_extra_params``, e.g. UniCLIP's heads) next to the
  model's, to be trained and saved with them. ``fsdp_min_size_mb``: arrays
  smaller than this stay replicated (``sharding.param_spec``).
  """

  def init_state(rng):
    params = models.init_params(model, rng)
    if extra_params is not None:
      extra = extra_params(jax.random.fold_in(rng, 1))
      if extra:
        params = dict(params, **extra)
    ema = params if with_ema else None
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                      ema)

  abstract = jax.eval_shape(init_state, jax.random.key(0))
  param_shardings = shd.param_shardings(mesh, abstract.params,
                                       fsdp_min_size_mb)
  shardings = TrainState(shd.replicated(mesh), param_shardings,
                         shd.param_shardings(mesh, abstract.opt_state,
                                             fsdp_min_size_mb),
                         param_shardings if with_ema else None)
  return jax.jit(init_state, out_shardings=shardings), shardings


def run_state_initializer(config, model: ProLIP,
                          tx: optax.GradientTransformation, mesh,
                          objective: Optional[Objective] = None
                          ) -> tuple[Callable, TrainState]:
  """``train_state_initializer`` for ``config``'s objective (its EMA and
  extra parameters): the state ``prolip_jax.main`` trains and
  ``prolip_jax.aot`` and the benchmarks compile for."""
  objective = resolve_objective(config, objective)
  return train_state_initializer(
      model, tx, mesh, with_ema=optimizer.keeps_ema(config),
      extra_params=lambda rng: objective.init_extra_params(
          config, model.config, rng),
      fsdp_min_size_mb=config.mesh.get('fsdp_min_size_mb',
                                       shd.FSDP_MIN_SIZE_MB))


def jit_train_step(model: ProLIP, config, tx: optax.GradientTransformation,
                   schedule: optax.Schedule, mesh, mask_id: int,
                   state_shardings: TrainState,
                   objective: Optional[Objective] = None) -> Callable:
  """The jitted ``train_step(state, batch, rng)`` of a run: state sharded by
  ``state_shardings`` (``run_state_initializer``'s) and donated, batch split
  over the mesh's batch axes. ``prolip_jax.main`` runs it;
  ``prolip_jax.aot`` compiles it for a topology, the benchmarks time it."""
  return jax.jit(
      make_train_step(model, config, tx, schedule, mesh, mask_id, objective),
      in_shardings=(state_shardings, shd.batch_sharding(mesh),
                    shd.replicated(mesh)),
      out_shardings=(state_shardings, shd.replicated(mesh)),
      donate_argnums=(0,))

