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
On GCS that takeover deletes only the generation it judged stale, so of
two runs taking one lock over at once the second never deletes the
first's new lock.

A holder whose process or machine was paused past ``STALE_SECONDS`` (a
SIGSTOP, a live migration, a stuck NFS mount) may come back to a lock
taken over. So the lock carries a random token, and every heartbeat first
reads it: the heartbeat is written only while the token is still this
run's (on GCS under a generation precondition: no write between the read
and the write); otherwise nothing is written and ``check``, called at every
step boundary before anything is saved, stops the run with one line. A
heartbeat overdue at ``check`` (the pause just ended) is renewed there
first. Release deletes the lock only while it holds this run's token.
In multi-host runs process 0 holds the lock for all.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any, Optional

from prolip_jax import errors
from prolip_jax.storage import paths
from prolip_jax.storage import store_faults
from prolip_jax.storage.workdir import Workdir

HEARTBEAT_SECONDS = 60.0
# Ten missed heartbeats: a live run whose writes stall for minutes (a slow
# bucket, a long compile holds the GIL only briefly) keeps its lock.
STALE_SECONDS = 600.0


def _load(data: bytes) -> Optional[dict]:
  try:
    holder = json.loads(data)
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


def _gcs(path) -> Optional[tuple[Any, str, str]]:
  """(gcsfs's file system, bucket, object name) of a ``gs://`` path, or
  None for any other."""
  text = os.fspath(path)
  if paths.scheme(text) != 'gs':
    return None
  import fsspec  # pylint: disable=g-import-not-at-top
  fs, key = fsspec.core.url_to_fs(text)
  bucket, _, name = key.partition('/')
  return fs, bucket, name


def _read(path) -> tuple[Optional[dict], Optional[str]]:
  """(the lock's holder, None when unreadable; its generation on GCS).
  ``FileNotFoundError`` when there is no lock. One request, no read-ahead:
  gcsfs's prefetcher prints a traceback when the object vanishes between
  its requests (another run took the lock over)."""
  gcs = _gcs(path)
  if gcs is not None:
    fs, bucket, name = gcs
    headers, data = fs.call('GET', 'b/{}/o/{}', bucket, name, alt='media')
    return _load(data), headers.get('x-goog-generation')
  return _load(paths.read_bytes(path)), None


def _holder(path) -> Optional[dict]:
  """The lock's holder; None when absent or unreadable."""
  try:
    return _read(path)[0]
  except OSError:
    return None


def _write(path, data: bytes, generation: Optional[str]) -> bool:
  """Writes the lock; on GCS only while its generation is still
  ``generation`` (False when another run replaced it since it was read)."""
  gcs = _gcs(path)
  if gcs is None or generation is None:
    paths.write_bytes(path, data)
    return True
  fs, bucket, name = gcs
  try:
    fs.call('POST', f'{fs._location}/upload/storage/v1/b/{{}}/o', bucket,  # pylint: disable=protected-access
            uploadType='media', name=name, ifGenerationMatch=generation,
            data=data, json_out=True)
  except FileExistsError:  # 412: the precondition does not hold
    return False
  return True


def _delete(path, generation: Optional[str]):
  """Deletes the lock; on GCS only while its generation is ``generation``
  (two runs taking one stale lock over: the second never deletes the
  first's new lock)."""
  gcs = _gcs(path)
  try:
    if gcs is None or generation is None:
      paths.as_path(path).unlink()
    else:
      fs, bucket, name = gcs
      fs.call('DELETE', 'b/{}/o/{}', bucket, name,
              ifGenerationMatch=generation)
  except (FileNotFoundError, FileExistsError):
    pass  # gone already, or replaced: the next look at it decides


