"""One writing run per workdir: ``WORKDIR/.lock``.

The lock file is created atomically (``O_CREAT | O_EXCL``) and holds the
holder's host, pid and start time. A second run on a held workdir stops at
once naming the holder. A lock left by a process that died (same host, pid no
longer alive, e.g. after ``kill -9``) is taken over with a message; a lock
held from another host cannot be checked from here and is never taken over.
In multi-host runs process 0 holds the lock for all.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Optional

from prolip_jax import errors

LOCK_FILE = '.lock'


def _read(path: str) -> Optional[dict]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


class WorkdirLock:
  """Context manager holding ``WORKDIR/.lock`` for this process."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.held = False

  def acquire(self):
    """Takes the lock; raises ``WorkdirLockedError`` naming a live holder."""
    me = {'host': socket.gethostname(), 'pid': os.getpid(),
          'started': time.strftime('%Y-%m-%d %H:%M:%S')}
    for _ in range(2):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        holder = _read(self.path)
        if holder is None:  # being written right now, or garbage
          time.sleep(0.2)
          holder = _read(self.path) or {}
        if (holder.get('host') == me['host'] and
            isinstance(holder.get('pid'), int) and
            not _alive(holder['pid'])) or not holder:
          print(f'warning: taking over the stale lock {self.path} of '
                f"pid {holder.get('pid')} on {holder.get('host')} (no longer "
                'running)', file=sys.stderr, flush=True)
          try:
            os.remove(self.path)
          except FileNotFoundError:
            pass
          continue
        raise errors.WorkdirLockedError(
            f'workdir {os.path.dirname(self.path)} is in use by pid '
            f"{holder.get('pid')} on {holder.get('host')} (since "
            f"{holder.get('started')}); wait for it to finish, or delete "
            f'{self.path} if that run is gone') from None
      with os.fdopen(fd, 'w') as f:
        json.dump(me, f)
      self.held = True
      return self
    raise errors.WorkdirLockedError(f'could not take the lock {self.path}')

  def release(self):
    if self.held:
      holder = _read(self.path)
      if holder and holder.get('pid') == os.getpid():
        os.remove(self.path)
      self.held = False

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()
