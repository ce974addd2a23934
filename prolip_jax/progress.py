"""What a training run reports while it runs: metrics, the progress line,
SIGTERM, and the count of skipped (non-finite) steps."""

from __future__ import annotations

import json
import logging as pylogging
import os
import signal
import sys
from typing import Callable, Optional

from absl import logging
import jax

from prolip_jax import errors


def _rows_up_to(path: str, step: int) -> tuple[list[str], int, int]:
  """``(lines to keep, rows dropped beyond step, partial lines dropped)``
  of a ``metrics.jsonl``."""
  with open(path, 'rb') as f:
    data = f.read()
  kept, beyond, partial = [], 0, 0
  for raw in data.split(b'\n'):
    if not raw.strip():
      continue
    try:
      row = json.loads(raw)
      row_step = int(row['step'])
    except (ValueError, TypeError, KeyError):  # cut by a kill mid-line
      partial += 1
      continue
    if row_step > step:
      beyond += 1
    else:
      kept.append(raw.decode('utf-8'))
  return kept, beyond, partial


def truncate_metrics(path: str, step: int) -> Optional[str]:
  """Drops the rows of ``metrics.jsonl`` logged after ``step`` (a resumed
  run logs those steps again) and any line cut short (a kill mid-write), so
  every step appears once; the file is replaced atomically. Returns a
  one-line note when something was dropped, else None."""
  if not os.path.exists(path):
    return None
  kept, beyond, partial = _rows_up_to(path, step)
  if not beyond and not partial:
    return None
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    f.write(''.join(line + '\n' for line in kept))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  parts = []
  if beyond:
    parts.append(f'{beyond} row(s) logged after step {step}, which is '
                 'trained again')
  if partial:
    parts.append(f'{partial} incomplete line(s)')
  return f'{path}: dropped ' + ' and '.join(parts)


class MetricWriter:
  """One JSON object per line in ``metrics.jsonl`` plus TensorBoard scalars.

  Only the writer that is ``enabled`` (the chief process) touches the file.
  ``resume_step``: the step the run restarts from; rows beyond it and lines
  cut short by a kill are dropped first (``truncate_metrics``).
  """

  def __init__(self, workdir: str, enabled: bool,
               resume_step: Optional[int] = None):
    self.enabled = enabled
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.tb = None
    if enabled and resume_step is not None:
      note = truncate_metrics(self.path, resume_step)
      if note:
        print(f'note: {note}', file=sys.stderr, flush=True)
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


def status(message: str, is_chief: bool = True):
  """One line saying what a slow phase is doing before it starts (the
  tokenizer, the first compilation, the held-out set), so a long silence is
  never the only output; printed by the chief process only."""
  if is_chief:
    print(message, flush=True)


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
