"""Errors that are the user's to fix, and the exit statuses of a run.

``python -m prolip_jax.main`` prints a ``UserError`` as one line
``error: <message>`` and exits with ``EXIT_USER_ERROR``, with no traceback
(``--debug`` or ``PROLIP_DEBUG=1`` shows it). Anything else is a bug in
prolip_jax and keeps its traceback.

Exit statuses of ``prolip_jax.main``:
  0  the run reached ``total_steps`` (or the ``--print_config``/``--help``
     output was printed);
  2  a user error (config, missing file, bad data, held workdir, config drift,
     training diverged): nothing was lost, the message says what to do;
  75 stopped by SIGTERM (preempted) after saving a checkpoint: run the same
     command again to resume (75 is ``EX_TEMPFAIL`` of sysexits.h); in a
     multi-host run a SIGTERM or Ctrl-C on any host stops every host after
     the same step, each saves its part of one checkpoint and exits 75;
  130 Ctrl-C, as a shell reports it (a checkpoint is saved first; in a
     multi-host run the host that got it exits 130 after the common stop
     above; a second Ctrl-C leaves at once);
  74 the store (a bucket, a disk's server) failed an operation after the
     client libraries' retries: a 403, a missing bucket, a store that
     cannot be reached or keeps answering 5xx (``StoreError``); the last
     committed checkpoint is intact: run the same command again once the
     store works (74 is ``EX_IOERR`` of sysexits.h);
  1  a bug: a traceback is printed.

In a multi-host run every failure also ends with one line ``error: process
I of N (HOST): ...`` naming the host, and the process leaves without waiting
for the others (``end_distributed_process``); it posts that line to the
coordination service, and every other host leaves within a second with
``error: process J of N (HOST): stopping: process I failed: ...`` and the
same status (``watch_other_hosts``). A host that vanished without posting
is noticed by the coordination service, which ends the others (exit status
134, its ``Terminating process because the JAX distributed service detected
fatal errors`` message) within its heartbeat timeout
(``prolip_jax.main.HEARTBEAT_TIMEOUT_S``).
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import errno
import json
import logging
import os
import re
import socket
import sys
import threading
import traceback
import warnings
from typing import Callable, Iterable, Iterator, Optional, Sequence

from prolip_jax import out_of_memory
from prolip_jax import store_answers

EXIT_BUG = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports after Ctrl-C
EXIT_STORE = 74  # EX_IOERR: the store failed; resume once it works
# How long a failing process of a multi-host run waits for the others at
# JAX's shutdown barrier (they reach it when they failed alike) before it
# leaves anyway.
SHUTDOWN_GRACE_S = 10.0


class UserError(Exception):
  """Something the user can fix: printed as one line, exit status 2."""


class ConfigError(UserError, ValueError):
  """A config that cannot run (a ``ValueError`` for library callers)."""


class WorkdirLockedError(UserError):
  """Another live process is writing the workdir."""


class ConfigDriftError(UserError):
  """Resuming a workdir with settings that change shapes or the data."""


class TrainingDivergedError(UserError, FloatingPointError):
  """Too many consecutive steps with a non-finite loss or gradient."""


class CheckpointError(UserError, OSError):
  """No checkpoint of a workdir or export can be read."""


class StoreError(UserError, OSError):
  """The store failed an operation of the run after the clients' own
  retries (``store_answers.store_fault`` says how): one line naming the operation, the
  object and the answer; exit status ``EXIT_STORE``."""


class Preempted(BaseException):
  """SIGTERM at a moment with nothing to save (setting a run up, or after
  its checkpoint, in the final evaluation): ``cli_main`` prints the message
  as one line and exits ``EXIT_PREEMPTED``. A ``BaseException`` like
  ``KeyboardInterrupt``, so no ``except Exception`` on the way swallows
  it."""


def nearest(name: str, candidates: Iterable[str]) -> str:
  """`` (did you mean 'x'?)`` for the closest candidate, or ''."""
  match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
  return f" (did you mean '{match[0]}'?)" if match else ''


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
  """Turns ``ValueError`` and ``FileNotFoundError`` raised while a run is set
  up from its config into ``ConfigError`` (the cause stays chained)."""
  try:
    yield
  except UserError:
    raise
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(str(e)) from e


class DatasetUnavailableError(UserError, FileNotFoundError):
  """An evaluation data set that is not on this machine (a TFDS data set not
  prepared, a missing folder or file): the message says how to get it."""


class TokenizerError(UserError, ValueError):
  """A tokenizer file that cannot be read, or not the one a checkpoint was
  trained with."""


class NonFiniteParamsError(UserError, ValueError):
  """A model whose parameters hold a NaN or an infinity."""


class OutOfMemoryError(UserError, MemoryError):
  """A device or the host ran out of memory: what ran out, what was asked
  for and the settings that lower it (``out_of_memory.describe``)."""


# OS errors that are the user's environment, not our bug, by class (also
# raised by our own code with a message) and by errno (no own class).
_USER_OS_CLASSES = (FileNotFoundError, FileExistsError, NotADirectoryError,
                    IsADirectoryError, PermissionError)
_USER_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG,
                          errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES,
                          errno.EPERM, errno.ENOENT, errno.ENOTDIR,
                          errno.EISDIR, errno.EEXIST, errno.EXDEV})
_HINTS = {
    errno.ENOSPC: 'free some space or choose another disk, then run the '
                  'same command again; nothing written before is lost',
    errno.EDQUOT: 'disk quota exceeded: free some space and run again',
    errno.EROFS: 'the file system is read-only: choose a writable path',
    errno.EACCES: 'permission denied: choose a path you can write, or fix '
                  'its permissions',
    errno.EPERM: 'operation not permitted: check the path\'s permissions',
    errno.ENOTDIR: 'a part of the path is a file, not a directory',
    errno.EEXIST: 'the path already exists (as a file where a directory is '
                  'needed?)',
    errno.EISDIR: 'the path is a directory where a file is needed',
}


# TensorStore (Orbax's storage layer) reports OS errors as the text of a
# ValueError: '... Failed writing: "PATH": ... [os_error_code='28']'.
_STORAGE_ERRNO = re.compile(r"os_error_code='?(\d+)")
_STORAGE_PATH = re.compile(r'(?:Failed writing|Failed reading|local file|'
                           r'opening)[^"]{0,20}"([^"]+)"')
_ORBAX_TMP = '.orbax-checkpoint-tmp'


def _storage_os_error(exc: BaseException) -> Optional[OSError]:
  """The OS error a storage-layer message reports, as an ``OSError`` naming
  the checkpoint being written (not Orbax's temporary file), or None."""
  text = str(exc)
  m = _STORAGE_ERRNO.search(text)
  if not m or int(m.group(1)) not in _USER_ERRNOS:
    return None
  code = int(m.group(1))
  paths = _STORAGE_PATH.findall(text)
  path = paths[-1] if paths else None
  if path and _ORBAX_TMP in path:
    path = path[:path.index(_ORBAX_TMP)]
  return OSError(code, os.strerror(code), path)


def store_error(operation: str, exc: BaseException,
                kept: str = '') -> Optional[StoreError]:
  """A ``StoreError`` saying ``operation`` (e.g. 'saving checkpoint step
  5 to gs://...') failed, with the store's answer, ``kept`` (what is
  intact) and what to do; None when ``exc`` is no store fault."""
  if isinstance(exc, StoreError):
    return exc
  found = store_answers.store_fault(exc)
  if found is None:
    return None
  answer, hint = found
  parts = [f'{operation} failed: {answer}']
  if kept:
    parts.append(kept)
  parts.append(hint or 'run the same command again once the store works')
  return StoreError('; '.join(parts))


def user_error_of(exc: BaseException) -> Optional[BaseException]:
  """The user's error behind ``exc`` (``exc`` itself, its cause or context,
  or a member of an exception group): a ``UserError``, an OS error of the
  user's environment (missing path, read-only, disk full, permission) or
  memory that ran out (an ``OutOfMemoryError`` saying what to lower). None
  when ``exc`` is a bug. A failed request to an object store (anywhere
  behind ``exc``) is a ``StoreError``."""
  for e in store_answers.chain(exc):
    if isinstance(e, UserError):
      return e
    if store_answers.store_fault(e) is not None:  # a request to a bucket
      return store_error('a request to the store', e)
    memory = out_of_memory.describe(e)  # XLA's RESOURCE_EXHAUSTED
    if memory is not None:
      return OutOfMemoryError(memory)
    if isinstance(e, _USER_OS_CLASSES) or (
        isinstance(e, OSError) and e.errno in _USER_ERRNOS):
      return e
    storage = _storage_os_error(e)
    if storage is not None:
      return storage
  return None


def message(exc: BaseException) -> str:
  """One line for a user's error: a ``UserError``'s text, or the OS error
  with the path(s) it names and what to do."""
  if isinstance(exc, OSError) and exc.errno and exc.strerror:
    paths = ' -> '.join(str(p) for p in (exc.filename, exc.filename2)
                        if p is not None)
    text = f'{exc.strerror}: {paths}' if paths else exc.strerror
    if exc.errno == errno.EEXIST and exc.filename is not None and (
        os.path.isfile(exc.filename)):
      return f'{exc.filename} is a file, not a directory'
    hint = _HINTS.get(exc.errno)
    return f'{text} ({hint})' if hint else text
  url = store_answers.gcs_url(exc)  # gcsfs names a request, not the URL
  if url is not None:
    return f'no such object: {url}'
  text = str(exc) or type(exc).__name__
  return ' '.join(text.split()) if isinstance(exc, OSError) else text


def exit_status(found: BaseException) -> int:
  """The exit status of a user's error ``found`` (``user_error_of``):
  ``EXIT_STORE`` for a store's fault, else ``EXIT_USER_ERROR``."""
  return EXIT_STORE if isinstance(found, StoreError) else EXIT_USER_ERROR


def debug_requested(argv: Optional[Sequence[str]] = None) -> bool:
  """``--debug`` on the command line or ``PROLIP_DEBUG`` set (not 0)."""
  argv = sys.argv if argv is None else argv
  return os.environ.get('PROLIP_DEBUG', '') not in ('', '0') or (
      '--debug' in argv)


def distributed_process() -> Optional[tuple[int, int]]:
  """``(process index, process count)`` when this process is one of several
  of a ``jax.distributed`` run, else None.

  Read from JAX's distributed state (jax only when already imported), not
  from ``jax.process_index()``, which could start a backend in an error
  path."""
  jax = sys.modules.get('jax')
  if jax is None or not jax.distributed.is_initialized():
    return None
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  state = distributed.global_state
  if (state.num_processes or 1) <= 1:
    return None
  return state.process_id, state.num_processes


def _first_line(exc: BaseException) -> str:
  """``Type: first line of the message`` (the traceback has the rest)."""
  lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
  return type(exc).__name__ + (f': {lines[0]}' if lines else '')


def end_distributed_process(text: str, status: int):
  """Ends this process of a multi-host run with ``status`` after one line
  ``error: process I of N (HOST): text``; never returns.

  JAX's atexit ``jax.distributed.shutdown()`` is a barrier of every process:
  after a failure on this host alone, the others are stuck in a collective,
  it would wait ``shutdown_timeout_seconds`` (5 minutes) and then abort
  every process. So the shutdown is tried for ``SHUTDOWN_GRACE_S`` only (it
  completes when every host failed alike: divergence, a config error), then
  the process leaves with ``os._exit``; the coordination service sees it
  gone (its socket, or its heartbeats within the heartbeat timeout) and
  ends the other processes.
  """
  index, count = distributed_process() or (0, 1)
  if not _LAST_LINE.acquire(blocking=False):
    threading.Event().wait()  # another host's failure is ending us now
  print(f'error: process {index} of {count} ({socket.gethostname()}): '
        f'{text}', file=sys.stderr, flush=True)
  _announce_failure(index, text, status)
  _stop_watching()
  import jax  # pylint: disable=g-import-not-at-top
  shutdown = threading.Thread(target=jax.distributed.shutdown, daemon=True)
  shutdown.start()
  shutdown.join(SHUTDOWN_GRACE_S)
  multiprocessing = sys.modules.get('multiprocessing')
  if multiprocessing is not None:  # os._exit leaves no orphan workers
    for child in multiprocessing.active_children():
      child.terminate()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)  # pylint: disable=protected-access


