"""What the training loop reports beyond the loss, behind a few hook calls:
the step-time split (``step_timing``), the measured MFU, the one-time
data-wait note and the ``profile_steps`` trace (``profiling``).

The loop calls, in order::

  report.data(next, data_iter)           # data wait
  report.data(shd.host_to_global, ...)   # data wait
  report.before_step(step)               # before the dispatch
  report.after_step(step, metrics)       # after it (step counts it)
  report.start_interval(step)            # after the compiling first step
  row.update(report.end_interval(step))  # the log step's time/ and perf/
  report.start_interval(step)            # after the log step's output
  report.excluded(save, step)            # checkpoints, evaluations
  report.close()                         # after the loop

The MFU is the analytic model FLOPs of ``prolip_jax.aot``'s report
(``mfu.run_flops_per_pair``) over the measured step time, against
the dense bf16 peak of the device kind (``mfu.CHIPS``); a device
without a known peak (a CPU) gets model TFLOP/s per device and no MFU.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from prolip_jax.config import keys as config_keys
from prolip_jax.training import mfu
from prolip_jax.training import profiling
from prolip_jax.training import step_timing
from prolip_jax.training import wandb_sink


def check_config(config):
  """Raises for a reporting key that cannot work, before anything is built:
  ``ValueError`` for a ``profile_steps`` that is no ``A:B``, a
  ``UserError`` for W&B asked for without the package or with an unknown
  ``wandb.mode``."""
  profiling.parse_steps(config_keys.get(config, 'profile_steps'))
  wandb_sink.check(config)


def mfu_basis(chip: Optional[mfu.Chip], kind: str,
              flops_per_pair: float, num_devices: int) -> str:
  """The line saying what the MFU (or its absence) is measured against."""
  count = (f"prolip_jax.aot's analytic model FLOPs, "
           f'{flops_per_pair / 1e9:.3g} GFLOP per pair (3 x forward)')
  if chip is None:
    return (f'No MFU: no peak FLOP/s known for device kind {kind!r}; the '
            f'progress line gives model TFLOP/s per device ({count})')
  return (f'MFU: {count} over the measured step time, against the '
          f'{chip.name} dense bf16 peak of {chip.peak_bf16_flops / 1e12:.0f}'
          f' TFLOP/s per device x {num_devices} device(s)')


class LoopReport:
  """The timer, MFU, data-wait note and profiler of one training run.

  ``objective``: the run's (its masked copies count in the model FLOPs);
  ``devices``: the mesh's devices (the MFU's denominator); ``model``: the
  run's ``ModelConfig.to_dict()``; ``start``/``end``: the steps this run
  goes from and to; ``drain``: waits for the last dispatched step (the
  loop's ``NonFiniteMonitor.flush``); ``tensorboard``: the workdir's
  TensorBoard folder (the profile goes there).
  """

  def __init__(self, config, objective, devices: list, model: dict,
               start: int, end: int, is_chief: bool,
               drain: Callable[[], Any], tensorboard):
    self.is_chief = is_chief
    self.batch = config.batch_size
    self.log_every = config.log_every_steps
    self.end = end
    self.num_workers = config_keys.get(config, 'data.num_workers')
    self.flops_per_pair = mfu.run_flops_per_pair(
        config, model, objective)['train']
    self.num_devices = len(devices)
    self.kind = devices[0].device_kind
    self.chip = mfu.chip_of_device_kind(self.kind)
    self.timer = step_timing.StepTimer(drain)
    self.profiler = profiling.StepProfiler(
        profiling.parse_steps(config_keys.get(config, 'profile_steps')),
        tensorboard, start, end, is_chief, aside=self.timer.excluded)
    self._first = start + 1  # the first step of the current interval
    self._note: Optional[str] = None
    self._noted = False
    self._intervals = 0  # intervals timed so far
    self._say(mfu_basis(self.chip, self.kind, self.flops_per_pair,
                        self.num_devices))

  def _say(self, line: str):
    if self.is_chief:
      print(line, flush=True)

  def data(self, fn: Callable, *args, **kwargs):
    """``fn(*args)`` counted as waiting for data."""
    return self.timer.data(fn, *args, **kwargs)

  def excluded(self, fn: Callable, *args, **kwargs):
    """``fn(*args)`` left out of the step time (checkpoints, evaluations)."""
    return self.timer.excluded(fn, *args, **kwargs)

  def before_step(self, step: int):
    """Right before the dispatch of step ``step + 1`` (``step``: the loop's
    count of steps done)."""
    number = step + 1
    log_step = number % self.log_every == 0 or number == self.end
    self.timer.before_step(number, timed_alone=log_step)
    self.profiler.before_step(number)

  def after_step(self, step: int, outputs: Any):
    """Right after the dispatch; ``step`` now counts it."""
    self.profiler.after_step(step, outputs)

  def start_interval(self, step: int):
    """Starts timing the steps after ``step``; prints a pending data-wait
    note (once per run)."""
    if self._note is not None:
      self._say(self._note)
      self._note = None
    self.timer.start()
    self._first = step + 1

  def end_interval(self, step: int) -> dict[str, float]:
    """The ``time/`` and ``perf/`` fields of the log step ``step`` (none
    when the interval held only the compiling first step)."""
    interval = self.timer.stop(step)
    if interval is None or interval.step_s <= 0:
      return {}
    self._intervals += 1
    # Not the first interval: the input's prefetch buffer, filled while the
    # step compiled, hides its waits there.
    if (not self._noted and self._intervals > 1
        and interval.data_wait_fraction
        > step_timing.DATA_WAIT_NOTE_FRACTION):
      self._noted = True
      self._note = step_timing.data_wait_note(
          interval, self._first, step, self.num_workers,
          step_timing.host_cores())
    return self.fields(interval)

  def fields(self, interval: step_timing.Interval) -> dict[str, float]:
    """``metrics.jsonl`` fields of an interval (seconds per step, fractions,
    TFLOP/s)."""
    row = {'time/step_s': interval.step_s,
           'time/data_wait_s': interval.data_wait_s,
           'time/device_s': interval.device_s,
           'time/data_wait_fraction': interval.data_wait_fraction}
    if interval.step_alone_s is not None:
      row['time/step_alone_s'] = interval.step_alone_s
    row['perf/model_tflops_per_device'] = step_timing.model_flops_per_device(
        self.batch, self.flops_per_pair, interval.step_s,
        self.num_devices) / 1e12
    if self.chip is not None:
      row['perf/mfu'] = step_timing.mfu(
          self.batch, self.flops_per_pair, interval.step_s, self.num_devices,
          self.chip.peak_bf16_flops)
    return row

  def close(self):
    """Stops a profile still running (the run ended before its last step)."""
    self.profiler.close()
