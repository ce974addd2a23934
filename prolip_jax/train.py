"""Training: ``train_and_evaluate(config, workdir)``.

One jitted ``train_step`` (read it top to bottom: the objective's loss and
gradients, AdamW update, clamp the scale, the objective's teacher update), a
data pipeline that is exactly resumable from the step, Orbax checkpoints every
``checkpoint_every_steps`` (and on interruption), metrics to
``WORKDIR/metrics.jsonl`` and TensorBoard. Nothing here is specific to one
objective: ``objectives.get(config.objective)`` supplies the loss and the
hooks (``prolip_jax/objectives/base.py``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any, Callable, Optional

from absl import logging
import flax
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from prolip_jax import atomic
from prolip_jax import checkpoint
from prolip_jax import config_drift
from prolip_jax import config_keys
from prolip_jax import errors
from prolip_jax import hub
from prolip_jax import models
from prolip_jax import objectives
from prolip_jax import progress
from prolip_jax import sharding as shd
from prolip_jax.data import pipeline
from prolip_jax.data import records
from prolip_jax.data import sources
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import tokenizer_from_config
from prolip_jax.data.tokenizer import train_tokenizer
from prolip_jax.evaluation import evaluators
from prolip_jax.evaluation import sharded as sharded_eval
from prolip_jax.evaluation import train_time
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.models.transformer import SCANNED_BLOCKS
from prolip_jax.workdir_lock import WorkdirLock


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates done so far
  params: Any
  opt_state: Any
  # EMA teacher parameters for distilling objectives (OTTER), else None.
  teacher: Any = None


# ----------------------------------------------------------------------------
# Optimizer


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


# ----------------------------------------------------------------------------
# The train step


def make_train_step(model: ProLIP, config: ml_collections.ConfigDict,
                    tx: optax.GradientTransformation, schedule: optax.Schedule,
                    mesh, mask_id: int) -> Callable:
  """``train_step(state, batch, rng) -> (state, metrics)``, not yet jitted.

  A step whose loss or gradient is not finite changes nothing but the step
  counter (parameters, optimizer state and teacher stay as they were) and
  reports ``metrics['nonfinite'] = 1``.
  """
  objective = objectives.get(config.objective)
  loss_fn = objective.make_loss_fn(model, config, mesh, mask_id)
  max_log_scale = math.log(config.optim.max_logit_scale)
  nan_steps = tuple(config_keys.get(config, 'debug_nan_steps'))

  def loss_at(params, teacher, batch, rng, step):
    loss, metrics = loss_fn(params, teacher, batch, rng)
    if nan_steps:  # fault injection for tests: these steps' loss becomes NaN
      poison = jnp.where(jnp.isin(step + 1, jnp.asarray(nan_steps)),
                         jnp.nan, 1.0)
      loss, metrics = loss * poison, dict(metrics,
                                          loss=metrics['loss'] * poison)
    return loss, metrics

  def train_step(state: TrainState, batch, rng):
    rng = jax.random.fold_in(rng, state.step)
    grads, metrics = jax.grad(loss_at, has_aux=True)(
        state.params, state.teacher, batch, rng, state.step)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # As in the release: keep the temperature a = exp(log a) within [1, 100].
    params = dict(params, logit_scale=jnp.clip(params['logit_scale'], 0.0,
                                               max_log_scale))
    teacher = objective.update_teacher(config, state.teacher, params)
    metrics['grad_norm'] = optax.tree.norm(grads)
    metrics['lr'] = schedule(state.step)
    finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
    metrics['nonfinite'] = (~finite).astype(jnp.float32)
    keep_old = functools.partial(jax.tree.map,
                                 lambda new, old: jnp.where(finite, new, old))
    return TrainState(state.step + 1, keep_old(params, state.params),
                      keep_old(opt_state, state.opt_state),
                      keep_old(teacher, state.teacher)), metrics

  return train_step


# ----------------------------------------------------------------------------
# Set-up helpers


def setup_tokenizer(config, workdir: str, corpus: Optional[Callable[[], list]],
                    stored: Optional[tuple[int, dict]] = None) -> Tokenizer:
  """The run's tokenizer, kept at ``WORKDIR/tokenizer.model``.

  A configured ``tokenizer.model_path`` is copied there; without one, a
  sentencepiece model is trained on the dataset's captions at first run and
  reused on every later run (and by ``prolip_jax.load``). ``stored``:
  ``(step, meta)`` of the checkpoint being resumed; a tokenizer other than
  the one recorded there (or a missing one) raises ``errors.TokenizerError``
  before any tokenizer is trained.
  """
  path = os.path.join(workdir, checkpoint.TOKENIZER_FILE)
  step, meta = stored if stored is not None else (None, {})
  owner = f'checkpoint step {step} under {checkpoint.checkpoint_dir(workdir)}'
  if (meta.get(checkpoint.TOKENIZER_SHA256) and not os.path.exists(path)
      and not config.tokenizer.model_path):
    checkpoint.check_tokenizer(meta, path, owner)  # refuses: file missing
  if config.tokenizer.model_path:
    if jax.process_index() == 0 and not os.path.exists(path):
      atomic.copy_file(config.tokenizer.model_path, path)
    src = config.tokenizer.model_path
  else:
    if corpus is None and not os.path.exists(path):
      raise ValueError('tokenizer.model_path is empty and the dataset '
                       f'{config.data.name!r} has no caption corpus to train '
                       'one on')
    if jax.process_index() == 0 and not os.path.exists(path):
      sentences = corpus()
      progress.status(f'Training a sentencepiece tokenizer on '
                      f'{len(sentences):,} captions -> {path}')
      train_tokenizer(sentences, path, config.tokenizer.vocab_size)
    src = path
  if jax.process_count() > 1:  # the other hosts wait for process 0's file
    multihost_utils.sync_global_devices('prolip_jax tokenizer')
  tokenizer = tokenizer_from_config(src, config,
                                    config.model.text.context_length)
  checkpoint.check_tokenizer(meta, src, owner, sha256=tokenizer.sha256)
  return tokenizer


def _stored_meta(workdir: str) -> Optional[tuple[int, dict]]:
  """``(step, meta)`` of the workdir's newest checkpoint whose meta reads,
  or None (no checkpoints)."""
  if not os.path.isdir(checkpoint.checkpoint_dir(workdir)):
    return None
  with checkpoint.manager(workdir, read_only=True) as mngr:
    return _stored_config(mngr)


def model_config_for(config, tokenizer: Tokenizer) -> ModelConfig:
  """The model config with the tokenizer's pad id; checks the vocabulary."""
  cfg = ModelConfig.from_config(config.model)
  if tokenizer.vocab_size > cfg.text.vocab_size:
    raise ValueError(f'tokenizer has {tokenizer.vocab_size} pieces but '
                     f'model.text.vocab_size is {cfg.text.vocab_size}')
  text = dict(cfg.text.__dict__, pad_id=tokenizer.pad_id)
  return ModelConfig.from_config(dict(cfg.to_dict(), text=text))


