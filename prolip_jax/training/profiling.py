"""``--config.profile_steps=A:B``: a ``jax.profiler`` trace of training
steps A..B (numbered as the progress line numbers them) in the workdir's
TensorBoard folder, ``WORKDIR/tensorboard/plugins/profile/<run>/`` (open
it with TensorBoard's Profile tab, or the ``.trace.json.gz`` in Perfetto).

The trace is written to a local folder and copied to the workdir when it
stops (``paths.local_dir_for``), so a ``gs://``/``s3://`` workdir works as
a local one does. Every process traces its own host (one file per host).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Optional

import jax

from prolip_jax.storage import paths

_RANGE = re.compile(r'\s*(\d+)\s*:\s*(\d+)\s*')


def parse_steps(text: Any) -> Optional[tuple[int, int]]:
  """``(A, B)`` of ``'A:B'`` (1 <= A <= B); None for ''. Raises
  ``ValueError`` (a config error) for anything else."""
  text = '' if text is None else str(text)
  if not text.strip():
    return None
  m = _RANGE.fullmatch(text)
  if m and 1 <= int(m.group(1)) <= int(m.group(2)):
    return int(m.group(1)), int(m.group(2))
  raise ValueError(f'profile_steps {text!r}: give A:B with 1 <= A <= B, '
                   'the first and last step to trace (e.g. 10:12)')


class StepProfiler:
  """Starts the trace before step ``A`` is dispatched and stops it once
  step ``B`` (or the run's last step) is done on the device.

  ``steps``: ``(A, B)`` or None (does nothing). ``dest``: the TensorBoard
  folder (``Workdir.tensorboard``). ``start``: the step the run resumes
  from (a range already trained is skipped, one that began earlier is
  traced from the first step of this run). ``end``: the last step of this
  run. ``aside(fn, *args)``: runs the trace's start and stop
  (``StepTimer.excluded``: seconds that are no step time).
  """

  def __init__(self, steps: Optional[tuple[int, int]], dest, start: int,
               end: int, is_chief: bool,
               aside: Callable[..., Any] = lambda fn, *args: fn(*args)):
    self.dest = dest
    self.aside = aside  # runs starting and stopping (no step time)
    self.is_chief = is_chief
    self.first = self.last = None
    self._local: Optional[contextlib.ExitStack] = None
    self._annotation = None
    if steps is None:
      return
    first, last = max(steps[0], start + 1), min(steps[1], end)
    if first > last:
      self._say(f'note: profile_steps {steps[0]}:{steps[1]} lies outside '
                f'the steps of this run ({start + 1}-{end}): no trace')
      return
    self.first, self.last = first, last

  @property
  def active(self) -> bool:
    return self._local is not None

  def _say(self, line: str):
    if self.is_chief:
      print(line, flush=True)

  def before_step(self, number: int):
    """Right before step ``number`` (1-based) is dispatched."""
    if number == self.first and not self.active:
      self.aside(self._start)
    if self.active:
      # Step markers for the Profile tab's step-time view.
      self._annotation = jax.profiler.StepTraceAnnotation(
          'train', step_num=number)
      self._annotation.__enter__()

  def after_step(self, number: int, outputs: Any):
    """Right after step ``number`` was dispatched; ``outputs``: its arrays
    (the trace stops only once they are computed)."""
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None
    if self.active and number >= self.last:
      jax.block_until_ready(outputs)
      self.aside(self.close)

  def _start(self):
    stack = contextlib.ExitStack()
    local = stack.enter_context(paths.local_dir_for(self.dest))
    try:
      jax.profiler.start_trace(local)
    except RuntimeError as e:  # a trace already running in this process
      stack.close()
      self._say(f'note: profile_steps: no trace ({e})')
      self.first = self.last = None
      return
    self._local = stack
    self._say(f'Profiling steps {self.first}-{self.last} -> {self.dest}')

  def close(self):
    """Stops a running trace and copies it to ``dest`` (also when the run
    ends before step ``B``, or fails: then from the loop's ``finally``, so
    a failure here is one warning line that hides nothing)."""
    if self._annotation is not None:
      self._annotation.__exit__(None, None, None)
      self._annotation = None
    if not self.active:
      return
    stack, self._local = self._local, None
    try:
      jax.profiler.stop_trace()
      stack.close()  # uploads a remote workdir's trace
    except Exception as e:  # pylint: disable=broad-except
      self._say(f'warning: the profile of steps {self.first}-{self.last} '
                f'was not saved: {e}')
      return
    self._say(f'Wrote the profile of steps {self.first}-{self.last} to '
              f'{paths.join(self.dest, "plugins", "profile")} (TensorBoard: '
              f'tensorboard --logdir {self.dest}, Profile tab)')
