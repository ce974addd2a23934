"""What a training run reports while it runs: metrics, the progress line,
SIGTERM, and the count of skipped (non-finite) steps."""

from __future__ import annotations

import json
import logging as pylogging
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Callable, Iterator, Optional

from absl import logging
import jax
from jax.experimental import multihost_utils

from prolip_jax import errors
from prolip_jax.evaluation.report import number
from prolip_jax.storage import paths
from prolip_jax.storage import store_faults
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import signals
from prolip_jax.training import step_timing


def _rows(data: bytes) -> Iterator[tuple[bytes, Optional[dict]]]:
  """``(line, row)`` for each non-blank line of a ``metrics.jsonl``'s bytes;
  ``row`` is None for a line cut short by a kill (no JSON object with an
  integer ``step``)."""
  for raw in data.split(b'\n'):
    if not raw.strip():
      continue
    try:
      row = json.loads(raw)
      row['step'] = int(row['step'])
    except (ValueError, TypeError, KeyError):  # cut by a kill mid-line
      row = None
    yield raw, row


def _rows_up_to(data: bytes, step: int) -> tuple[list[str], int, int]:
  """``(lines to keep, rows dropped beyond step, partial lines dropped)``
  of a ``metrics.jsonl``'s bytes."""
  kept, beyond, partial = [], 0, 0
  for raw, row in _rows(data):
    if row is None:
      partial += 1
    elif row['step'] > step:
      beyond += 1
    else:
      kept.append(raw.decode('utf-8'))
  return kept, beyond, partial


def truncate_metrics(path, step: int) -> Optional[str]:
  """Drops the rows of ``metrics.jsonl`` (local or remote) logged after
  ``step`` (a resumed run logs those steps again) and any line cut short (a
  kill mid-write), so every step appears once; the file is replaced whole.
  Returns a one-line note when something was dropped, else None."""
  path = paths.as_path(path)
  if not path.exists():
    return None
  kept, beyond, partial = _rows_up_to(paths.read_bytes(path), step)
  if not beyond and not partial:
    return None
  paths.write_text(path, ''.join(line + '\n' for line in kept))
  parts = []
  if beyond:
    parts.append(f'{beyond} row(s) logged after step {step}, which is '
                 'trained again')
  if partial:
    parts.append(f'{partial} incomplete line(s)')
  return f'{path}: dropped ' + ' and '.join(parts)


def logged_keys(path, step: int) -> set[str]:
  """The metric names ``metrics.jsonl`` (local or remote) holds at ``step``,
  over all its rows there: what a resumed run finds already written at the
  step it restarts from (an evaluation cut short by a kill is missing)."""
  path = paths.as_path(path)
  if not path.exists():
    return set()
  return {k for _, row in _rows(paths.read_bytes(path))
          if row is not None and row['step'] == step for k in row
          if k != 'step'}


# What a failed metrics write leaves: the file holds every row before it.
_METRICS_KEPT = ('the rows logged before are kept, and the checkpoints are '
                 'not affected')


# What tensorboardX imports, when installed, for what this loop never asks
# of it: torch to accept torch tensors (2 s of every start with the
# ``torch`` extra), boto3 and google.cloud.storage for its own S3 and GCS
# event writers (importing it took 0.63 s of CPU with them, 0.09 s
# without: 2026-12-01, a 2-core VM; the loop writes its events to a local
# folder and uploads them itself, ``MetricWriter``).
_TENSORBOARDX_UNUSED = ('torch', 'boto3', 'google.cloud.storage')


def _tensorboardx_summary_writer():
  """tensorboardX's ``SummaryWriter``, imported without the modules of
  ``_TENSORBOARDX_UNUSED``: while it is imported they look absent (unless
  something already loaded them), so tensorboardX turns off what needs
  them. Raises ImportError without tensorboardX."""
  blocked = [m for m in _TENSORBOARDX_UNUSED if m not in sys.modules]
  for name in blocked:
    sys.modules[name] = None  # `import name` raises ImportError
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
  finally:
    for name in blocked:
      if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]
  return SummaryWriter


