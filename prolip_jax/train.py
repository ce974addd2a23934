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
import shutil
import signal
import sys
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

from prolip_jax import checkpoint
from prolip_jax import hub
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.data import pipeline
from prolip_jax.data import records
from prolip_jax.data import sources
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import train_tokenizer
from prolip_jax.evaluation import train_time
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP


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
  nor the scalars a and b (everything with fewer than two dimensions)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(optim, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(optim, total_steps)
  tx = optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                   weight_decay=optim.weight_decay, mask=weight_decay_mask)
  if optim.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(optim.grad_clip), tx)
  return tx, schedule


# ----------------------------------------------------------------------------
# The train step


def make_train_step(model: ProLIP, config: ml_collections.ConfigDict,
                    tx: optax.GradientTransformation, schedule: optax.Schedule,
                    mesh, mask_id: int) -> Callable:
  """``train_step(state, batch, rng) -> (state, metrics)``, not yet jitted."""
  objective = objectives.get(config.objective)
  loss_fn = objective.make_loss_fn(model, config, mesh, mask_id)
  max_log_scale = math.log(config.optim.max_logit_scale)

  def train_step(state: TrainState, batch, rng):
    rng = jax.random.fold_in(rng, state.step)
    grads, metrics = jax.grad(loss_fn, has_aux=True)(
        state.params, state.teacher, batch, rng)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # As in the release: keep the temperature a = exp(log a) within [1, 100].
    params = dict(params, logit_scale=jnp.clip(params['logit_scale'], 0.0,
                                               max_log_scale))
    teacher = objective.update_teacher(config, state.teacher, params)
    metrics['grad_norm'] = optax.tree.norm(grads)
    metrics['lr'] = schedule(state.step)
    return TrainState(state.step + 1, params, opt_state, teacher), metrics

  return train_step


# ----------------------------------------------------------------------------
# Set-up helpers