# A host that fails tells the others through the coordination service's
# key-value store (``_announce_failure``); ``watch_other_hosts`` ends each
# of them with one line within a second instead of leaving them in a
# collective or a checkpoint barrier until the service's heartbeat timeout.
_FAILED_KEY = 'prolip_jax/failed_host'
_WATCH_PERIOD_S = 0.5


# Taken, never released, by whichever prints this process's last line: its
# own failure (``end_distributed_process``) or another host's (the watcher).
_LAST_LINE = threading.Lock()

_WATCH_DONE = threading.Event()
_WATCH_ASKING = threading.Lock()  # held while the watcher asks the service


def _stop_watching():
  """Ends ``watch_other_hosts``'s thread and waits for its request in
  flight: JAX's shutdown of the client must not race with it."""
  _WATCH_DONE.set()
  with _WATCH_ASKING:
    pass


def _coordination_client():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


def _announce_failure(index: int, text: str, status: int):
  try:
    _coordination_client().key_value_set(_FAILED_KEY, json.dumps(
        {'process': index, 'text': text, 'status': status}))
  except Exception:  # pylint: disable=broad-except
    pass  # another host announced first, or the service is gone


def watch_other_hosts():
  """In a multi-host run, a daemon thread that ends this process when
  another host announces its failure (``end_distributed_process``): one
  line ``error: process I of N (HOST): stopping: process J failed: ...``
  and that host's exit status, within ``_WATCH_PERIOD_S``. A no-op in a
  single process."""
  mine = distributed_process()
  if mine is None:
    return
  index, count = mine
  client = _coordination_client()
  atexit.register(_stop_watching)  # runs before jax's (registered earlier)

  def watch():
    while not _WATCH_DONE.wait(_WATCH_PERIOD_S):
      with _WATCH_ASKING:
        if _WATCH_DONE.is_set():
          return
        try:
          failed = json.loads(client.key_value_try_get(_FAILED_KEY))
        except Exception:  # pylint: disable=broad-except
          continue  # not set (NOT_FOUND), or the service is going away
      if failed.get('process') == index:
        return
      if not _LAST_LINE.acquire(blocking=False):
        return  # this process's own failure is ending it
      print(f'error: process {index} of {count} ({socket.gethostname()})'
            f': stopping: process {failed.get("process")} failed: '
            f'{failed.get("text")}', file=sys.stderr, flush=True)
      os._exit(int(failed.get('status', EXIT_BUG)))  # pylint: disable=protected-access

  threading.Thread(target=watch, name='prolip_jax-other-hosts',
                   daemon=True).start()