def augment_config(data) -> transforms.AugmentConfig:
  return transforms.AugmentConfig(
      crop_scale=tuple(data.crop_scale), jitter=tuple(data.jitter),
      jitter_prob=data.jitter_prob, grayscale_prob=data.grayscale_prob,
      color_on_device=bool(data.get(
          'color_on_device', config_keys.default('data.color_on_device'))))


def validate_config(config):
  """Raises ``ValueError`` for a config that cannot train (the generic
  checks, then the objective's own)."""
  objective = objectives.get(config.objective)
  if config.total_steps <= 0 or config.batch_size <= 0:
    raise ValueError('total_steps and batch_size must be positive')
  if not 0 < config.masking.image_keep_ratio <= 1:
    raise ValueError('masking.image_keep_ratio must be in (0, 1]')
  objective.validate(config)


def train_state_initializer(model: ProLIP, tx: optax.GradientTransformation,
                            mesh, with_teacher: bool = False,
                            extra_params: Optional[Callable] = None,
                            fsdp_min_size_mb: float = shd.FSDP_MIN_SIZE_MB
                            ) -> tuple[Callable, TrainState]:
  """A jitted ``rng -> TrainState`` creating every array with its sharding.

  Parameters and optimizer state follow the FSDP rule of ``sharding.py``; no
  device ever holds an unsharded copy. Also returns the state's shardings.
  ``with_teacher``: add an EMA teacher (OTTER) starting equal to the student.
  ``extra_params(rng) -> {key: subtree}`` adds an objective's own parameters
  (``Objective.init_extra_params``, e.g. UniCLIP's heads) next to the
  model's, to be trained and saved with them. ``fsdp_min_size_mb``: arrays
  smaller than this stay replicated (``sharding.param_spec``).
  """
  model_cfg = model.config

  def init_state(rng):
    size = model_cfg.vision.image_size
    params = model.init(
        rng, jnp.zeros((1, size, size, 3), jnp.float32),
        jnp.zeros((1, model_cfg.text.context_length), jnp.int32))['params']
    if extra_params is not None:
      extra = extra_params(jax.random.fold_in(rng, 1))
      if extra:
        params = dict(params, **extra)
    teacher = params if with_teacher else None
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                      teacher)

  abstract = jax.eval_shape(init_state, jax.random.key(0))
  param_shardings = shd.param_shardings(mesh, abstract.params,
                                       fsdp_min_size_mb)
  shardings = TrainState(shd.replicated(mesh), param_shardings,
                         shd.param_shardings(mesh, abstract.opt_state,
                                             fsdp_min_size_mb),
                         param_shardings if with_teacher else None)
  return jax.jit(init_state, out_shardings=shardings), shardings


