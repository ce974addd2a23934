"""SIGTERM and Ctrl-C that arrive while ``prolip_jax.main`` starts, before
the run's ``progress.StopFlag`` exists.

Python's own Ctrl-C is a ``KeyboardInterrupt`` raised wherever the main
thread is. While JAX is imported that can be inside a garbage-collector
callback, which swallows it ("Exception ignored in _xla_gc_callback") and
the run then trains to the end as if nothing happened (measured). So
``record_early`` (called first thing by ``prolip_jax.main``, before the
heavy imports) installs handlers that only remember the signal;
``StopFlag`` takes it over and stops before the first step. Standard
library only: importing this must be instant.
"""

from __future__ import annotations

import os
import signal

# 'ending': set once the run's StopFlag stopped and gave the signals back
# (``stopped``); kept apart from 'stop', which the next run of this process
# reads (``early``).
_FRESH = {'stop': False, 'interrupted': False, 'ending': None}
_early = dict(_FRESH)


def _remember(signum, frame):
  del frame
  if _early['stop'] or _early['ending']:  # a second one: leave at once
    what = 'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'
    how = (_early['ending']
           or 'while starting: left at once, nothing new to save')
    os.write(2, f'interrupted ({what} twice) {how}\n'.encode())
    os._exit(130 if signum == signal.SIGINT else 75)  # errors.EXIT_*
  _early['stop'] = True
  if signum == signal.SIGINT:
    _early['interrupted'] = True
    os.write(2, b'Ctrl-C: stopping once start-up is done (Ctrl-C again to '
             b'leave at once)\n')


def record_early():
  """Remembers SIGTERM and the first Ctrl-C from now until a ``StopFlag``
  takes them over (main thread only)."""
  _early.update(_FRESH)
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, _remember)


def stopped(second: str):
  """The run's ``StopFlag`` stopped and gives the signals back: from now
  on a Ctrl-C or SIGTERM leaves at once, with the line ``interrupted
  (Ctrl-C twice) <second>`` (the run is ending; it never restarts the
  start-up's wait). The next run of this process still starts unstopped
  (``early``)."""
  _early['ending'] = second


def early() -> tuple[bool, bool]:
  """``(stop, interrupted)``: a SIGTERM or Ctrl-C came before the run's
  ``StopFlag`` existed (``interrupted``: one was a Ctrl-C)."""
  return _early['stop'], _early['interrupted']
