"""A run on a store that fails: the clients' retries, one line per failed
operation, and a checkpoint save's outcome noticed at the next step.

A week-long run meets both kinds of fault (docs/reliability.md):

- transient (429, 5xx, a connection reset, a slow answer): the clients
  retry each request themselves. gcsfs (metrics, the lock, TensorBoard,
  exports) retries 6 times over about 30 s; TensorStore (Orbax's arrays)
  retries ``gcs_request_retries`` times, which ``configure_retries`` sets
  for every context Orbax opens (``PROLIP_STORE_RETRIES``, default
  ``DEFAULT_RETRIES``; the delays double from 1 s to at most 16 s, so one
  request gives up after about a minute instead of TensorStore's own
  default of 32 retries, a quarter of an hour);
- persistent (403 after a credential expires, a deleted bucket, a store
  that stays down): after those retries the operation fails, and
  ``operation`` turns the client's error into one ``errors.StoreError``
  line naming the operation, the object, the store's answer and what is
  kept (exit status ``errors.EXIT_STORE``).

An asynchronous checkpoint save fails in Orbax's background thread;
``SaveWatch`` asks for its outcome at every step boundary once it is done
(and waits for it before the next save and at the end), so a failed save
stops the run at the next step at the latest, never in silence.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Callable, Iterator, Optional

from prolip_jax import errors

# TensorStore retries of one request to GCS or S3 (``PROLIP_STORE_RETRIES``).
DEFAULT_RETRIES = 6
RETRIES_ENV = 'PROLIP_STORE_RETRIES'
MAX_DELAY = '16s'
# How long one checkpoint save may take (``PROLIP_SAVE_TIMEOUT_S``): past
# it the save is stuck (a store that never answers, or answers in a way
# TensorStore retries forever) and the run stops with one line.
DEFAULT_SAVE_TIMEOUT_S = 120.0
SAVE_TIMEOUT_ENV = 'PROLIP_SAVE_TIMEOUT_S'


def _number(env: str, default: float, minimum: float, what: str) -> float:
  text = os.environ.get(env, '').strip()
  if not text:
    return default
  try:
    value = float(text)
  except ValueError:
    value = float('nan')
  if not value >= minimum:  # also NaN
    raise errors.UserError(f'{env}={text!r}: give {what}')
  return value


def retries() -> int:
  """The TensorStore retries per request: ``PROLIP_STORE_RETRIES`` or
  ``DEFAULT_RETRIES`` (``UserError`` for a value that is no count)."""
  value = _number(RETRIES_ENV, DEFAULT_RETRIES, 0, 'a count of retries '
                  '(0 or more)')
  if value != int(value):
    raise errors.UserError(f'{RETRIES_ENV}={value!r}: give a whole count')
  return int(value)


def save_timeout_s() -> float:
  """``PROLIP_SAVE_TIMEOUT_S`` or ``DEFAULT_SAVE_TIMEOUT_S``."""
  return _number(SAVE_TIMEOUT_ENV, DEFAULT_SAVE_TIMEOUT_S, 1e-3,
                 'seconds > 0')


def configure_retries() -> bool:
  """Sets TensorStore's ``gcs_request_retries`` and ``s3_request_retries``
  in the contexts Orbax opens for every checkpoint read and write. Returns
  whether it could (Orbax keeps its default context in a private module;
  a version that moved it keeps TensorStore's defaults, and
  tests/test_flaky_store.py fails)."""
  spec = {'max_retries': retries(), 'initial_delay': '1s',
          'max_delay': MAX_DELAY}
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
    contexts = [getattr(tensorstore_utils, name) for name in
                ('_BASE_TS_CONTEXT', '_DEFAULT_OCDBT_TS_CONTEXT')]
  except (ImportError, AttributeError):
    return False
  for context in contexts:
    context['gcs_request_retries'] = dict(spec)
    context['s3_request_retries'] = dict(spec)
  return True


# Where TensorStore's gcs driver is sent instead of Google's servers.
EMULATOR_ENV = 'TENSORSTORE_GCS_HTTP_URL'


def check_generation_header(path):
  """On a GCS emulator (``TENSORSTORE_GCS_HTTP_URL`` set), reads the
  existing object ``path`` (``gs://BUCKET/NAME``) as TensorStore will and
  raises ``errors.StoreError`` when the answer lacks ``x-goog-generation``:
  without it Orbax's OCDBT writes fail or never end (the bare
  gcp-storage-emulator from PyPI). Real GCS always sends it, so nothing is
  asked of it."""
  url = os.environ.get(EMULATOR_ENV, '').rstrip('/')
  text = str(path)
  if not url or not text.startswith('gs://'):
    return
  bucket, _, name = text[len('gs://'):].partition('/')
  request = (f'{url}/storage/v1/b/{bucket}/o/'
             f'{urllib.parse.quote(name, safe="")}?alt=media')
  try:
    with urllib.request.urlopen(request, timeout=30) as answer:
      headers = answer.headers
  except OSError:
    return  # another failure: the operations themselves will say it
  if headers.get('x-goog-generation') is None:
    raise errors.StoreError(
        f'the GCS server at {url} ({EMULATOR_ENV}) answers reads of {text} '
        'without the x-goog-generation header, which real GCS sends and '
        "Orbax's TensorStore needs to write checkpoints (the bare "
        'gcp-storage-emulator from PyPI leaves it out): run tests/'
        'gcs_server.py instead (docs/training.md#trying-the-pod-path-on-'
        'one-machine), or a real bucket')


@contextlib.contextmanager
def operation(what: str, kept: str | Callable[[], str] = ''
              ) -> Iterator[None]:
  """Turns a store's fault raised inside into one ``errors.StoreError``
  line: ``<what> failed: <the store's answer>; <kept>; <what to do>``.
  ``what`` names the operation and the object ('writing the metrics file
  gs://...'); ``kept`` what is intact (or a callable giving it). Other
  exceptions pass unchanged."""
  try:
    yield
  except errors.StoreError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    found = errors.store_error(what, e, kept() if callable(kept) else kept)
    if found is None:
      raise
    raise found from e


class SaveWatch:
  """The outcome of a run's asynchronous checkpoint saves.

  ``save(step, start)`` starts one (``start()`` returns whether a save was
  started) after the previous one is known to have succeeded; ``check()``
  (every step boundary) raises the failure of a save that has finished, and
  ``finish()`` waits for the last one. Each failure is an
  ``errors.StoreError`` (the store's fault) naming the step, the folder
  and the last committed checkpoint, which is intact; any other failure
  keeps its own exception.
  """

  def __init__(self, mngr, committed: Optional[int]):
    self.mngr = mngr
    self.committed = committed  # the newest step known to be committed
    self.pending: Optional[int] = None
    self.timeout_s = save_timeout_s()
    self._started = 0.0  # time.monotonic() of the pending save's start

  def kept(self) -> str:
    """What a failure leaves intact, in words."""
    if self.committed is None:
      return 'no checkpoint of this run is committed yet'
    return (f'the last committed checkpoint, step {self.committed}, is '
            'intact and the next run resumes from it')

  def _what(self, step: int) -> str:
    return f'saving checkpoint step {step} to {self.mngr.directory}/{step}'

  def _stuck(self, step: int) -> errors.StoreError:
    return errors.StoreError(
        f'{self._what(step)} did not finish within {self.timeout_s:g} s '
        f'({SAVE_TIMEOUT_ENV}): the store does not answer, or answers in a '
        'way the client retries forever (a GCS emulator without '
        'x-goog-generation headers), or is slower than that; '
        f'{self.kept()}; raise {SAVE_TIMEOUT_ENV} for a slow store')

  def _bounded(self, step: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` (Orbax's save or its wait, neither of which takes a
    timeout) in a thread, waited for at most what is left of the save's
    timeout: past it the ``_stuck`` error (the thread is left behind; the
    process then ends with that line); else ``fn``'s value or error."""
    outcome: list = []

    def run():
      try:
        outcome.append((True, fn()))
      except BaseException as e:  # pylint: disable=broad-except
        outcome.append((False, e))

    worker = threading.Thread(target=run, daemon=True,
                              name='prolip_jax-save')
    worker.start()
    worker.join(max(self._started + self.timeout_s - time.monotonic(), 0.0))
    if not outcome:
      raise self._stuck(step)
    ok, value = outcome[0]
    if not ok:
      raise value
    return value

  def _outcome(self):
    """Waits for the pending save (within its timeout); raises its
    failure."""
    step = self.pending
    with operation(self._what(step), self.kept):
      self._bounded(step, self.mngr.wait_until_finished)
    self.pending = None
    if step in self.mngr.all_steps():
      self.committed = step

  def check(self):
    """Raises the failure of a save that has finished, or of one that has
    run past ``timeout_s`` (a step boundary never waits for the store)."""
    if self.pending is None:
      return
    if not self.mngr.is_saving_in_progress():
      self._outcome()
    elif time.monotonic() - self._started > self.timeout_s:
      raise self._stuck(self.pending)

  def save(self, step: int, start: Callable[[], bool]):
    """Starts the save of ``step`` once the previous one succeeded."""
    self.finish()
    self._started = time.monotonic()
    with operation(self._what(step), self.kept):
      # Orbax writes the step's folder and metadata before it returns: a
      # hung store holds the start too.
      if self._bounded(step, start):
        self.pending = step

  def finish(self):
    """Waits for the pending save; raises its failure."""
    if self.pending is not None:
      self._outcome()
