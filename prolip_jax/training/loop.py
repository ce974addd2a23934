"""A run's loop: its steps from the start to the end (or a stop).

``begin`` sets up what the loop writes to (metrics rows, W&B, the
checkpoints' saves, the evaluators) and prints the run's first line;
``train`` runs the steps: each one's batch, the jitted step, a log row every
``log_every_steps``, a checkpoint every ``checkpoint_every_steps``, the
evaluators on their intervals, injected faults (tests), a failed save's or
the lock's error and the stop flag at the step boundary.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator

import jax
from jax.experimental import multihost_utils
import numpy as np

from prolip_jax import errors
from prolip_jax import sharding as shd
from prolip_jax.config import keys as config_keys
from prolip_jax.data import bad_records
from prolip_jax.data import mixture
from prolip_jax.data import pipeline
from prolip_jax.data import sources
from prolip_jax.objectives.base import Objective
from prolip_jax.storage import checkpoint
from prolip_jax.storage import store_faults
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import loop_evals
from prolip_jax.training import loop_report
from prolip_jax.training import progress
from prolip_jax.training import setup
from prolip_jax.training import wandb_sink
from prolip_jax.training.step import jit_train_step
from prolip_jax.training.workdir_lock import WorkdirLock


@dataclasses.dataclass
class Loop:
  """One run's loop from ``start`` to ``end``: what it trains with and
  writes to, and where it got (``state`` after ``step``; the last log row
  ``last_metrics``), which the end of the run reads (``run_end.py``)."""
  config: Any
  objective: Objective
  workdir: Workdir
  run: setup.Run
  mngr: Any  # the run's checkpoint manager
  train_step: Callable
  writer: Any  # metrics.jsonl and TensorBoard (and W&B)
  meta: dict  # what every checkpoint stores beside the arrays
  start: int
  end: int
  data_iter: Iterator[Any]
  watch: store_faults.SaveWatch
  evaluations: loop_evals.LoopEvaluations
  state: Any
  step: int
  last_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

  def save(self, step: int, force: bool = False) -> bool:
    """Starts saving the current state as the checkpoint of ``step`` (none
    when it exists); a failed save stops the run at the next step
    (``store_faults.SaveWatch``). Returns whether a save started."""
    return self.watch.save(
        step, lambda: _save(self.mngr, self.meta, self.state, step, force))


def begin(config, objective: Objective, workdir: Workdir, run: setup.Run,
          mngr, state, steps: tuple[int, int],
          stopper: progress.StopFlag) -> Loop:
  """The loop of ``run`` from ``state`` over ``steps`` (start, end): its
  jitted step, metrics writer, data iterator, saves and evaluators; prints
  the run's first line (``setup.announce``)."""
  start, end = steps
  is_chief = jax.process_index() == 0
  train_step = jit_train_step(run.model, config, run.tx, run.schedule,
                              run.mesh, run.tokenizer.mask_id,
                              run.state_shardings, objective)
  # Rows logged after the restored step are trained again: drop them.
  writer = progress.MetricWriter(workdir, is_chief, resume_step=start)
  writer = wandb_sink.tee(writer, config, workdir, is_chief, start)  # + W&B
  meta = setup.checkpoint_meta(config, run.model, run.tokenizer, objective,
                               run.source)
  data_iter = pipeline.iterate_from(run.dataset, start,
                                    config.data.num_workers,
                                    config.data.num_threads)
  # A failed save stops the run at the next step (storage/store_faults.py).
  watch = store_faults.SaveWatch(mngr, mngr.latest_step())
  stopper.kept = watch.kept
  evaluations = loop_evals.LoopEvaluations(
      objective, run.model, config, run.tokenizer, run.mesh, writer, workdir,
      is_chief, status=lambda line: progress.status(line, is_chief))
  setup.announce(config, run.mesh, workdir, start, end,
                 evaluations.check_available())
  return Loop(config, objective, workdir, run, mngr, train_step, writer,
              meta, start, end, data_iter, watch, evaluations, state, start)


def train(loop: Loop, stopper: progress.StopFlag, lock: WorkdirLock):
  """Runs ``loop``'s steps until its end or a stop (every host after the
  same step); ``loop.state``, ``loop.step`` and ``loop.last_metrics``
  follow them. First the evaluations a kill or a stop cut short at the
  start step. Waits for the pending save at the end, unless this host
  failed alone (saving is a collective of every host)."""
  config, run, start, end = loop.config, loop.run, loop.start, loop.end
  is_chief = jax.process_index() == 0
  t_start = t_log = time.time()
  step_log = start
  monitor = progress.NonFiniteMonitor(
      config_keys.get(config, 'max_nonfinite_steps'), loop.mngr.latest_step)
  # Data wait / device split, MFU, profile_steps (training/loop_report.py).
  report = loop_report.LoopReport(
      config, loop.objective, list(run.mesh.devices.flat),
      run.model.config.to_dict(), start, end, is_chief, monitor.flush,
      loop.workdir.tensorboard)
  stopped = lambda: stopper.stop
  failed = True  # until the loop ends without an exception ('store': its)
  try:
    if 0 < start < end:  # evaluations a kill or a stop cut short at start
      names = missing_evaluations(loop.workdir, loop.evaluations, start,
                                  final=False)
      if names:
        report.excluded(loop.evaluations.run, loop.state, start, False,
                        names, stopped)
    while loop.step < end and not stopper.stop:
      step = loop.step
      batch = _next_batch(loop.data_iter, run.mesh, report, monitor,
                          lambda: loop.save(step, force=True))
      first = step == start
      if first:
        progress.status('Compiling the train step (the first step '
                        'includes it)', is_chief)
      report.before_step(step)
      loop.state, metrics = loop.train_step(loop.state, batch, run.step_rng)
      step = loop.step = step + 1
      report.after_step(step, metrics)
      # The workdir lock, before this step writes anything: a run paused
      # past the stale limit and taken over saves nothing over the new
      # owner's work; a heartbeat the store refused stops it too.
      lock.check()
      if first:
        _compiled(step, metrics, t_start, report)
      monitor.add(step, metrics['nonfinite'])
      if step % config.log_every_steps == 0 or step == end:
        monitor.flush()
        loop.last_metrics = _log_row(config, step, end, metrics,
                                     monitor.total, run.source, report,
                                     loop.writer, (t_log, step_log, t_start))
        t_log, step_log = time.time(), step
        report.start_interval(step)
      elif first:  # samples/s and the ETA count from here, not compiling
        t_log, step_log = time.time(), step
      if step % config.checkpoint_every_steps == 0 and monitor.flushed_ok():
        report.excluded(loop.save, step)
      # A stop leaves the step's evaluations to the resumed run (missing
      # from metrics.jsonl at the step it restarts from).
      if step != end:
        report.excluded(loop.evaluations.run, loop.state, step, False, None,
                        stopped)
      _injected_fault(config, step)
      loop.watch.check()  # a save that failed since the last step
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
      loop.watch.finish()


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


def missing_evaluations(workdir: Workdir, evaluations, step: int,
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