class MetricWriter:
  """One JSON object per line in ``metrics.jsonl`` plus TensorBoard scalars.

  Only the writer that is ``enabled`` (the chief process) touches the files.
  ``resume_step``: the step the run restarts from; rows beyond it and lines
  cut short by a kill are dropped first (``truncate_metrics``).

  On a local workdir rows are appended. An object can be neither appended
  to nor renamed, so on ``gs://``/``s3://`` the writer keeps the file's text
  and uploads it whole at every ``write`` (one object write per logged step;
  a kill leaves the previous complete object), and TensorBoard writes its
  event file in a local folder that is uploaded whole after each flush.
  """

  def __init__(self, workdir, enabled: bool,
               resume_step: Optional[int] = None):
    wd = Workdir.of(workdir)
    self.enabled = enabled
    self.path = wd.metrics
    self.remote = wd.remote
    self.tb = None
    self._tb_local: Optional[str] = None
    self._tb_dest = wd.tensorboard
    self._text = ''
    if enabled and resume_step is not None:
      note = truncate_metrics(self.path, resume_step)
      if note:
        print(f'note: {note}', file=sys.stderr, flush=True)
    if enabled and self.remote and self.path.exists():
      self._text = paths.read_text(self.path)
    if enabled:
      try:
        SummaryWriter = _tensorboardx_summary_writer()  # pylint: disable=invalid-name
        if self.remote:
          self._tb_local = tempfile.mkdtemp(prefix='prolip_jax-tb-')
        self.tb = SummaryWriter(self._tb_local or str(self._tb_dest))
        # A skipped step's NaN loss is logged on purpose.
        pylogging.getLogger('tensorboardX.x2num').setLevel(pylogging.ERROR)
      except ImportError:  # TensorBoard output is a convenience
        logging.warning('tensorboardX missing: no TensorBoard event files')

  def write(self, step: int, scalars: dict[str, float]):
    if not self.enabled:
      return
    row = {'step': int(step)}
    row.update({k: float(v) for k, v in scalars.items()})
    line = json.dumps(row) + '\n'
    with store_faults.operation(f'writing the metrics file {self.path}',
                                _METRICS_KEPT):
      if self.remote:
        paths.write_text(self.path, self._text + line)
        self._text += line  # once written: a failed write adds no row
      else:
        with open(self.path, 'a') as f:
          f.write(line)
    if self.tb is not None:
      for k, v in scalars.items():
        self.tb.add_scalar(k, float(v), int(step))
      self.tb.flush()
      self._upload_tensorboard()

  def _upload_tensorboard(self):
    if self._tb_local is not None:
      with store_faults.operation(
          f'uploading the TensorBoard files to {self._tb_dest}',
          _METRICS_KEPT):
        paths.upload_tree(self._tb_local, self._tb_dest)

  def close(self):
    if self.tb is not None:
      self.tb.close()
      if self._tb_local is not None:
        self._upload_tensorboard()
        shutil.rmtree(self._tb_local, ignore_errors=True)
        self._tb_local = None


def _preemption_sync_available() -> bool:
  """Whether JAX's preemption sync manager runs (``jax.distributed`` is
  initialized and ``jax_enable_preemption_service`` is on)."""
  if not jax.distributed.is_initialized():
    return False
  try:
    # Records call 0, which the manager starts from anyway.
    multihost_utils.reached_preemption_sync_point(0)
    return True
  except RuntimeError:  # the preemption service is switched off
    return False


# How long a stop (SIGTERM, Ctrl-C) may take to save and leave.
STOP_DEADLINE_ENV = 'PROLIP_STOP_DEADLINE_S'
DEFAULT_STOP_DEADLINE_S = 180.0  # the save timeout's 120 s and more


def stop_deadline_s() -> float:
  """``PROLIP_STOP_DEADLINE_S`` or ``DEFAULT_STOP_DEADLINE_S``: a stop's
  time to save its checkpoint and leave (raise it for checkpoints that take
  longer to write)."""
  text = os.environ.get(STOP_DEADLINE_ENV, '').strip()
  try:
    value = float(text) if text else DEFAULT_STOP_DEADLINE_S
  except ValueError:
    value = -1.0
  if not value > 0:
    raise errors.UserError(f'{STOP_DEADLINE_ENV}={text!r}: give seconds > 0')
  return value


