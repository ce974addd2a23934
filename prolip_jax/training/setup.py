"""A run's set-up and resume: everything before its first step.

``restore`` opens the run's checkpoint manager once and reads the workdir's
stored state through it (``storage/stored_state.py``); then, in order, the
refusals that change nothing on disk (checkpoints set aside, drift from the
stored run), ``init_from``, the tokenizer, the model config, the data, the
optimizer and the state initializer (``Run``), the restore of the newest
readable checkpoint (or a fresh state) and a mixture's continuation.
``announce`` prints the run's first line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any, Callable, Optional

import jax
from jax.experimental import multihost_utils
import optax

from prolip_jax import errors
from prolip_jax import models
from prolip_jax import sharding as shd
from prolip_jax.config import keys as config_keys
from prolip_jax.data import dali_decode
from prolip_jax.data import mixture
from prolip_jax.data import pipeline
from prolip_jax.data import sources
from prolip_jax.data import transforms
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import tokenizer_from_config
from prolip_jax.data.tokenizer import train_tokenizer
from prolip_jax.evaluation import evaluator
from prolip_jax.interop import hub
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.objectives.base import Objective
from prolip_jax.storage import checkpoint
from prolip_jax.storage import paths
from prolip_jax.storage.stored_state import StoredState
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import loop_report
from prolip_jax.training import optimizer
from prolip_jax.training import progress
from prolip_jax.training import resume
from prolip_jax.training.optimizer import freeze_patterns
from prolip_jax.training.optimizer import frozen_mask
from prolip_jax.training.optimizer import make_optimizer
from prolip_jax.training.step import resolve_objective
from prolip_jax.training.step import run_state_initializer


# ----------------------------------------------------------------------------
# The config, the tokenizer and the model config


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
  """The training augmentation of the ``data`` config."""
  return transforms.AugmentConfig(
      crop_scale=tuple(data.crop_scale), jitter=tuple(data.jitter),
      jitter_prob=data.jitter_prob, grayscale_prob=data.grayscale_prob,
      color_on_device=bool(data.get(
          'color_on_device', config_keys.default('data.color_on_device')))
      # DALI's path leaves the jitter to the device (data/dali_decode.py).
      or data.get('decode') == dali_decode.DALI)


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
  objective = resolve_objective(config, objective)
  config_keys.check_values(config)  # counts >= minimum, numbers in range
  evaluator.entries(config.get('evals'))  # kinds, keys, batch, interval
  wanted, present = int(config.mesh.get('num_devices', 0) or 0), (
      jax.device_count())
  if wanted > present:
    raise ValueError(f'mesh.num_devices={wanted} but {present} '
                     f'{jax.default_backend()} device(s) are present '
                     '(0: use them all)')
  _check_freeze(config, objective)  # optim.freeze: patterns that match
  # data.decode: a known decode; 'dali' installed, on the plain batches.
  own = type(objective).wrap_dataset is not Objective.wrap_dataset
  dali_decode.check_config(config_keys.get(config, 'data.decode'),
                           objective.name if own else '')
  loop_report.check_config(config)  # profile_steps, wandb.*
  objective.validate(config)


# ----------------------------------------------------------------------------
# What a run builds, what its checkpoints store, its restore


# The checkpoint meta key of a mixture's weight history
# (mixture.history_meta): a resume continues it.
MIXTURE_META = 'data_mixture'


@dataclasses.dataclass
class Run:
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


def train_dataset(config, objective, source, tokenizer: Tokenizer,
                  image_size: int):
  """The run's dataset of local batches (``pipeline.train_dataset``, or
  ``dali_decode.train_dataset`` with ``data.decode='dali'``, then the
  objective's ``wrap_dataset``)."""
  common = dict(
      tokenizer=tokenizer, image_size=image_size,
      global_batch_size=config.batch_size, seed=config.seed,
      augment=augment_config(config.data),
      num_views=config_keys.get(config, 'data.num_views'),
      process_index=jax.process_index(),
      process_count=jax.process_count())
  if config_keys.get(config, 'data.decode') == dali_decode.DALI:
    dali_decode.check_source(source, config.data.name)
    dataset = dali_decode.train_dataset(
        source, num_threads=config.data.num_threads, **common)
  else:
    dataset = pipeline.train_dataset(source, **common)
  return objective.wrap_dataset(
      config, dataset, source, tokenizer, image_size,
      jax.process_index(), jax.process_count())