def run_state_initializer(config, model: ProLIP,
                          tx: optax.GradientTransformation, mesh
                          ) -> tuple[Callable, TrainState]:
  """``train_state_initializer`` for ``config``'s objective (its teacher and
  extra parameters): the state ``prolip_jax.main`` trains and
  ``prolip_jax.aot`` compiles for."""
  objective = objectives.get(config.objective)
  return train_state_initializer(
      model, tx, mesh, with_teacher=objective.uses_teacher,
      extra_params=lambda rng: objective.init_extra_params(
          config, model.config, rng),
      fsdp_min_size_mb=config.mesh.get('fsdp_min_size_mb',
                                       shd.FSDP_MIN_SIZE_MB))


def jit_train_step(model: ProLIP, config, tx: optax.GradientTransformation,
                   schedule: optax.Schedule, mesh, mask_id: int,
                   state_shardings: TrainState) -> Callable:
  """The jitted ``train_step(state, batch, rng)`` of a run: state sharded by
  ``state_shardings`` and donated, batch split over the mesh's batch axes.
  ``prolip_jax.main`` runs it; ``prolip_jax.aot`` compiles it for a
  topology."""
  return jax.jit(
      make_train_step(model, config, tx, schedule, mesh, mask_id),
      in_shardings=(state_shardings, shd.batch_sharding(mesh),
                    shd.replicated(mesh)),
      out_shardings=(state_shardings, shd.replicated(mesh)),
      donate_argnums=(0,))


# ----------------------------------------------------------------------------
# The loop


def _stored_config(mngr) -> Optional[tuple[int, dict]]:
  """``(step, meta)`` of the newest checkpoint whose meta reads, or None."""
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      return step, checkpoint.read_meta(mngr, step)
    except Exception:  # pylint: disable=broad-except
      continue  # reported when its arrays fail to restore
  return None


def _check_drift(config, workdir: str, is_chief: bool):
  """Stops on settings that would change the model or the data of the run
  stored in the workdir; prints the other changes (they apply)."""
  if not os.path.isdir(checkpoint.checkpoint_dir(workdir)):
    return
  with checkpoint.manager(workdir, read_only=True) as mngr:
    stored = _stored_config(mngr)
  if stored is None:
    return
  step, meta = stored
  old = meta.get('config') or {}
  new = json.loads(config.to_json_best_effort())
  if not meta.get('has_opt_state', True):
    # Imported weights (step 0): only the model has to match.
    old, new = {'model': old.get('model', {})}, {'model': new['model']}
  applied = config_drift.check(old, new, step)
  if applied and is_chief:
    print(f'Resuming step {step} with changed settings (applied): '
          + '; '.join(applied), flush=True)


def _check_nothing_set_aside(workdir: str, allow_fresh_start: bool):
  """Refuses to train from step 0 over checkpoints that an earlier run set
  aside as unreadable (``checkpoints/`` empty or missing,
  ``checkpoints_unreadable/`` not): a week of training is not restarted
  without being asked to."""
  aside = os.path.join(workdir, checkpoint.UNREADABLE_DIR)
  if allow_fresh_start or not os.path.isdir(aside) or not os.listdir(aside):
    return
  if checkpoint.latest_step(workdir) is not None:
    return
  raise errors.CheckpointError(
      f'{checkpoint.checkpoint_dir(workdir)} has no checkpoint but {aside} '
      f'holds {sorted(os.listdir(aside))}, set aside as unreadable; nothing '
      'was changed: restore a readable copy into checkpoints/, or pass '
      '--allow_fresh_start (train_and_evaluate(..., allow_fresh_start=True)) '
      'to train from step 0 anyway')