class StopFlag:
  """SIGTERM (preemption) and Ctrl-C turned into a stop at a step boundary:
  the loop checks ``stop`` after each step, saves and leaves; ``at_step`` is
  called once per step.

  One process: Python handlers for SIGTERM and SIGINT, installed when the
  flag is made (before the run is set up), only set ``stop`` (and, for
  Ctrl-C, ``interrupted``). Nothing is saved or raised inside a handler:
  its moment may be the middle of a step whose input buffers are already
  donated, or a callback that would swallow an exception. Before the loop,
  ``check(phase)`` ends the run between set-up phases (nothing to save
  yet) with ``errors.Preempted`` for SIGTERM or ``KeyboardInterrupt`` for
  Ctrl-C, each carrying the line ``errors.cli_main`` prints. A second
  Ctrl-C raises ``KeyboardInterrupt`` at once (leave without a new
  checkpoint).

  Several processes: a host that leaves alone leaves the others waiting in
  the next collective or checkpoint barrier forever, so the stop goes
  through JAX's preemption sync manager (started by
  ``jax.distributed.initialize``). Its C++ notifier owns SIGTERM, and a
  Python handler installed after it would replace it (measured), so none is
  installed. A notice on any host reaches all of them through the
  coordination service, which picks the step after the furthest host's;
  ``at_step`` asks for it (``multihost_utils.reached_preemption_sync_point``)
  and ``stop`` turns true on every host after that same step. The first
  Ctrl-C is turned into such a notice (``interrupted`` remembers it); a
  second one interrupts at once. ``close`` gives the signals back.
  """

  def __init__(self):
    # A signal while prolip_jax.main started (signals.record_early).
    self.stop, self.interrupted = signals.early()
    self._calls = 0  # at_step calls: the same count on every host
    self._previous: dict[int, object] = {}
    # What a stop that cannot save leaves intact (the loop's SaveWatch).
    self.kept: Callable[[], str] = lambda: (
        'the last committed checkpoint is intact')
    self._deadline: Optional[threading.Timer] = None
    self._deadline_s = stop_deadline_s()  # a bad value: one line at start
    self.synced = jax.process_count() > 1 and _preemption_sync_available()
    if self.synced:
      self._install(signal.SIGINT, self._ctrl_c_to_notice)
      if self.stop:  # a notice to every host, through the C++ notifier
        self.stop = False
        os.kill(os.getpid(), signal.SIGTERM)
      return
    if jax.process_count() > 1:
      logging.warning('JAX preemption service off: SIGTERM stops this host '
                      'only, the others will wait for it')
    self._install(signal.SIGTERM, self._handler)
    self._install(signal.SIGINT, self._handler)

  def _install(self, signum, handler):
    """Installs ``handler`` (not outside the main thread, where handlers
    cannot be installed), remembering the previous one for ``close``."""
    try:
      previous = signal.signal(signum, handler)
    except ValueError:  # not in the main thread
      return
    self._previous.setdefault(signum, previous)

  def _handler(self, signum, frame):
    del frame
    ctrl_c = signum == signal.SIGINT
    if self.stop:  # the second signal: leave now
      self._leave_now(signum)
    self.stop = True
    self.interrupted = self.interrupted or ctrl_c
    self._start_deadline()
    if ctrl_c:  # os.write: print() here could re-enter a busy stream
      os.write(2, b'Ctrl-C: stopping at the next step boundary with a '
               b'checkpoint (Ctrl-C again to leave at once, without one)\n')

  def _leave_now(self, signum):
    """A second SIGTERM or Ctrl-C: one line, then the process ends at once
    (``os._exit``: no save, no wait for a store or another host)."""
    what = 'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'
    os.write(2, (f'interrupted ({what} twice): left at once without saving '
                 f'this stop\'s checkpoint; {self.kept()}\n').encode())
    os._exit(errors.EXIT_INTERRUPTED if signum == signal.SIGINT  # pylint: disable=protected-access
             else errors.EXIT_PREEMPTED)

  def _start_deadline(self):
    """From the stop on, the process has ``stop_deadline_s()`` to save and
    leave; past it (a save stuck on a store that does not answer) one line
    says what was not saved and the process ends (``errors.EXIT_STORE``):
    a stop never hangs."""
    if self._deadline is not None:
      return
    limit = self._deadline_s

    def overdue():
      os.write(2, (f'error: the stop did not end within {limit:g} s '
                   f'({STOP_DEADLINE_ENV}): its checkpoint was not saved '
                   '(a save stuck on a store that does not answer, a host '
                   'that does not reach it, or a longer step); '
                   f'{self.kept()}; run the same command again once the '
                   'store works\n').encode())
      os._exit(errors.EXIT_STORE)  # pylint: disable=protected-access

    self._deadline = threading.Timer(limit, overdue)
    self._deadline.daemon = True
    self._deadline.start()

  def check(self, phase: str, resumed: Callable[[], bool]):
    """Ends a run stopped before its first step, after ``phase`` (e.g. 'the
    tokenizer'): nothing new is trained, so nothing is saved. ``resumed()``:
    the workdir holds a checkpoint the next run resumes from (asked only
    when stopping: on a bucket it lists objects)."""
    if not self.stop or self.synced:  # (several: the loop's common stop)
      return
    what = 'Ctrl-C' if self.interrupted else 'SIGTERM'
    text = (f'stopped by {what} after {phase}, before any new step: nothing '
            'new to save; run the same command to '
            + ('resume' if resumed() else 'start again'))
    raise KeyboardInterrupt(text) if self.interrupted else errors.Preempted(
        text)

  def _ctrl_c_to_notice(self, signum, frame):
    """Ctrl-C on one host of several: a preemption notice, which the C++
    notifier's SIGTERM handler takes like the scheduler's."""
    del signum, frame
    self.interrupted = True
    # A second Ctrl-C leaves at once (not the start-up's handler, which
    # would only wait again, nor Python's, which raises anywhere).
    signal.signal(signal.SIGINT, lambda signum, _: self._leave_now(signum))
    os.write(2, b'Ctrl-C: every host stops at the next common step and '
             b'saves (Ctrl-C again to interrupt at once)\n')
    os.kill(os.getpid(), signal.SIGTERM)

  def at_step(self, step: int):
    """After each step (``step``: the step just done), on every host."""
    if not self.synced or self.stop:
      return
    # Counted from 1 in every process, like the manager's own counter: a
    # notice before the first call then stops after the first step.
    self._calls += 1
    if multihost_utils.reached_preemption_sync_point(self._calls):
      self.stop = True
      self._start_deadline()
      # The notice is delivered: a second SIGTERM or Ctrl-C now leaves at
      # once (the C++ notifier would ignore it).
      self._install(signal.SIGTERM, lambda signum, _: self._leave_now(signum))
      self._install(signal.SIGINT, lambda signum, _: self._leave_now(signum))
      status(f'Process {jax.process_index()} of {jax.process_count()}: '
             f'preemption notice; every host stops after step {step}')

  def close(self):
    """Gives the signals their previous handlers; the stop's deadline
    ends (the run is over)."""
    if self._deadline is not None:
      self._deadline.cancel()
      self._deadline = None
    for signum, previous in self._previous.items():
      try:
        signal.signal(signum, previous)
      except (ValueError, TypeError):  # not the main thread; a C handler
        pass
    self._previous = {}
    if self.stop or self.interrupted:  # the run is ending: a next one leaves
      signals.stopped('after the stop: left at once')


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

  def flushed_ok(self) -> bool:
    """``flush``, then whether the newest step was finite (a checkpoint
    now would hold a new state; mid-streak it would not)."""
    self.flush()
    return not self.consecutive

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
  """``[step/total] loss ...``: the real loss (nan on a skipped step), the
  step time split into data wait and device work, and the MFU (where the
  row has them: ``step_timing.progress_text``)."""
  extra = ''
  if 'sigma2_img' in m:
    extra = (f" s2_img {number(m['sigma2_img'])} s2_txt "
             f"{number(m['sigma2_txt'])}")
  if m.get('guard_dropped'):
    extra += f" ({int(m['guard_dropped'])} term(s) dropped by the guard)"
  if m.get('nonfinite_steps'):
    extra += f" skipped {int(m['nonfinite_steps'])} non-finite step(s)"
  return (f"[{step}/{total}] loss {m['loss']:.4f} a {m['scale']:.2f} "
          f"b {m['bias']:.2f}{extra} lr {number(m['lr'])} "
          f"{m['samples_per_sec']:.0f} samples/s"
          f'{step_timing.progress_text(m)}, ETA {fmt_time(eta)} '
          f'(elapsed {fmt_time(elapsed)})')
