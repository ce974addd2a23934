"""One writing run per workdir: ``WORKDIR/.lock``, local or on an object
store.

The lock is created only if absent (``paths.create_exclusive``: ``O_EXCL``
locally, a generation precondition on GCS, ``If-None-Match`` on S3: of two
runs racing, exactly one gets it) and holds the holder's host, pid, start
time and a heartbeat that a background thread renews every
``HEARTBEAT_SECONDS``. A second run on a held workdir stops at once naming
the holder. A lock is taken over, with a message, when its holder is gone:
the same host and a pid no longer alive (``kill -9``), or a heartbeat older
than ``STALE_SECONDS`` (a preempted VM never comes back to release it).
In multi-host runs process 0 holds the lock for all.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Optional

from prolip_jax import errors
from prolip_jax.storage import paths
from prolip_jax.storage import store_faults
from prolip_jax.storage.workdir import Workdir

HEARTBEAT_SECONDS = 60.0
# Ten missed heartbeats: a live run whose writes stall for minutes (a slow
# bucket, a long compile holds the GIL only briefly) keeps its lock.
STALE_SECONDS = 600.0


def _read(path) -> Optional[dict]:
  try:
    holder = json.loads(paths.as_path(path).read_text())
  except (OSError, ValueError):
    return None
  return holder if isinstance(holder, dict) else None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


def _stale(holder: dict, me: dict, now: float) -> Optional[str]:
  """Why ``holder``'s lock may be taken over, or None while it may live."""
  if not holder:
    return 'unreadable'
  if (holder.get('host') == me['host'] and isinstance(holder.get('pid'), int)
      and not _alive(holder['pid'])):
    return 'no longer running'
  beat = holder.get('heartbeat')
  if isinstance(beat, (int, float)) and now - beat > STALE_SECONDS:
    return f'no heartbeat for {int(now - beat)} s'
  return None


class WorkdirLock:
  """Context manager holding ``WORKDIR/.lock`` for this process."""

  def __init__(self, workdir):
    self.workdir = Workdir.of(workdir)
    self.path = self.workdir.lock
    self.held = False
    self._me: dict = {}
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._failure: Optional[BaseException] = None  # the last beat's

  def _record(self) -> bytes:
    return json.dumps(dict(self._me, heartbeat=time.time())).encode()

  def acquire(self):
    """Takes the lock; raises ``WorkdirLockedError`` naming a live holder."""
    self._me = {'host': socket.gethostname(), 'pid': os.getpid(),
                'started': time.strftime('%Y-%m-%d %H:%M:%S')}
    for _ in range(2):
      if paths.create_exclusive(self.path, self._record()):
        self.held = True
        try:  # the first object of the run: is the store one Orbax can use
          store_faults.check_generation_header(self.path)
        except errors.StoreError:
          self.release()
          raise
        self._start_heartbeat()
        return self
      holder = _read(self.path)
      if holder is None:  # being written right now, or garbage
        time.sleep(0.2)
        holder = _read(self.path) or {}
      why = _stale(holder, self._me, time.time())
      if why is None:
        raise errors.WorkdirLockedError(
            f'workdir {self.workdir} is in use by pid {holder.get("pid")} '
            f'on {holder.get("host")} (since {holder.get("started")}); wait '
            f'for it to finish, or delete {self.path} if that run is gone')
      print(f'warning: taking over the stale lock {self.path} of pid '
            f"{holder.get('pid')} on {holder.get('host')} ({why})",
            file=sys.stderr, flush=True)
      try:
        self.path.unlink()
      except FileNotFoundError:
        pass
    raise errors.WorkdirLockedError(f'could not take the lock {self.path}')

  def _start_heartbeat(self):
    def beat():
      while not self._stop.wait(HEARTBEAT_SECONDS):
        try:
          paths.write_bytes(self.path, self._record())
          self._failure = None
        except Exception as e:  # pylint: disable=broad-except
          self._failure = e  # after gcsfs's retries: ``check`` says so

    self._stop.clear()
    self._thread = threading.Thread(target=beat, name='prolip_jax-lock',
                                    daemon=True)
    self._thread.start()

  def check(self):
    """Raises ``errors.StoreError`` when the last heartbeat could not be
    written after the store client's retries (the store refuses or is
    gone: left to run on, the lock would go stale and another run could
    take the workdir over). A no-op on a lock this process does not
    hold."""
    failure = self._failure
    if failure is None or not self.held:
      return
    with store_faults.operation(f'renewing the workdir lock {self.path}',
                                'the checkpoints are not affected'):
      raise failure

  def release(self, patience_s: Optional[float] = None):
    """Deletes the lock if it is still this process's. Never raises: a
    lock left behind is taken over by the next run (docs/reliability.md).
    ``patience_s``: give up after that long (the store is failing; its
    client would retry for half a minute)."""
    if not self.held:
      return
    self.held = False
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)

    def delete_if_mine():
      try:
        holder = _read(self.path)
        if holder and holder.get('pid') == os.getpid() and holder.get(
            'host') == self._me.get('host'):
          self.path.unlink()
      except Exception:  # pylint: disable=broad-except
        pass  # gone already, or the store refuses: the lock goes stale

    if patience_s is None:
      delete_if_mine()
      return
    worker = threading.Thread(target=delete_if_mine, daemon=True,
                              name='prolip_jax-lock-release')
    worker.start()
    worker.join(patience_s)

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