def cli_main(fn: Callable[[], Optional[int]],
             argv: Optional[Sequence[str]] = None) -> int:
  """Runs a command's body ``fn``; returns its exit status.

  The one error path of every command line (``prolip_jax.main``,
  ``prolip_jax.evaluate``, ``tools/*.py``): a user's error (``UserError``,
  or an OS error such as a missing path, read-only file system, disk full,
  permission denied, found anywhere in the exception's chain) prints one line
  ``error: ...`` and gives ``EXIT_USER_ERROR``; its traceback only with
  ``--debug`` / ``PROLIP_DEBUG=1``. Anything else is a bug and propagates
  with its traceback (exit status 1). In a multi-host run any of these, and
  a ``KeyboardInterrupt``, end the process through
  ``end_distributed_process`` (one line naming the host; no wait for the
  other hosts).
  """
  debug = debug_requested(argv)
  quiet = _QuietUserErrorLogs()
  # Orbax's threads log a failed background write (absl), and its pending
  # writes fail again at exit (asyncio): the one line below says it all.
  noisy = [logging.getLogger(name) for name in ('absl', 'asyncio', 'gcsfs')]
  for logger in noisy if not debug else ():
    logger.addFilter(quiet)
  # Exceptions Python cannot raise (callbacks of TensorStore's futures into
  # Orbax's closed event loops, dozens after a failed write) are held until
  # the outcome is known: printed after a success or a bug, dropped after
  # the one line of a user's error or an interrupt.
  held: list = []
  previous_hook = sys.unraisablehook
  sys.unraisablehook = held.append
  reported = False
  try:
    status = fn()
    return status if isinstance(status, int) else 0
  except SystemExit:
    raise
  except (KeyboardInterrupt, Preempted) as e:
    interrupted = isinstance(e, KeyboardInterrupt)
    if debug:
      traceback.print_exc()
    if distributed_process() is not None:
      end_distributed_process('interrupted (Ctrl-C) before the hosts could '
                              'stop together' if interrupted else str(e),
                              EXIT_INTERRUPTED if interrupted
                              else EXIT_PREEMPTED)
    _quiet_exit(noisy)
    text = ' '.join(str(e).split()) or 'interrupted (Ctrl-C)'
    print(text, file=sys.stderr, flush=True)
    reported = True
    return EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED
  except BaseException as e:  # pylint: disable=broad-except
    found = user_error_of(e)
    if found is None:
      if distributed_process() is not None:
        traceback.print_exc()
        end_distributed_process(_first_line(e), EXIT_BUG)
      raise
    if debug:
      traceback.print_exc()
    else:  # ... and while Python shuts down ('Exception ignored in ...')
      _quiet_exit(noisy)
    if distributed_process() is not None:
      end_distributed_process(message(found), exit_status(found))
    print(f'error: {message(found)}', file=sys.stderr, flush=True)
    reported = True
    return exit_status(found)
  finally:
    if not reported:  # kept after an error: the echoes come at exit
      for logger in noisy:
        logger.removeFilter(quiet)
      sys.unraisablehook = previous_hook
    if not reported or debug:
      for unraisable in held:
        previous_hook(unraisable)


def _quiet_exit(noisy: list[logging.Logger]):
  """After the one line of a user's error or an interrupt, nothing more:
  Orbax's background threads and asyncio loops that the exit cuts short
  ('Event loop is closed', a failed pending write) log and raise again
  while Python shuts down, each with its traceback."""
  sys.unraisablehook = lambda unraisable: None
  # Their coroutines collected unawaited at exit warn too ('sys:1: ...').
  warnings.filterwarnings('ignore', message='coroutine .* was never awaited',
                          category=RuntimeWarning)
  for logger in noisy:
    logger.addFilter(_drop_all)
  threading.excepthook = lambda args: None


def _drop_all(record: logging.LogRecord) -> bool:
  del record
  return False


class _QuietUserErrorLogs(logging.Filter):
  """Drops log records (Orbax's background threads log a failed write with
  its traceback, several times) whose exception is a user's error."""

  def filter(self, record):
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None and user_error_of(exc) is not None:
      return False
    return _STORAGE_ERRNO.search(str(record.msg)) is None
