"""Where a training step's time goes, measured without slowing the loop.

The loop dispatches steps asynchronously, so a step's device time cannot be
read per step without a sync that would stall the pipeline. ``StepTimer``
instead measures a whole log interval (the loop blocks on the metrics at the
log step anyway, so the interval's wall time covers all its device work):

- data wait: host time blocked in ``next(data_iter)`` plus the host-to-device
  assembly of the batch (``StepTimer.data`` wraps both calls);
- device work: the rest of the interval (dispatch, the device's compute,
  the host's waits on it), so ``step = data wait + device`` per step;
- excluded: checkpoints and evaluations inside the loop (``excluded``),
  which are no step time;
- one step timed alone: at the log step the previous step is awaited before
  the dispatch, so the time from dispatch to the log step's metrics is one
  step's device time with nothing overlapping it (costs one dispatch
  latency per log interval). It is what a step would take if the input were
  free, the basis of the host-core estimate (``cores_needed``).

Why the split alone is no device time: the loop keeps one step in flight
(it reads each step's flag after dispatching the next), so the batch of
step k+1 is fetched while step k runs. In a data-bound run the data wait
then includes device time and ``device`` is mostly dispatch; the data-wait
fraction still says how long the loop stood waiting for its input, and
the step timed alone says what the device needs.

The pure functions below (MFU, the core estimate, the note) are what the
tests check against hand computations.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Optional

# A run that waits for data more than this fraction of its step time says so
# (once): the input pipeline, not the accelerator, sets its speed.
DATA_WAIT_NOTE_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class Interval:
  """The mean per-step times of one log interval, in seconds."""
  steps: int
  step_s: float  # wall time per step, checkpoints and evaluations excluded
  data_wait_s: float  # blocked on the input per step
  step_alone_s: Optional[float]  # the log step timed alone (None: not timed)

  @property
  def device_s(self) -> float:
    """The rest of the step: dispatch and device work."""
    return max(self.step_s - self.data_wait_s, 0.0)

  @property
  def data_wait_fraction(self) -> float:
    return self.data_wait_s / self.step_s if self.step_s > 0 else 0.0


class StepTimer:
  """Accumulates one log interval's data wait, excluded time and steps.

  ``clock``: seconds (``time.perf_counter``; tests pass a fake).
  ``drain``: waits until the last dispatched step is done (the loop's
  ``NonFiniteMonitor.flush``, which reads that step's flag); called only
  before a log step's dispatch.
  """

  def __init__(self, drain: Callable[[], Any] = lambda: None,
               clock: Callable[[], float] = time.perf_counter):
    self._drain = drain
    self._clock = clock
    self._alone_since: Optional[tuple[int, float]] = None
    self.start()

  def start(self):
    """Starts an interval: the clock runs, the counts are zero."""
    self._t0 = self._clock()
    self._data = 0.0
    self._excluded = 0.0
    self._steps = 0

  def data(self, fn: Callable, *args, **kwargs):
    """``fn(*args)`` counted as data wait (it raises as ``fn`` does)."""
    t = self._clock()
    try:
      return fn(*args, **kwargs)
    finally:
      self._data += self._clock() - t

  def excluded(self, fn: Callable, *args, **kwargs):
    """``fn(*args)`` left out of the step time (a checkpoint, an eval)."""
    t = self._clock()
    try:
      return fn(*args, **kwargs)
    finally:
      self._excluded += self._clock() - t

  def before_step(self, number: int, timed_alone: bool):
    """Called right before step ``number`` (1-based) is dispatched.
    ``timed_alone``: time this step alone (the log steps): the previous one
    is awaited first so nothing overlaps it."""
    self._steps += 1
    self._alone_since = None
    if timed_alone:
      self._drain()
      self._alone_since = (number, self._clock())

  def stop(self, number: int) -> Optional[Interval]:
    """Ends the interval at the log step ``number`` (after its metrics were
    read, so its device work is done). None when no step was timed (the
    interval held only the compiling first step)."""
    now = self._clock()
    if not self._steps:
      return None
    alone = None
    if self._alone_since is not None and self._alone_since[0] == number:
      alone = now - self._alone_since[1]
    wall = max(now - self._t0 - self._excluded, 0.0)
    return Interval(self._steps, wall / self._steps,
                    min(self._data, wall) / self._steps, alone)


# ----------------------------------------------------------------------------
# MFU and the host-core estimate (pure)


def model_flops_per_device(batch: int, flops_per_pair: float, step_s: float,
                           num_devices: int) -> float:
  """Achieved model FLOP/s per device: ``batch`` pairs of
  ``flops_per_pair`` (the analytic count) every ``step_s`` seconds, spread
  over ``num_devices``."""
  return batch * flops_per_pair / (step_s * num_devices)


def mfu(batch: int, flops_per_pair: float, step_s: float, num_devices: int,
        peak_flops: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s per device over the
  device's peak (a fraction, 0..1)."""
  return model_flops_per_device(batch, flops_per_pair, step_s,
                                num_devices) / peak_flops


def input_cores(num_workers: int) -> int:
  """Host cores the input pipeline uses now: one per Grain worker process;
  in-process loading (``data.num_workers=0``) counts as one core (its read
  threads share the interpreter's lock)."""
  return max(int(num_workers), 1)


def host_cores() -> int:
  """Cores this process may run on (its CPU affinity where known)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def target_step_s(interval: Interval) -> float:
  """The step time with free input: the longer of one step timed alone on
  the device and the step's non-waiting time."""
  return max(interval.step_alone_s or 0.0, interval.device_s)


def cores_needed(cores_now: int, interval: Interval) -> int:
  """Host cores the input needs to keep up: the input makes one batch per
  ``step_s`` with ``cores_now`` cores and must make one per
  ``target_step_s``; input throughput is taken to grow in proportion to
  the cores (worker processes)."""
  target = target_step_s(interval)
  if target <= 0:
    return cores_now
  return max(cores_now, math.ceil(cores_now * interval.step_s / target
                                  - 1e-9))


def fmt_seconds(seconds: float) -> str:
  """``312 ms``, ``7.04 ms``, ``1.52 s``."""
  if seconds >= 1:
    return f'{seconds:.2f} s'
  ms = seconds * 1e3
  return f'{ms:.0f} ms' if ms >= 100 else f'{ms:.3g} ms'


def data_wait_note(interval: Interval, first: int, last: int,
                   num_workers: int, cores_on_host: int) -> str:
  """The one line a run prints when it waits for data more than
  ``DATA_WAIT_NOTE_FRACTION`` of a log interval (steps ``first..last``)."""
  now = input_cores(num_workers)
  need = cores_needed(now, interval)
  alone = ('not timed' if interval.step_alone_s is None
           else fmt_seconds(interval.step_alone_s))
  steps = f'step {last}' if first == last else f'steps {first}-{last}'
  head = (f'note: {steps} waited for data '
          f'{100 * interval.data_wait_fraction:.0f}% of the time '
          f'({fmt_seconds(interval.data_wait_s)} of '
          f'{fmt_seconds(interval.step_s)} per step). ')
  basis = (f'Estimate: cores now x step time / step time with free input '
           f'(the longer of one step timed alone on the device, {alone}, '
           f'and the non-waiting time, {fmt_seconds(interval.device_s)}), '
           'taking input throughput to grow with the worker processes; '
           'data.num_workers=0 counts as 1 core.')
  if need <= now:
    return (head + f'More input cores would not speed it up: {now} '
            f'core(s) already keep pace with the device (data.num_workers='
            f'{num_workers}). ' + basis)
  more = (f' (more than the {cores_on_host} this host has: see '
          'docs/performance.md, input pipeline)' if need > cores_on_host
          else f' (this host has {cores_on_host})')
  return (head + f'To keep up, the input needs about {need} host cores per '
          f'host: data.num_workers={need}; it uses {now} now'
          f'{more}. ' + basis)


def progress_text(m: dict[str, float]) -> str:
  """The progress line's timing part from a row's ``time/`` and ``perf/``
  fields: ``, step 312 ms (data 4.1 ms 1%, device 308 ms), MFU 41.3%``
  (model TFLOP/s per device instead of the MFU where no peak is known);
  '' for a row without them."""
  if 'time/step_s' not in m:
    return ''
  text = (f", step {fmt_seconds(m['time/step_s'])} (data "
          f"{fmt_seconds(m['time/data_wait_s'])} "
          f"{100 * m['time/data_wait_fraction']:.0f}%, device "
          f"{fmt_seconds(m['time/device_s'])})")
  if 'perf/mfu' in m:
    return text + f", MFU {100 * m['perf/mfu']:.1f}%"
  return text + (f", {m['perf/model_tflops_per_device']:.3g} model "
                 'TFLOP/s/device (no peak known: no MFU)')
