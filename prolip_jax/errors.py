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
     command again to resume (75 is ``EX_TEMPFAIL`` of sysexits.h);
  1  a bug: a traceback is printed.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Iterable, Iterator

EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75


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