def _continue_mixture(config, objective, run: Run, meta: dict, start: int):
  """A mixture resumed at ``start``: its mixing history from the restored
  checkpoint's ``meta``, plus the new weights from this step when they
  changed (each source continues where it stopped; one line says so).
  Rebuilds ``run.dataset`` when the history is not the config's weights
  alone."""
  if not isinstance(run.source, mixture.Mixture) or not start:
    return
  stored = meta.get(MIXTURE_META)
  records = start * config.batch_size
  history = mixture.continue_history(stored, run.source.labels,
                                     run.source.weights, records)
  if history == run.source.segments():
    return
  run.source = dataclasses.replace(run.source, history=history)
  run.dataset = train_dataset(config, objective, run.source, run.tokenizer,
                              run.model.config.vision.image_size)
  if history[-1][0] == records and jax.process_index() == 0:
    drawn = mixture.drawn_so_far(run.source, records)
    print(f'Mixture from step {start} (record {records}): '
          f'{mixture.describe(config.data.sources)}; each source continues '
          'where it stopped (records drawn so far: '
          + ', '.join(f'{label} {n}' for label, n in
                      zip(run.source.labels, drawn)) + ')', flush=True)


def _build(config, workdir: Workdir, objective,
           stored: Optional[tuple[int, dict]]) -> Run:
  """The mesh, evaluators, data, tokenizer, model, optimizer and state
  initializer of a run (``ValueError`` for a config that cannot run);
  ``stored``: ``(step, meta)`` of the checkpoint being resumed, if any."""
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
  tokenizer = setup_tokenizer(config, workdir, corpus, stored)
  model_cfg = model_config_for(config, tokenizer)
  # Attention kernel for the devices the step is compiled for (the mesh),
  # never the default backend (ahead-of-time compilation targets others).
  model = ProLIP(model_cfg, attention=models.attention_impl_for(
      mesh.devices.flat, model_cfg.attention_impl))
  tx, schedule = make_optimizer(config.optim, config.total_steps)
  dataset = train_dataset(config, objective, source, tokenizer,
                          model_cfg.vision.image_size)

  init_rng, step_rng = jax.random.split(jax.random.key(config.seed))
  init_state, state_shardings = run_state_initializer(config, model, tx,
                                                      mesh, objective)
  return Run(mesh, source, tokenizer, model, tx, schedule, dataset,
             init_state, state_shardings,
             jax.eval_shape(init_state, init_rng), init_rng, step_rng)


def checkpoint_meta(config, model, tokenizer, objective: Objective,
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


def restore(config, objective: Objective, workdir: Workdir,
            stopper: progress.StopFlag, allow_fresh_start: bool):
  """The run of ``config`` (``Run``), its checkpoint manager, the step it
  starts from and its state (the newest readable checkpoint's, or a fresh
  one), after the checks that refuse a workdir or config before any work;
  ``config`` with ``init_from`` applied.

  The manager is the run's own, opened once (without making its folder
  until the checks passed): the steps it lists and the newest meta it
  reads (``StoredState``) serve every check and the restore. It is closed
  when a check refuses.
  """
  is_chief = jax.process_index() == 0
  mngr = checkpoint.manager(workdir, config.keep_checkpoints,
                            save_interval_steps=1, create=False)
  try:
    stored = StoredState.read(mngr, workdir)
    resume.check_nothing_set_aside(workdir, stored, allow_fresh_start)
    with errors.config_errors():  # config.init_from, if any
      config, stored = hub.prepare_init_from(config, workdir, stored, mngr)
    resume.check_drift(config, stored, is_chief)
    with errors.config_errors():
      run = _build(config, workdir, objective, stored.newest)
    stopper.check('the tokenizer and the data pipeline',
                  resumed=workdir.has_checkpoints)
    checkpoint.create_directory(mngr)
    _note_removals(config, list(stored.steps), is_chief)
    start, state, meta = resume.restore_or_init(
        mngr, stored, config, run.init_state, run.init_rng, run.abstract,
        run.tx, run.state_shardings, optimizer.keeps_ema(config))
    with errors.config_errors():
      _continue_mixture(config, objective, run, meta, start)
    stopper.check(f'restoring step {start}' if start else 'initialising',
                  resumed=lambda: start > 0)
  except BaseException:
    mngr.close()
    raise
  return config, run, mngr, start, state


def announce(config, mesh, workdir: Workdir, start: int, end: int,
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

