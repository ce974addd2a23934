"""Folders a command may write into: missing, empty, or holding only what
a command of ours wrote there.

No command replaces or deletes a file it did not write. Each output folder
keeps a record of what it holds: an export its manifest
(``interop/manifest.py``), an evaluation report ``REPORT_RECORD``
(``evaluation/runner.py``), a training workdir ``RUN_MARKER``
(``storage/workdir.py``). A command reads its record, lists the folder
(``entries``) and refuses in one line (``refusal``) when anything there is
not listed, before it writes anything.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from prolip_jax import errors
from prolip_jax.storage import paths

# What ``python -m prolip_jax.evaluate`` records in its --out folder: every
# file a report wrote there (written before the files it lists).
REPORT_RECORD = 'prolip_jax_eval_files.json'


def entries(directory) -> list[str]:
  """What ``directory`` holds, sorted: locally its entries (a folder's name
  ends in ``/``), on an object store the relative path of every object
  under the prefix; [] when it does not exist."""
  path = paths.as_path(directory)
  if paths.is_remote(path):
    return paths.files_under(path)
  local = os.fspath(path)
  if not os.path.isdir(local):
    return []
  return sorted(n + '/' if os.path.isdir(os.path.join(local, n)) else n
                for n in os.listdir(local))


def partial_write(name: str) -> bool:
  """True for the temporary file of a whole-file write (``paths.write_bytes``:
  ``.NAME.partial-XXXX``) that a kill left behind: a command's own, never
  a reason to refuse its folder."""
  return name.startswith('.') and '.partial-' in name and '/' not in name


def listed(directory, record: str) -> Optional[list[str]]:
  """The names the record file ``directory/record`` lists (``{"files":
  [...]}`` or ``{"files": {name: ...}}``), or None when it is absent or
  unreadable."""
  path = paths.as_path(directory) / record
  try:
    files = json.loads(paths.read_text(path))['files']
  except (OSError, ValueError, KeyError, TypeError):
    return None
  if isinstance(files, dict):
    files = list(files)
  return [n for n in files if isinstance(n, str)] if isinstance(
      files, list) else None


def write_record(directory, record: str, names):
  """Writes ``directory/record`` listing ``names`` (whole, local or
  remote)."""
  paths.write_text(paths.as_path(directory) / record,
                   json.dumps({'format': 1, 'files': sorted(set(names))},
                              indent=1))


def refusal(flag: str, directory, foreign: list[str], what: str,
            why: str) -> errors.UserError:
  """The one-line error for a folder holding ``foreign`` entries: ``flag``
  names the option (``--out``), ``what`` the kind of folder it would have
  to be (``an evaluation report of ours``), ``why`` how ours are known."""
  more = f' and {len(foreign) - 5} more' if len(foreign) > 5 else ''
  return errors.UserError(
      f'{flag} {directory} is not {what}: it holds '
      f'{", ".join(foreign[:5])}{more} ({why}); no command replaces or '
      'deletes what it did not write: choose a new or empty folder, or '
      'move those away')