def setup_tokenizer(config, workdir: str, corpus: Optional[Callable[[], list]]
                    ) -> Tokenizer:
  """The run's tokenizer, kept at ``WORKDIR/tokenizer.model``.

  A configured ``tokenizer.model_path`` is copied there; without one, a
  sentencepiece model is trained on the dataset's captions at first run and
  reused on every later run (and by ``prolip_jax.load``).
  """
  path = os.path.join(workdir, checkpoint.TOKENIZER_FILE)
  if config.tokenizer.model_path:
    if jax.process_index() == 0 and not os.path.exists(path):
      shutil.copyfile(config.tokenizer.model_path, path)
    src = config.tokenizer.model_path
  else:
    if corpus is None and not os.path.exists(path):
      raise ValueError('tokenizer.model_path is empty and the dataset '
                       f'{config.data.name!r} has no caption corpus to train '
                       'one on')
    if jax.process_index() == 0 and not os.path.exists(path):
      logging.info('Training a sentencepiece tokenizer -> %s', path)
      train_tokenizer(corpus(), path, config.tokenizer.vocab_size)
    src = path
  if jax.process_count() > 1:  # the other hosts wait for process 0's file
    multihost_utils.sync_global_devices('prolip_jax tokenizer')
  pad = config.tokenizer.pad_id
  mask = config.tokenizer.mask_id
  return Tokenizer(src, config.model.text.context_length,
                   pad_id=None if pad < 0 else pad,
                   mask_id=None if mask < 0 else mask,
                   clean=config.tokenizer.get('clean', 'none'),
                   keep_eos=config.tokenizer.get('keep_eos', False))


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
      jitter_prob=data.jitter_prob, grayscale_prob=data.grayscale_prob)


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
                            extra_params: Optional[Callable] = None
                            ) -> tuple[Callable, TrainState]:
  """A jitted ``rng -> TrainState`` creating every array with its sharding.

  Parameters and optimizer state follow the FSDP rule of ``sharding.py``; no
  device ever holds an unsharded copy. Also returns the state's shardings.
  ``with_teacher``: add an EMA teacher (OTTER) starting equal to the student.
  ``extra_params(rng) -> {key: subtree}`` adds an objective's own parameters
  (``Objective.init_extra_params``, e.g. UniCLIP's heads) next to the
  model's, to be trained and saved with them.
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
  param_shardings = shd.param_shardings(mesh, abstract.params)
  shardings = TrainState(shd.replicated(mesh), param_shardings,
                         shd.param_shardings(mesh, abstract.opt_state),
                         param_shardings if with_teacher else None)
  return jax.jit(init_state, out_shardings=shardings), shardings


class MetricWriter:
  """One JSON object per line in ``metrics.jsonl`` plus TensorBoard scalars."""

  def __init__(self, workdir: str, enabled: bool):
    self.enabled = enabled
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.tb = None
    if enabled:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
        self.tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
      except ImportError:  # TensorBoard output is a convenience
        logging.warning('tensorboardX missing: no TensorBoard event files')

  def write(self, step: int, scalars: dict[str, float]):
    if not self.enabled:
      return
    row = {'step': int(step)}
    row.update({k: float(v) for k, v in scalars.items()})
    with open(self.path, 'a') as f:
      f.write(json.dumps(row) + '\n')
    if self.tb is not None:
      for k, v in scalars.items():
        self.tb.add_scalar(k, float(v), int(step))
      self.tb.flush()

  def close(self):
    if self.tb is not None:
      self.tb.close()


class _StopFlag:
  """Turns SIGTERM into a checkpoint-then-exit at the next step boundary."""

  def __init__(self):
    self.stop = False
    try:
      signal.signal(signal.SIGTERM, self._handler)
    except ValueError:  # not in the main thread
      pass

  def _handler(self, signum, frame):
    del signum, frame
    self.stop = True


def _fmt_time(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f'{h:d}:{m:02d}:{s:02d}'


# ----------------------------------------------------------------------------
# The loop


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       max_steps: Optional[int] = None) -> dict[str, Any]:
  """Trains (resuming from the latest checkpoint) and evaluates.

  Args:
    config: a run config (see ``configs/``).
    workdir: checkpoints, tokenizer, metrics and TensorBoard files go here.
    max_steps: stop after this many steps in this call (the schedule still
      spans ``config.total_steps``); for tests of interruption and resume.

  Returns:
    A summary dict: ``step``, ``checkpoint`` (path), final ``eval`` metrics
    and the last training metrics.
  """
  validate_config(config)
  objective = objectives.get(config.objective)
  workdir = os.path.abspath(workdir)
  config = hub.prepare_init_from(config, workdir)  # config.init_from, if any
  os.makedirs(workdir, exist_ok=True)
  is_chief = jax.process_index() == 0
  mesh = shd.make_mesh(config.mesh)
  shards = shd.num_batch_shards(mesh)
  if config.batch_size % shards:
    raise ValueError(f'batch_size {config.batch_size} is not divisible by the '
                     f'{shards} batch shards of mesh {dict(mesh.shape)}')

  source, corpus = sources.train_source(config)
  if corpus is not None:
    corpus = objective.extend_corpus(corpus)
  tokenizer = setup_tokenizer(config, workdir, corpus)
  model_cfg = model_config_for(config, tokenizer)
  model = ProLIP(model_cfg)
  tx, schedule = make_optimizer(config.optim, config.total_steps)
  dataset = pipeline.train_dataset(
      source, tokenizer=tokenizer, image_size=model_cfg.vision.image_size,
      global_batch_size=config.batch_size, seed=config.seed,
      augment=augment_config(config.data),
      num_views=config.data.get('num_views', 1),
      process_index=jax.process_index(), process_count=jax.process_count())
  dataset = objective.wrap_dataset(
      config, dataset, source, tokenizer, model_cfg.vision.image_size,
      jax.process_index(), jax.process_count())

  root_rng = jax.random.key(config.seed)
  init_rng, step_rng = jax.random.split(root_rng)
  with_teacher = objective.uses_teacher
  init_state, state_shardings = train_state_initializer(
      model, tx, mesh, with_teacher=with_teacher,
      extra_params=lambda rng: objective.init_extra_params(config, model_cfg,
                                                           rng))
  mngr = checkpoint.manager(workdir, config.keep_checkpoints,
                            save_interval_steps=1)
  start = mngr.latest_step()
  if start is None:
    state = init_state(init_rng)
  else:
    abstract = jax.eval_shape(init_state, init_rng)
    params, opt_state, teacher, _ = checkpoint.restore(
        mngr, start, abstract.params, abstract.opt_state, abstract.teacher)
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
  start = start or 0

  train_step = jax.jit(
      make_train_step(model, config, tx, schedule, mesh, tokenizer.mask_id),
      in_shardings=(state_shardings, shd.batch_sharding(mesh),
                    shd.replicated(mesh)),
      out_shardings=(state_shardings, shd.replicated(mesh)),
      donate_argnums=(0,))

  writer = MetricWriter(workdir, is_chief)
  meta = {'config': json.loads(config.to_json_best_effort()),
          'model': model_cfg.to_dict()}
  stopper = _StopFlag()
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

  def run_eval(step):
    # The built-in train-time eval is the held-out digits; other data sets are
    # evaluated with `python -m prolip_jax.evaluate` on a checkpoint.
    if config.data.name != 'digits':
      return {}
    # Every host evaluates the same replicated parameters on the held-out set.
    encoders = train_time.jit_encoders(objective, model,
                                       gather(state.params), config)
    size = model_cfg.vision.image_size
    results = train_time.zero_shot_digits(encoders, tokenizer, config, size)
    results.update(objective.train_eval_metrics(encoders, tokenizer, config,
                                                size))
    writer.write(step, {f'eval/{k}': v for k, v in results.items()})
    return results

  if is_chief:
    print(f'prolip_jax: {config.objective} on {config.data.name}, '
          f'{jax.device_count()} device(s) mesh {dict(mesh.shape)}, '
          f'batch {config.batch_size}, steps {start} -> {end} of '
          f'{config.total_steps}, workdir {workdir}', flush=True)
  step = start
  last_metrics: dict[str, float] = {}
  t_log, step_log = time.time(), step
  t_start = time.time()
  eval_results: dict[str, float] = {}
  try:
    while step < end and not stopper.stop:
      try:
        local_batch = next(data_iter)
      except records.BadRecordError:
        save(step, force=True)  # keep the progress; the data needs fixing
        mngr.wait_until_finished()
        raise
      batch = shd.host_to_global(mesh, local_batch)
      state, metrics = train_step(state, batch, step_rng)
      step += 1
      if step % config.log_every_steps == 0 or step == end:
        metrics = jax.device_get(metrics)
        now = time.time()
        rate = (step - step_log) * config.batch_size / max(now - t_log, 1e-9)
        last_metrics = {k: float(np.asarray(v)) for k, v in metrics.items()}
        last_metrics['samples_per_sec'] = rate
        bad = sources.bad_record_stats(source)
        if bad is not None:
          last_metrics['data/bad_records'] = bad['bad']
          last_metrics['data/records_seen'] = bad['seen']
          last_metrics['data/bad_fraction'] = bad['bad_fraction']
        writer.write(step, last_metrics)
        if is_chief:
          eta = (end - step) * config.batch_size / max(rate, 1e-9)
          extra = ''
          if 'sigma2_img' in last_metrics:
            extra = (f" s2_img {last_metrics['sigma2_img']:.2e} s2_txt "
                     f"{last_metrics['sigma2_txt']:.2e}")
          print(f'[{step}/{config.total_steps}] loss '
                f"{last_metrics['loss']:.4f} a {last_metrics['scale']:.2f} "
                f"b {last_metrics['bias']:.2f}{extra} lr "
                f"{last_metrics['lr']:.2e} {rate:.0f} samples/s, ETA "
                f'{_fmt_time(eta)} (elapsed {_fmt_time(now - t_start)})',
                flush=True)
        if not np.isfinite(last_metrics['loss']):
          raise FloatingPointError(f'loss is {last_metrics["loss"]} at step '
                                   f'{step}; last good checkpoint kept')
        t_log, step_log = time.time(), step
      if step % config.checkpoint_every_steps == 0:
        save(step)
      if config.eval.every_steps and step % config.eval.every_steps == 0 \
          and step != end:
        run_eval(step)
  except KeyboardInterrupt:
    logging.warning('Interrupted at step %d: saving a checkpoint', step)
    save(step, force=True)
    mngr.wait_until_finished()
    raise
  save(step, force=True)
  mngr.wait_until_finished()
  mngr.close()
  if not stopper.stop:
    eval_results = run_eval(step)
  writer.close()
  ckpt_path = os.path.join(checkpoint.checkpoint_dir(workdir), str(step))
  summary = {'step': step, 'checkpoint': ckpt_path, 'eval': eval_results,
             'train': last_metrics}
  if is_chief:
    print(train_time.format_summary(summary), flush=True)
  if stopper.stop:
    print(f'Stopped by SIGTERM at step {step}; resume with the same command.',
          file=sys.stderr)
  return summary