def _mismatch_error(e: checkpoint.TreeMismatchError, config
                    ) -> errors.ConfigDriftError:
  """One line for a healthy checkpoint that does not fit the current
  config: the settings that differ from its stored config (or, when none
  do, the arrays), and what to do."""
  stored = (e.meta or {}).get('config') or {}
  requested = json.loads(config.to_json_best_effort())
  if not e.meta.get('has_opt_state', True):
    stored = {'model': stored.get('model', {})}
    requested = {'model': requested['model']}
  changes = config_drift.diff(stored, requested)
  fixed = {k: v for k, v in changes.items() if config_drift.is_fixed(k)}
  arrays = '; '.join(e.differences[:3]) + (
      f'; and {len(e.differences) - 3} more' if len(e.differences) > 3
      else '')
  if changes:
    why = ('settings that differ from the stored run: '
           + config_drift.describe_changes(fixed or changes)
           + f' (arrays: {arrays})')
  else:  # same settings: the code that builds the trees changed
    why = (f'its arrays differ ({arrays}) although the settings are the '
           'same (was it written by another prolip_jax version?)')
  return errors.ConfigDriftError(
      f'checkpoint step {e.step} at {e.path} is readable but does not fit the '
      f'current config: {why}; nothing was changed: resume with the stored '
      'settings or start a new --workdir')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       max_steps: Optional[int] = None,
                       allow_fresh_start: bool = False) -> dict[str, Any]:
  """Trains (resuming from the newest readable checkpoint) and evaluates.

  Holds ``WORKDIR/.lock`` while it runs (a second run on the workdir stops
  with ``WorkdirLockedError``). User mistakes (config, files, drift from the
  stored run, divergence) raise ``errors.UserError`` subclasses.

  Args:
    config: a run config (see ``configs/``).
    workdir: checkpoints, tokenizer, metrics and TensorBoard files go here.
    max_steps: stop after this many steps in this call (the schedule still
      spans ``config.total_steps``); for tests of interruption and resume.
    allow_fresh_start: train from step 0 even though ``checkpoints/`` is
      empty and ``checkpoints_unreadable/`` holds steps set aside by an
      earlier run (refused otherwise: ``CheckpointError``).

  Returns:
    A summary dict: ``step``, ``checkpoint`` (path), final ``eval`` metrics,
    the last training metrics and ``preempted`` (stopped by SIGTERM).
  """
  with errors.config_errors():
    validate_config(config)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  lock = WorkdirLock(workdir)
  failure = None
  if jax.process_index() == 0:
    try:
      lock.acquire()
    except errors.WorkdirLockedError as e:
      failure = e
  if jax.process_count() > 1:  # every process stops if process 0 could not
    held = multihost_utils.broadcast_one_to_all(np.int32(failure is None))
    if not held and failure is None:
      failure = errors.WorkdirLockedError(
          f'workdir {workdir} is in use (see process 0)')
  if failure is not None:
    raise failure
  try:
    return _train_and_evaluate(config, workdir, max_steps, allow_fresh_start)
  finally:
    lock.release()


