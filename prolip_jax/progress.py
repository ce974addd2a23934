"""What a training run reports while it runs: metrics, the progress line,
SIGTERM, and the count of skipped (non-finite) steps."""

from __future__ import annotations

import json
import logging as pylogging
import os
import signal
from typing import Callable

from absl import logging
import jax

from prolip_jax import errors


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
        # A skipped step's NaN loss is logged on purpose.
        pylogging.getLogger('tensorboardX.x2num').setLevel(pylogging.ERROR)
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


class StopFlag:
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


class NonFiniteMonitor:
  """Counts skipped (non-finite) steps; raises after too many in a row.

  ``add(step, flag)`` takes the step's device-side ``nonfinite`` flag and
  reads the previous one, so the host never waits for the step it has just
  dispatched; ``flush()`` reads the last.
  """

  def __init__(self, max_consecutive: int, last_checkpoint: Callable):
    self.max_consecutive = max_consecutive
    self.last_checkpoint = last_checkpoint
    self.total = 0
    self.consecutive = 0
    self.pending = None

  def add(self, step: int, flag: jax.Array):
    self.flush()
    self.pending = (step, flag)

  def flush(self):
    if self.pending is None:
      return
    step, flag = self.pending
    self.pending = None
    if float(flag) == 0:
      self.consecutive = 0
      return
    self.total += 1
    self.consecutive += 1
    if self.consecutive >= self.max_consecutive:
      kept = self.last_checkpoint()
      raise errors.TrainingDivergedError(
          f'training diverged: steps {step - self.consecutive + 1}-{step} '
          f'({self.consecutive} in a row, config.max_nonfinite_steps='
          f'{self.max_consecutive}) had a non-finite loss or gradient and '
          'were skipped; '
          + ('no checkpoint was written' if kept is None else
             f'the last good checkpoint, step {kept}, is kept')
          + '; lower optim.lr or check the data')


def fmt_time(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f'{h:d}:{m:02d}:{s:02d}'


def progress_line(step: int, total: int, m: dict[str, float], eta: float,
                   elapsed: float) -> str:
  """``[step/total] loss ...``: the real loss (nan on a skipped step)."""
  extra = ''
  if 'sigma2_img' in m:
    extra = f" s2_img {m['sigma2_img']:.2e} s2_txt {m['sigma2_txt']:.2e}"
  if m.get('guard_dropped'):
    extra += f" ({int(m['guard_dropped'])} term(s) dropped by the guard)"
  if m.get('nonfinite_steps'):
    extra += f" skipped {int(m['nonfinite_steps'])} non-finite step(s)"
  return (f"[{step}/{total}] loss {m['loss']:.4f} a {m['scale']:.2f} "
          f"b {m['bias']:.2f}{extra} lr {m['lr']:.2e} "
          f"{m['samples_per_sec']:.0f} samples/s, ETA {fmt_time(eta)} "
          f'(elapsed {fmt_time(elapsed)})')