def _age(holder: dict, now: float) -> str:
  beat = holder.get('heartbeat')
  if not isinstance(beat, (int, float)):
    return 'no heartbeat recorded'
  return f'last heartbeat {max(0, int(now - beat))} s ago'


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
    self._lost: Optional[str] = None  # why another run holds it now
    self._confirmed = 0.0  # when the lock was last found ours (time.time)
    self._renewing = threading.Lock()  # the heartbeat thread or ``check``

  def _record(self) -> bytes:
    return json.dumps(dict(self._me, heartbeat=time.time())).encode()

  def _mine(self, holder: Optional[dict]) -> bool:
    return bool(holder) and holder.get('token') == self._me.get('token')

  def acquire(self):
    """Takes the lock; raises ``WorkdirLockedError`` naming a live holder."""
    self._me = {'host': socket.gethostname(), 'pid': os.getpid(),
                'started': time.strftime('%Y-%m-%d %H:%M:%S'),
                'token': secrets.token_hex(8)}
    for _ in range(3):
      if paths.create_exclusive(self.path, self._record()):
        self.held = True
        self._lost = None
        try:  # the first object of the run: is the store one Orbax can use
          store_faults.check_generation_header(self.path)
        except errors.StoreError:
          self.release()
          raise
        self._confirmed = time.time()
        self._start_heartbeat()
        return self
      try:
        holder, generation = _read(self.path)
        if holder is None:  # being written right now, or garbage
          time.sleep(0.2)
          holder, generation = _read(self.path)
      except FileNotFoundError:
        continue  # released or taken over meanwhile: try again
      except OSError:
        holder, generation = None, None
      holder = holder or {}
      now = time.time()
      why = _stale(holder, self._me, now)
      if why is None:
        raise errors.WorkdirLockedError(self._in_use(holder, now))
      print(f'warning: taking over the stale lock {self.path} of pid '
            f"{holder.get('pid')} on {holder.get('host')} ({why})",
            file=sys.stderr, flush=True)
      _delete(self.path, generation)
    raise errors.WorkdirLockedError(f'could not take the lock {self.path}')

  def _in_use(self, holder: dict, now: float) -> str:
    """The refusal of a live holder: who, since when, its heartbeat's age
    and when it may be taken over."""
    since = holder.get('started')
    beat = holder.get('heartbeat')
    if isinstance(beat, (int, float)):
      left = max(0, int(STALE_SECONDS - (now - beat)))
      takeover = (f'it is taken over automatically if its heartbeat stops '
                  f'for {int(STALE_SECONDS)} s (in {left} s at the earliest)')
    else:
      takeover = 'it has no heartbeat to go stale'
    return (f'workdir {self.workdir} is in use by pid {holder.get("pid")} '
            f'on {holder.get("host")}'
            + (f' (since {since})' if since else '')
            + f'; {_age(holder, now)}; {takeover}; wait for it to finish, '
            f'or delete {self.path} if that run is gone')

  def _start_heartbeat(self):
    def beat():
      while not self._stop.wait(HEARTBEAT_SECONDS):
        try:
          if not self._renew():
            return  # lost: ``check`` stops the run
          self._failure = None
        except Exception as e:  # pylint: disable=broad-except
          self._failure = e  # after gcsfs's retries: ``check`` says so

    self._stop.clear()
    self._thread = threading.Thread(target=beat, name='prolip_jax-lock',
                                    daemon=True)
    self._thread.start()

  def _renew(self) -> bool:
    """Rewrites the heartbeat if the lock is still this run's (its token;
    on GCS the write holds only while the generation read is current); else remembers who took it
    over and writes nothing. Returns whether it is still ours."""
    with self._renewing:
      if self._lost is not None:
        return False
      try:
        holder, generation = _read(self.path)
      except FileNotFoundError:
        holder, generation = {}, None
      if holder is None:  # a torn read: judged at the next beat
        return True
      if self._mine(holder) and _write(self.path, self._record(), generation):
        self._confirmed = time.time()
        return True
      if not holder or not self._mine(holder):
        self._lose(holder)
        return False
      holder = _holder(self.path) or {}  # replaced since we read it
      if self._mine(holder):  # our own write, retried by the client
        self._confirmed = time.time()
        return True
      self._lose(holder)
      return False

  def _lose(self, holder: dict):
    """Remembers that another run took the lock over (or deleted it)."""
    now = time.time()
    silent = int(now - self._confirmed)
    who = (f'pid {holder.get("pid")} on {holder.get("host")} holds it now'
           if holder else 'it was deleted')
    self._lost = (
        f'this run lost the workdir lock {self.path}: {who} (this run sent '
        f'no heartbeat for {silent} s: the process or its machine was '
        f'paused or cut off past the {int(STALE_SECONDS)} s limit); stopped '
        'without saving over the other run\'s work; check which run should '
        'own the workdir')
    self._stop.set()

  def check(self):
    """Raises ``errors.WorkdirLockedError`` when another run took the lock
    over, and ``errors.StoreError`` when the last heartbeat could not be
    written after the store client's retries (the store refuses or is
    gone: left to run on, the lock would go stale and another run could
    take the workdir over). A heartbeat overdue (this process or its
    machine was paused) is renewed here first, so a run that lost its lock
    saves nothing at this step boundary. A no-op on a lock this process
    does not hold."""
    if not self.held:
      return
    if self._lost is None and (time.time() - self._confirmed
                               > 1.5 * HEARTBEAT_SECONDS):
      try:
        if self._renew():
          self._failure = None
      except Exception as e:  # pylint: disable=broad-except
        self._failure = e
    if self._lost is not None:
      self.held = False  # the lock is the other run's: never deleted here
      self._stop.set()
      raise errors.WorkdirLockedError(self._lost)
    failure = self._failure
    if failure is None:
      return
    with store_faults.operation(f'renewing the workdir lock {self.path}',
                                'the checkpoints are not affected'):
      raise failure

  def release(self, patience_s: Optional[float] = None):
    """Deletes the lock if it is still this run's (its token). Never
    raises: a lock left behind is taken over by the next run
    (docs/reliability.md). ``patience_s``: give up after that long (the
    store is failing; its client would retry for half a minute)."""
    if not self.held:
      return
    self.held = False
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)

    def delete_if_mine():
      try:
        with self._renewing:
          holder, generation = _read(self.path)
          if self._lost is None and self._mine(holder):
            _delete(self.path, generation)
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