def _train_and_evaluate(config, workdir: str, max_steps: Optional[int],
                        allow_fresh_start: bool):
  _check_nothing_set_aside(workdir, allow_fresh_start)
  with errors.config_errors():
    config = hub.prepare_init_from(config, workdir)  # config.init_from, if any
  objective = objectives.get(config.objective)
  is_chief = jax.process_index() == 0
  _check_drift(config, workdir, is_chief)
  with errors.config_errors():
    mesh = shd.make_mesh(config.mesh)
    shards = shd.num_batch_shards(mesh)
    if config.batch_size % shards:
      raise ValueError(f'batch_size {config.batch_size} is not divisible by '
                       f'the {shards} batch shards of mesh '
                       f'{dict(mesh.shape)}')
    objective.validate_batch(config, shards)  # before any data/tokenizer work
    evals = evaluators.build(config.get('evals'),
                             config_keys.get(config, 'eval.tfds_data_dir'))
    evaluators.check_for_training(evals)
    source, corpus = sources.train_source(config)
    if corpus is not None:
      corpus = objective.extend_corpus(corpus)
    tokenizer = setup_tokenizer(config, workdir, corpus,
                                _stored_meta(workdir))
    model_cfg = model_config_for(config, tokenizer)
    # Attention kernel for the devices the step is compiled for (the mesh),
    # never the default backend (ahead-of-time compilation targets others).
    model = ProLIP(model_cfg, attention=models.attention_impl_for(
        mesh.devices.flat, model_cfg.attention_impl))
    tx, schedule = make_optimizer(config.optim, config.total_steps)
    dataset = pipeline.train_dataset(
        source, tokenizer=tokenizer, image_size=model_cfg.vision.image_size,
        global_batch_size=config.batch_size, seed=config.seed,
        augment=augment_config(config.data),
        num_views=config_keys.get(config, 'data.num_views'),
        process_index=jax.process_index(),
        process_count=jax.process_count())
    dataset = objective.wrap_dataset(
        config, dataset, source, tokenizer, model_cfg.vision.image_size,
        jax.process_index(), jax.process_count())

    root_rng = jax.random.key(config.seed)
    init_rng, step_rng = jax.random.split(root_rng)
    with_teacher = objective.uses_teacher
    init_state, state_shardings = run_state_initializer(config, model, tx,
                                                        mesh)
    abstract = jax.eval_shape(init_state, init_rng)
  mngr = checkpoint.manager(workdir, config.keep_checkpoints,
                            save_interval_steps=1)
  try:
    restored = checkpoint.restore_newest(
        mngr, abstract.params, abstract.opt_state, abstract.teacher,
        set_aside=True)
  except checkpoint.TreeMismatchError as e:
    mngr.close()
    raise _mismatch_error(e, config) from e
  if restored is None:
    start = 0
    state = init_state(init_rng)
  else:
    start, (params, opt_state, teacher, _) = restored
    if opt_state is None:  # imported weights: fine-tune with a fresh AdamW
      opt_state = jax.jit(tx.init, out_shardings=state_shardings.opt_state)(
          params)
      logging.warning('Checkpoint %d has no optimizer state (imported '
                      'weights): starting AdamW afresh', start)
    if with_teacher and teacher is None:  # e.g. imported weights
      teacher = jax.jit(lambda p: p,
                        out_shardings=state_shardings.params)(params)
      logging.warning('Checkpoint %d has no EMA teacher: starting it from '
                      'the restored parameters', start)
    state = TrainState(jnp.asarray(start, jnp.int32), params, opt_state,
                       teacher)
    logging.info('Resumed from step %d', start)

  train_step = jit_train_step(model, config, tx, schedule, mesh,
                              tokenizer.mask_id, state_shardings)

  # Rows logged after the restored step are trained again: drop them.
  writer = progress.MetricWriter(workdir, is_chief, resume_step=start)
  meta = {'config': json.loads(config.to_json_best_effort()),
          'model': model_cfg.to_dict(),
          **checkpoint.tokenizer_meta(tokenizer)}
  stopper = progress.StopFlag()
  end = config.total_steps if max_steps is None else min(
      config.total_steps, start + max_steps)
  data_iter = pipeline.iterate_from(dataset, start, config.data.num_workers,
                                    config.data.num_threads)

  def save(step, force=False):
    if step in mngr.all_steps():
      return
    checkpoint.save(mngr, step, state.params, state.opt_state,
                    dict(meta, step=int(step)), force=force,
                    teacher=state.teacher)

  gather = jax.jit(lambda p: p, out_shardings=shd.replicated(mesh))

  def run_eval():
    # The built-in train-time eval is the held-out part of the bundled data
    # sets (digits, emoji); other data sets are evaluated with
    # `python -m prolip_jax.evaluate` on a checkpoint.
    if config.data.name not in train_time.HELDOUT:
      return {}
    progress.status(f'Evaluating on the held-out {config.data.name} set '
                    f'(step {step})', is_chief)
    # Every host evaluates the same replicated parameters on the held-out set.
    encoders = train_time.jit_encoders(objective, model,
                                       gather(state.params), config)
    size = model_cfg.vision.image_size
    results = train_time.zero_shot_heldout(encoders, tokenizer, config, size)
    results.update(objective.train_eval_metrics(encoders, tokenizer, config,
                                                size))
    return results

  def run_evaluators(final: bool) -> dict[str, float]:
    # config.evals: every host embeds its part of each set on the mesh.
    due = [e for e in evals if e.due(step, final)]
    if not due:
      return {}
    model_on_mesh = sharded_eval.from_training(objective, model, state.params,
                                               config, tokenizer, mesh)
    out_dir = (os.path.join(workdir, 'evals', f'step_{step}') if is_chief
               else '')
    results = {}
    for e in due:
      progress.status(f'Evaluator {e.name} at step {step}', is_chief)
      found = e.run(model_on_mesh, out_dir,
                    lambda line: progress.status(line, is_chief))
      progress.status(train_time.evaluator_line(e.name, found), is_chief)
      results.update({f'{e.name}/{k}': v for k, v in found.items()})
    writer.write(step, results)
    return results

  unavailable = evaluators.check_available(evals)
  if is_chief:
    print(f'prolip_jax: {config.objective} on {config.data.name}, '
          f'{jax.device_count()} device(s) mesh {dict(mesh.shape)}, '
          f'batch {config.batch_size}, steps {start} -> {end} of '
          f'{config.total_steps}, workdir {workdir}', flush=True)
    for name, reason in unavailable.items():
      print(f'Evaluator {name} will not run: {reason}', flush=True)
  step = start
  last_metrics: dict[str, float] = {}
  t_log, step_log = time.time(), step
  t_start = time.time()
  monitor = progress.NonFiniteMonitor(
      config_keys.get(config, 'max_nonfinite_steps'),
                             mngr.latest_step)
  try:
    while step < end and not stopper.stop:
      try:
        local_batch = next(data_iter)
      except records.BadRecordError:
        monitor.flush()
        save(step, force=True)  # keep the progress; the data needs fixing
        raise
      batch = shd.host_to_global(mesh, local_batch)
      first = step == start
      if first:
        progress.status('Compiling the train step (the first step includes '
                        'it)', is_chief)
      state, metrics = train_step(state, batch, step_rng)
      step += 1
      if first:
        jax.block_until_ready(metrics['loss'])
        progress.status(f'Compiled and ran step {step} in '
                        f'{progress.fmt_time(time.time() - t_start)}',
                        is_chief)
      monitor.add(step, metrics['nonfinite'])
      if step % config.log_every_steps == 0 or step == end:
        metrics = jax.device_get(metrics)
        now = time.time()
        rate = (step - step_log) * config.batch_size / max(now - t_log, 1e-9)
        last_metrics = {k: float(np.asarray(v)) for k, v in metrics.items()}
        last_metrics['samples_per_sec'] = rate
        monitor.flush()
        last_metrics['nonfinite_steps'] = monitor.total
        bad = sources.bad_record_stats(source)
        if bad is not None:
          last_metrics['data/bad_records'] = bad['bad']
          last_metrics['data/records_seen'] = bad['seen']
          last_metrics['data/bad_fraction'] = bad['bad_fraction']
        writer.write(step, last_metrics)
        if is_chief:
          print(progress.progress_line(step, config.total_steps, last_metrics,
                               (end - step) * config.batch_size /
                               max(rate, 1e-9), now - t_start), flush=True)
        t_log, step_log = time.time(), step
      elif first:  # samples/s and the ETA count from here: compiling is no step
        t_log, step_log = time.time(), step
      if step % config.checkpoint_every_steps == 0:
        monitor.flush()
        if not monitor.consecutive:  # mid-streak the state is not new
          save(step)
      if config.eval.every_steps and step % config.eval.every_steps == 0 \
          and step != end:
        writer.write(step, {f'eval/{k}': v for k, v in run_eval().items()})
      if step != end:
        run_evaluators(final=False)
    monitor.flush()
  except KeyboardInterrupt:
    logging.warning('Interrupted at step %d: saving a checkpoint', step)
    save(step, force=True)
    raise
  finally:
    mngr.wait_until_finished()
  save(step, force=True)
  mngr.wait_until_finished()
  mngr.close()
  eval_results: dict[str, float] = {}
  evals_results: dict[str, float] = {}
  if not stopper.stop:
    eval_results = run_eval()
    if step > start:  # a re-run of a finished command adds no duplicate row
      writer.write(step, {f'eval/{k}': v for k, v in eval_results.items()})
      evals_results = run_evaluators(final=True)
  writer.close()
  ckpt_path = os.path.join(checkpoint.checkpoint_dir(workdir), str(step))
  summary = {'step': step, 'checkpoint': ckpt_path, 'eval': eval_results,
             'train': last_metrics, 'preempted': stopper.stop,
             'workdir': workdir, 'batch_size': config.batch_size,
             'total_steps': config.total_steps,
             'heldout': train_time.heldout_info(config) if eval_results
                        else None,
             'evals': evals_results}
  if is_chief:
    print(train_time.format_summary(summary), flush=True)
  return summary
