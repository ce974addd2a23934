"""Training: ``train_and_evaluate(config, workdir)``.

A run in three parts, each a module of its own: its set-up and resume
(``training/setup.py``: the refusals that change nothing, the tokenizer,
data, model and optimizer, the restore of the newest readable checkpoint),
its loop (``training/loop.py``: the jitted ``train_step`` of
``training/step.py``, read top to bottom there; a data pipeline that is
exactly resumable from the step; Orbax checkpoints every
``checkpoint_every_steps`` and on interruption; metrics to
``WORKDIR/metrics.jsonl`` and TensorBoard) and its end
(``training/run_end.py``: the last save, the final evaluations, the
summary). Nothing here is specific to one objective:
``objectives.get(config.objective)``, resolved once by ``train_and_evaluate``
and passed down, supplies the loss and the hooks
(``prolip_jax/objectives/base.py``).

The names other modules, tools, benchmarks and tests use are all here:
``train_and_evaluate``, ``validate_config``, the state (``TrainState``,
``train_state_initializer``, ``run_state_initializer``) and the step
(``make_train_step``, ``jit_train_step``), ``setup_tokenizer``,
``model_config_for``, ``augment_config``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import jax
import ml_collections

from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax.objectives.base import Objective
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import host_agreement
from prolip_jax.training import loop
from prolip_jax.training import progress
from prolip_jax.training import run_end
from prolip_jax.training import setup
from prolip_jax.training.setup import augment_config
from prolip_jax.training.setup import model_config_for
from prolip_jax.training.setup import setup_tokenizer
from prolip_jax.training.setup import validate_config
from prolip_jax.training.step import jit_train_step
from prolip_jax.training.step import make_train_step
from prolip_jax.training.step import run_state_initializer
from prolip_jax.training.step import train_state_initializer
from prolip_jax.training.step import TrainState
from prolip_jax.training.workdir_lock import WorkdirLock

__all__ = ['TrainState', 'augment_config', 'jit_train_step',
           'make_train_step', 'model_config_for', 'run_state_initializer',
           'setup_tokenizer', 'train_and_evaluate', 'train_state_initializer',
           'validate_config']

# After the store failed, how long the lock's release may try it.
STORE_FAILED_RELEASE_S = 5.0


# Process 0's failure to take the workdir, as every host raises it: its
# kind (the exit status follows it).
_FAILURE_KINDS = (None, errors.WorkdirLockedError, errors.StoreError)


def _shared_failure(failure: Optional[Exception]) -> Optional[Exception]:
  """Process 0's ``failure`` (None: it holds the workdir), raised alike on
  every host: a store's fault exits ``EXIT_STORE`` everywhere, with the
  line process 0 printed. A collective: every process calls it."""
  kind = 0 if failure is None else (
      2 if isinstance(failure, errors.StoreError) else 1)
  chief = host_agreement.gather_bytes(
      json.dumps([kind, str(failure or '')]).encode())[0]
  kind, message = json.loads(chief)
  if jax.process_index() == 0 or not kind:
    return failure
  return _FAILURE_KINDS[kind](f'{message} (on process 0)')


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
  # Hosts started with different settings would wait for each other
  # forever: one line on every host, before anything is written.
  host_agreement.check(config)
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
        workdir.claim()  # a folder of ours or a fresh one, before any write
      except errors.UserError as e:  # held, or holding files not ours
        lock.release(patience_s=STORE_FAILED_RELEASE_S if isinstance(
            e, errors.StoreError) else None)
        failure = e
      except BaseException:
        lock.release()
        raise
    if jax.process_count() > 1:  # every process stops if process 0 could not
      failure = _shared_failure(failure)
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



def _train_and_evaluate(config, objective: Objective, workdir: Workdir,
                        stopper: progress.StopFlag, max_steps: Optional[int],
                        allow_fresh_start: bool, lock: WorkdirLock):
  """The run under the lock: set-up and resume, the loop, the end."""
  config, run, mngr, start, state = setup.restore(
      config, objective, workdir, stopper, allow_fresh_start)
  end = config.total_steps if max_steps is None else min(
      config.total_steps, start + max_steps)
  run_loop = loop.begin(config, objective, workdir, run, mngr, state,
                        (start, end), stopper)
  loop.train(run_loop, stopper, lock)
  return run_end.finish(run_loop, stopper)
