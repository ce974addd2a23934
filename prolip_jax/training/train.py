"""Training: ``train_and_evaluate(config, workdir)``.

One jitted ``train_step`` (read it top to bottom: the objective's loss and
gradients, AdamW update, clamp the scale, the parameters' moving average), a
data pipeline that is exactly resumable from the step, Orbax checkpoints every
``checkpoint_every_steps`` (and on interruption), metrics to
``WORKDIR/metrics.jsonl`` and TensorBoard. Nothing here is specific to one
objective: ``objectives.get(config.objective)``, resolved once by
``train_and_evaluate`` and passed down, supplies the loss and the hooks
(``prolip_jax/objectives/base.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
import time
from typing import Any, Callable, Optional

import flax
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from prolip_jax import errors
from prolip_jax import models
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.config import keys as config_keys
from prolip_jax.data import bad_records
from prolip_jax.data import mixture
from prolip_jax.data import pipeline
from prolip_jax.data import sources
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import tokenizer_from_config
from prolip_jax.data.tokenizer import train_tokenizer
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report as eval_report
from prolip_jax.interop import hub
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.objectives.base import LossParts
from prolip_jax.objectives.base import Objective
from prolip_jax.storage import checkpoint
from prolip_jax.storage import paths
from prolip_jax.storage import store_faults
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import accumulation
from prolip_jax.training import loop_evals
from prolip_jax.training import loop_report
from prolip_jax.training import optimizer
from prolip_jax.training import progress
from prolip_jax.training import resume
from prolip_jax.training import wandb_sink
from prolip_jax.training.optimizer import freeze_patterns
from prolip_jax.training.optimizer import frozen_mask
from prolip_jax.training.optimizer import make_optimizer
from prolip_jax.training.optimizer import stop_frozen_gradients
from prolip_jax.training.workdir_lock import WorkdirLock


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


def _resolve(config, objective: Optional[Objective]) -> Objective:
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
  objective = _resolve(config, objective)
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
# Set-up helpers


def setup_tokenizer(config, workdir, corpus: Optional[Callable[[], list]],
                    stored: Optional[tuple[int, dict]] = None) -> Tokenizer:
  """The run's tokenizer, kept at ``WORKDIR/tokenizer.model``.

  A configured ``tokenizer.model_path`` (local or ``gs://``/``s3://``) is
  copied there; without one, a sentencepiece model is trained on the
  dataset's captions at first run and reused on every later run (and by
  ``prolip_jax.load``). ``stored``: ``(step, meta)`` of the checkpoint being
  resumed; a tokenizer other than the one recorded there (or a missing one)
  raises ``errors.TokenizerError`` before any tokenizer is trained.
  """
  wd = Workdir.of(workdir)
  path = wd.tokenizer
  step, meta = stored if stored is not None else (None, {})
  owner = f'checkpoint step {step} under {wd.checkpoints}'
  if (meta.get(checkpoint.TOKENIZER_SHA256) and not path.exists()
      and not config.tokenizer.model_path):
    checkpoint.check_tokenizer(meta, path, owner)  # refuses: file missing
  if config.tokenizer.model_path:
    src = paths.parse(config.tokenizer.model_path, 'tokenizer.model_path')
    if not src.is_file():
      raise FileNotFoundError(f'tokenizer file not found: {src}')
    local = paths.local_copy(src)
    # Read before it is copied: a file that is no tokenizer stays out of
    # the workdir (a corrected run would otherwise find it there).
    tokenizer = tokenizer_from_config(local, config,
                                      config.model.text.context_length)
    if jax.process_index() == 0 and not path.exists():
      paths.copy_file(src, path)
  else:
    if corpus is None and not path.exists():
      raise ValueError('tokenizer.model_path is empty and the dataset '
                       f'{config.data.name!r} has no caption corpus to train '
                       'one on')
    if jax.process_index() == 0 and not path.exists():
      sentences = corpus()
      progress.status(f'Training a sentencepiece tokenizer on '
                      f'{len(sentences):,} captions -> {path}')
      with tempfile.TemporaryDirectory(prefix='prolip_jax-') as tmp:
        trained = train_tokenizer(sentences,
                                  os.path.join(tmp, path.name),
                                  config.tokenizer.vocab_size)
        paths.copy_file(trained, path)
    tokenizer = None
  if jax.process_count() > 1:  # the other hosts wait for process 0's file
    multihost_utils.sync_global_devices('prolip_jax tokenizer')
  if tokenizer is None:
    tokenizer = tokenizer_from_config(paths.local_copy(path), config,
                                      config.model.text.context_length)
  used = src if config.tokenizer.model_path else path
  checkpoint.check_tokenizer(meta, used, owner, sha256=tokenizer.sha256)
  return tokenizer


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


def _check_freeze(config, objective: Objective):
  """``ConfigError`` for an ``optim.freeze`` that is no sequence of regular
  expressions, or holds one that matches none of the run's parameter paths
  (on ``jax.eval_shape``'d parameters: nothing is computed)."""
  patterns = freeze_patterns(config.optim)
  if not patterns:
    return
  model_cfg = ModelConfig.from_config(config.model)

  def init(rng):
    params = models.init_params(model_cfg, rng)
    extra = objective.init_extra_params(config, model_cfg, rng)
    return dict(params, **extra) if extra else params

  frozen_mask(jax.eval_shape(init, jax.random.key(0)), patterns)


def validate_config(config, objective: Optional[Objective] = None):
  """Raises ``ValueError`` for a config that cannot train (the generic
  checks, then the objective's own)."""
  objective = _resolve(config, objective)
  config_keys.check_values(config)  # counts, sizes, intervals: >= minimum
  evaluator.entries(config.get('evals'))  # kinds, keys, batch, interval
  wanted, present = int(config.mesh.get('num_devices', 0) or 0), (
      jax.device_count())
  if wanted > present:
    raise ValueError(f'mesh.num_devices={wanted} but {present} '
                     f'{jax.default_backend()} device(s) are present '
                     '(0: use them all)')
  if not 0 < config.masking.image_keep_ratio <= 1:
    raise ValueError('masking.image_keep_ratio must be in (0, 1]')
  _check_freeze(config, objective)  # optim.freeze: patterns that match
  loop_report.check_config(config)  # profile_steps, wandb.*
  objective.validate(config)


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
  objective = _resolve(config, objective)
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


def train_and_evaluate(config: ml_collections.ConfigDict, workdir,
                       max_steps: Optional[int] = None,
                       allow_fresh_start: bool = False) -> dict[str, Any]:
  """Trains (resuming from the newest readable checkpoint) and evaluates.

  Holds ``WORKDIR/.lock`` while it runs (a second run on the workdir stops
  with ``WorkdirLockedError``). User mistakes (config, files, drift from the
  stored run, divergence) raise ``errors.UserError`` subclasses.

  Args:
    config: a run config (see ``configs/``).
    workdir: checkpoints, tokenizer, metrics and TensorBoard files go here:
      a local folder, ``gs://BUCKET/...`` or ``s3://BUCKET/...`` (a
      ``Workdir`` or its text; another URL is a ``UserError``).
    max_steps: stop after this many steps in this call (the schedule still
      spans ``config.total_steps``); for tests of interruption and resume.
    allow_fresh_start: train from step 0 even though ``checkpoints/`` is
      empty and ``checkpoints_unreadable/`` holds steps set aside by an
      earlier run (refused otherwise: ``CheckpointError``).

  Returns:
    A summary dict: ``step``, ``checkpoint`` (path), final ``eval`` metrics,
    the last training metrics, ``preempted`` (stopped by SIGTERM; in a
    multi-host run by a notice on any host, every host after the same step)
    and ``interrupted`` (a Ctrl-C on this host of several asked for that
    stop).
  """
  with errors.config_errors():
    objective = objectives.get(config.objective)  # the run's, passed down
    validate_config(config, objective)
  workdir = Workdir.of(workdir)  # every file of the run, local or gs://
  workdir.check_checkpoint_store()
  # SIGTERM and Ctrl-C from here on: a stop at a step boundary in the loop,
  # a one-line exit between set-up phases before it (progress.StopFlag).
  stopper = progress.StopFlag()
  try:
    stopper.check('start-up', resumed=workdir.has_checkpoints)
    workdir.create()
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
      return _train_and_evaluate(config, objective, workdir, stopper,
                                 max_steps, allow_fresh_start, lock)
    except errors.StoreError:
      lock.release(patience_s=STORE_FAILED_RELEASE_S)  # the store may be gone
      raise
    finally:
      lock.release()
  finally:
    stopper.close()


# The checkpoint meta key of a mixture's weight history
# (mixture.history_meta): a resume continues it.
MIXTURE_META = 'data_mixture'


@dataclasses.dataclass
class _Run:
  """What ``_build`` makes of a config before any state exists."""
  mesh: Any
  source: Any
  tokenizer: Tokenizer
  model: ProLIP
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  dataset: Any
  init_state: Callable
  state_shardings: Any
  abstract: Any  # the TrainState's shapes, dtypes and shardings
  init_rng: jax.Array
  step_rng: jax.Array


def _train_dataset(config, objective, source, tokenizer: Tokenizer,
                   image_size: int):
  """The run's dataset of local batches (``pipeline.train_dataset``, then
  the objective's ``wrap_dataset``)."""
  dataset = pipeline.train_dataset(
      source, tokenizer=tokenizer, image_size=image_size,
      global_batch_size=config.batch_size, seed=config.seed,
      augment=augment_config(config.data),
      num_views=config_keys.get(config, 'data.num_views'),
      process_index=jax.process_index(),
      process_count=jax.process_count())
  return objective.wrap_dataset(
      config, dataset, source, tokenizer, image_size,
      jax.process_index(), jax.process_count())


def _continue_mixture(config, objective, run: _Run, mngr, start: int):
  """A mixture resumed at ``start``: its mixing history from the restored
  checkpoint, plus the new weights from this step when they changed (each
  source continues where it stopped; one line says so). Rebuilds
  ``run.dataset`` when the history is not the config's weights alone."""
  if not isinstance(run.source, mixture.Mixture) or not start:
    return
  stored = checkpoint.read_meta(mngr, start).get(MIXTURE_META)
  records = start * config.batch_size
  history = mixture.continue_history(stored, run.source.labels,
                                     run.source.weights, records)
  if history == run.source.segments():
    return
  run.source = dataclasses.replace(run.source, history=history)
  run.dataset = _train_dataset(config, objective, run.source, run.tokenizer,
                               run.model.config.vision.image_size)
  if history[-1][0] == records and jax.process_index() == 0:
    drawn = mixture.drawn_so_far(run.source, records)
    print(f'Mixture from step {start} (record {records}): '
          f'{mixture.describe(config.data.sources)}; each source continues '
          'where it stopped (records drawn so far: '
          + ', '.join(f'{label} {n}' for label, n in
                      zip(run.source.labels, drawn)) + ')', flush=True)


def _build(config, workdir: Workdir, objective) -> _Run:
  """The mesh, evaluators, data, tokenizer, model, optimizer and state
  initializer of a run (``ValueError`` for a config that cannot run)."""
  mesh = shd.make_mesh(config.mesh)
  shards = shd.num_batch_shards(mesh)
  if config.batch_size % shards:
    raise ValueError(f'batch_size {config.batch_size} is not divisible by '
                     f'the {shards} batch shards of mesh '
                     f'{dict(mesh.shape)}')
  objective.validate_batch(config, shards)  # before any data/tokenizer work
  source, corpus = sources.train_source(config)
  if corpus is not None:
    corpus = objective.extend_corpus(corpus)
  tokenizer = setup_tokenizer(config, workdir, corpus,
                              resume.stored_meta(workdir))
  model_cfg = model_config_for(config, tokenizer)
  # Attention kernel for the devices the step is compiled for (the mesh),
  # never the default backend (ahead-of-time compilation targets others).
  model = ProLIP(model_cfg, attention=models.attention_impl_for(
      mesh.devices.flat, model_cfg.attention_impl))
  tx, schedule = make_optimizer(config.optim, config.total_steps)
  dataset = _train_dataset(config, objective, source, tokenizer,
                           model_cfg.vision.image_size)

  init_rng, step_rng = jax.random.split(jax.random.key(config.seed))
  init_state, state_shardings = run_state_initializer(config, model, tx,
                                                      mesh, objective)
  return _Run(mesh, source, tokenizer, model, tx, schedule, dataset,
              init_state, state_shardings,
              jax.eval_shape(init_state, init_rng), init_rng, step_rng)


def _metrics_row(metrics: dict, rate: float, nonfinite_total: int,
                 source, records: int = 0) -> dict[str, float]:
  """A ``metrics.jsonl`` row: the step's metrics (host values), samples/s,
  the count of skipped non-finite steps and the bad-record counters of
  ``source`` (when it checks its records); for a mixture (``data.sources``)
  also each source's counts after ``records`` records of the global stream
  (``mixture.metrics_row``)."""
  row = {k: float(np.asarray(v)) for k, v in metrics.items()}
  row['samples_per_sec'] = rate
  row['nonfinite_steps'] = nonfinite_total
  bad = sources.bad_record_stats(source)
  if bad is not None:
    row['data/bad_records'] = bad['bad']
    row['data/records_seen'] = bad['seen']
    row['data/bad_fraction'] = bad['bad_fraction']
  if isinstance(source, mixture.Mixture):
    row.update(mixture.metrics_row(source, records))
  return row


def _log_row(config, step: int, end: int, metrics: dict,
             nonfinite_total: int, source, report, writer,
             times: tuple[float, int, float]) -> dict[str, float]:
  """Writes the ``metrics.jsonl`` row of ``step`` (``_metrics_row`` and the
  loop report's interval figures) and prints the progress line (process
  0); ``times`` is (when the interval began, its first step, when the run
  began). Returns the row."""
  t_log, step_log, t_start = times
  metrics = jax.device_get(metrics)
  now = time.time()
  rate = (step - step_log) * config.batch_size / max(now - t_log, 1e-9)
  row = _metrics_row(metrics, rate, nonfinite_total, source,
                     step * config.batch_size)
  row.update(report.end_interval(step))
  writer.write(step, row)
  if jax.process_index() == 0:
    print(progress.progress_line(
        step, config.total_steps, row,
        (end - step) * config.batch_size / max(rate, 1e-9), now - t_start),
          flush=True)
  return row


def _next_batch(data_iter, mesh, report, monitor, save_progress):
  """The next global batch; a bad record (``BadRecordError``) saves
  the progress first when this is the only process (with several, the
  others are mid-step) and is raised: the data needs fixing."""
  try:
    local_batch = report.data(next, data_iter)
  except bad_records.BadRecordError:
    monitor.flush()
    if jax.process_count() == 1:
      save_progress()
    raise
  return report.data(shd.host_to_global, mesh, local_batch)


def _compiled(step: int, metrics: dict, t_start: float, report):
  """After the first step (which compiled the step): one line on its time;
  the loop report's interval starts here (compiling is no step)."""
  jax.block_until_ready(metrics['loss'])
  progress.status(f'Compiled and ran step {step} in '
                  f'{progress.fmt_time(time.time() - t_start)}',
                  jax.process_index() == 0)
  report.start_interval(step)


def _checkpoint_meta(config, model, tokenizer, objective: Objective,
                     source=None) -> dict:
  """What every checkpoint stores beside the arrays: the run's config, the
  model's and the tokenizer's, which of its parameter trees is the model to
  score (``checkpoint.SCORED``) and a mixture's weight history
  (``MIXTURE_META``)."""
  scored = 'teacher' if optimizer.evaluates_ema(config, objective) else (
      'params')
  meta = {'config': json.loads(config.to_json_best_effort()),
          'model': model.config.to_dict(), checkpoint.SCORED: scored,
          **checkpoint.tokenizer_meta(tokenizer)}
  if isinstance(source, mixture.Mixture):
    meta[MIXTURE_META] = mixture.history_meta(source)
  return meta


def _save(mngr, meta: dict, state, step: int, force: bool = False) -> bool:
  """Starts saving ``state`` as the checkpoint of ``step`` (none when it
  exists); returns whether a save started."""
  if step in mngr.all_steps():
    return False
  return checkpoint.save(mngr, step, state.params, state.opt_state,
                         dict(meta, step=int(step)), force=force,
                         teacher=state.ema)


def _injected_fault(config, step: int):
  """Fault injection for tests (``debug_raise_at_step``,
  ``debug_raise_process``): a RuntimeError after ``step`` on the chosen
  process, as an out-of-memory error or a failing evaluator would raise."""
  at = config_keys.get(config, 'debug_raise_at_step')
  who = config_keys.get(config, 'debug_raise_process')
  if at and step == at and who in (-1, jax.process_index()):
    raise RuntimeError(f'fault injected after step {step} '
                       '(config.debug_raise_at_step)')


def _note_removals(config, steps: list[int], is_chief: bool):
  """One line when ``keep_checkpoints`` (a key that ``removes`` data) will
  delete more than the usual oldest checkpoint at the next save: it was
  lowered since those checkpoints were written. Nothing is deleted before a
  newer checkpoint is committed (Orbax deletes after the save)."""
  keep = config.keep_checkpoints
  if not is_chief or keep is None or len(steps) <= keep:  # None: keep all
    return
  gone = sorted(steps)[:len(steps) - keep + 1]
  print(f'note: keep_checkpoints={keep} deletes '
        f'{config_keys.KEYS["keep_checkpoints"].removes}: checkpoint(s) of '
        f'step {", ".join(map(str, gone))} will be deleted once the next '
        'checkpoint is saved', flush=True)


def _missing_evaluations(workdir: Workdir, evaluations, step: int,
                         final: bool) -> list[str]:
  """The evaluators an uninterrupted run writes at ``step`` (``final``: the
  last) that ``metrics.jsonl`` does not hold (a kill or a stop came first).
  Read by process 0 and sent to every process, which all run them (they
  are collectives)."""
  logged = progress.logged_keys(workdir.metrics, step) if (
      jax.process_index() == 0) else set()
  due = evaluations.due(step, final)
  missing = [not any(k.startswith(name + '/') for k in logged)
             for name in due]
  if jax.process_count() > 1 and due:
    flags = multihost_utils.broadcast_one_to_all(
        np.asarray(missing, np.int32))
    missing = [bool(f) for f in flags]
  return [name for name, m in zip(due, missing) if m]


def _final_evaluations(workdir: Workdir, evaluations, state, step: int,
                       stopped: bool) -> tuple[dict, Optional[dict]]:
  """The final evaluations a previous run did not write (a re-run of a
  finished command writes none again; the held-out figures are computed
  for the summary all the same). Returns the other evaluators' results
  and the held-out evaluation's (``LoopEvaluations.heldout_info``); none
  after a stop (``stopped``: they are left to the resumed run; a signal
  from here on changes nothing, and a stop cut short in them leaves them
  missing for the next run)."""
  if stopped:
    return {}, None
  missing = _missing_evaluations(workdir, evaluations, step, final=True)
  heldout = evaluations.heldout_names()
  names = [n for n in evaluations.due(step, True)
           if n in missing or n in heldout]
  results = evaluations.run(state, step, True, only=names,
                            write=set(missing))
  return ({k: v for k, v in results.items()
           if k.partition('/')[0] not in heldout},
          evaluations.heldout_info(results))


def _restore(config, objective: Objective, workdir: Workdir,
             stopper: progress.StopFlag, allow_fresh_start: bool):
  """The run of ``config`` (``_Run``), its checkpoint manager, the step it
  starts from and its state (the newest readable checkpoint's, or a fresh
  one), after the checks that refuse a workdir or config before any work;
  ``config`` with ``init_from`` applied."""
  resume.check_nothing_set_aside(workdir, allow_fresh_start)
  with errors.config_errors():
    config = hub.prepare_init_from(config, workdir)  # config.init_from, if any
  resume.check_drift(config, workdir, jax.process_index() == 0)
  with errors.config_errors():
    run = _build(config, workdir, objective)
  stopper.check('the tokenizer and the data pipeline',
                resumed=workdir.has_checkpoints)
  mngr = checkpoint.manager(workdir, config.keep_checkpoints,
                            save_interval_steps=1)
  _note_removals(config, list(mngr.all_steps()), jax.process_index() == 0)
  start, state = resume.restore_or_init(
      mngr, config, run.init_state, run.init_rng, run.abstract, run.tx,
      run.state_shardings, optimizer.keeps_ema(config))
  with errors.config_errors():
    _continue_mixture(config, objective, run, mngr, start)
  stopper.check(f'restoring step {start}' if start else 'initialising',
                resumed=lambda: start > 0)
  return config, run, mngr, start, state


def _announce(config, mesh, workdir: Workdir, start: int, end: int,
              unavailable: dict[str, str]):
  """The run's first line (objective, data, devices, steps) and one line
  per evaluator that will not run (process 0)."""
  if jax.process_index() != 0:
    return
  mixed = config_keys.get(config, 'data.sources')
  data = mixture.describe(mixed) if mixed else config.data.name
  print(f'prolip_jax: {config.objective} on {data}, '
        f'{mesh.devices.size} device(s) mesh {dict(mesh.shape)}, '
        f'batch {config.batch_size}, steps {start} -> {end} of '
        f'{config.total_steps}, workdir {workdir}', flush=True)
  for name, reason in unavailable.items():
    print(f'Evaluator {name} will not run: {reason}', flush=True)


# After the store failed, how long the lock's release may try it.
STORE_FAILED_RELEASE_S = 5.0


def _train_and_evaluate(config, objective: Objective, workdir: Workdir,
                        stopper: progress.StopFlag, max_steps: Optional[int],
                        allow_fresh_start: bool, lock: WorkdirLock):
  config, run, mngr, start, state = _restore(config, objective, workdir,
                                             stopper, allow_fresh_start)
  is_chief = jax.process_index() == 0
  mesh, model, tokenizer = run.mesh, run.model, run.tokenizer
  train_step = jit_train_step(model, config, run.tx, run.schedule, mesh,
                              tokenizer.mask_id, run.state_shardings,
                              objective)

  # Rows logged after the restored step are trained again: drop them.
  writer = progress.MetricWriter(workdir, is_chief, resume_step=start)
  writer = wandb_sink.tee(writer, config, workdir, is_chief, start)  # + W&B
  meta = _checkpoint_meta(config, model, tokenizer, objective, run.source)
  end = config.total_steps if max_steps is None else min(
      config.total_steps, start + max_steps)
  data_iter = pipeline.iterate_from(run.dataset, start,
                                    config.data.num_workers,
                                    config.data.num_threads)

  # A failed save stops the run at the next step (storage/store_faults.py).
  watch = store_faults.SaveWatch(mngr, mngr.latest_step())
  stopper.kept = watch.kept
  save = lambda step, force=False: watch.save(
      step, lambda: _save(mngr, meta, state, step, force))

  evaluations = loop_evals.LoopEvaluations(
      objective, model, config, tokenizer, mesh, writer, workdir, is_chief,
      status=lambda line: progress.status(line, is_chief))
  _announce(config, mesh, workdir, start, end, evaluations.check_available())
  step = start
  last_metrics: dict[str, float] = {}
  t_start = t_log = time.time()
  step_log = step
  monitor = progress.NonFiniteMonitor(
      config_keys.get(config, 'max_nonfinite_steps'), mngr.latest_step)
  # Data wait / device split, MFU, profile_steps (training/loop_report.py).
  report = loop_report.LoopReport(
      config, objective, list(mesh.devices.flat), model.config.to_dict(), start, end,
      is_chief, monitor.flush, workdir.tensorboard)
  stopped = lambda: stopper.stop
  failed = True  # until the loop ends without an exception ('store': its)
  try:
    if 0 < start < end:  # evaluations a kill or a stop cut short at start
      names = _missing_evaluations(workdir, evaluations, start, final=False)
      if names:
        report.excluded(evaluations.run, state, start, False, names, stopped)
    while step < end and not stopper.stop:
      batch = _next_batch(data_iter, mesh, report, monitor,
                          lambda: save(step, force=True))
      first = step == start
      if first:
        progress.status('Compiling the train step (the first step '
                        'includes it)', is_chief)
      report.before_step(step)
      state, metrics = train_step(state, batch, run.step_rng)
      step += 1
      report.after_step(step, metrics)
      if first:
        _compiled(step, metrics, t_start, report)
      monitor.add(step, metrics['nonfinite'])
      if step % config.log_every_steps == 0 or step == end:
        monitor.flush()
        last_metrics = _log_row(config, step, end, metrics, monitor.total,
                                run.source, report, writer,
                                (t_log, step_log, t_start))
        t_log, step_log = time.time(), step
        report.start_interval(step)
      elif first:  # samples/s and the ETA count from here, not compiling
        t_log, step_log = time.time(), step
      if step % config.checkpoint_every_steps == 0 and monitor.flushed_ok():
        report.excluded(save, step)
      # A stop leaves the step's evaluations to the resumed run (missing
      # from metrics.jsonl at the step it restarts from).
      if step != end:
        report.excluded(evaluations.run, state, step, False, None, stopped)
      _injected_fault(config, step)
      watch.check()  # a save that failed since the last step
      lock.check()  # the workdir lock's heartbeat
      stopper.at_step(step)  # every host stops after the same step
    monitor.flush()
    failed = False
  except errors.StoreError:
    failed = 'store'  # no host waits for a save on a failing store
    raise
  finally:
    report.close()  # a profile still running
    # A host that failed alone must not wait for a checkpoint: saving is
    # a collective of every host, and the others are elsewhere.
    if not failed or (jax.process_count() == 1 and failed is True):
      watch.finish()
  _last_save(save, watch, mngr, stopper, (start, step, end))
  evals_results, heldout = _final_evaluations(workdir, evaluations, state,
                                              step, stopper.stop)
  writer.close()
  return _summary(config, workdir, step, stopper, last_metrics, heldout,
                  evals_results)


def _last_save(save, watch, mngr, stopper, steps: tuple[int, int, int]):
  """The checkpoint of the step the loop ended after (its end or a stop),
  waited for; ``steps``: (start, that step, end). A stop before the first
  step has nothing new to save and ends here (``StopFlag.check``)."""
  start, step, end = steps
  if step > start:
    save(step, force=True)
  watch.finish()
  mngr.close()
  if step == start < end:
    stopper.check('compiling', resumed=lambda: start > 0)


def _summary(config, workdir: Workdir, step: int, stopper, last_metrics,
             heldout: Optional[dict], evals_results: dict) -> dict:
  """What ``train_and_evaluate`` returns, printed by process 0
  (``report.format_summary``)."""
  stopped_at = stopper.stop
  summary = {'step': step, 'checkpoint': str(workdir.checkpoint(step)),
             'eval': heldout['metrics'] if heldout else {},
             'train': last_metrics, 'preempted': stopped_at,
             'interrupted': stopped_at and stopper.interrupted,
             'workdir': str(workdir), 'batch_size': config.batch_size,
             'total_steps': config.total_steps, 'heldout': heldout,
             'evals': evals_results}
  if jax.process_index() == 0:
    print(eval_report.format_summary(summary), flush=True)
  return summary
