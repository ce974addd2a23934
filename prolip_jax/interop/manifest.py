"""An export's manifest: ``prolip_jax_manifest.json``, written last.

It lists every file of the export with its size and sha256. On an object
store, where a folder cannot be swapped in whole, the manifest is what makes
an export whole: it is removed before a re-export uploads anything and
written after every other file, so ``load`` (which requires it there) sees
a complete export or refuses in one line. Locally the folder is swapped in
whole anyway, and the manifest lets ``load`` catch damaged bytes (a flipped
bit in ``model.safetensors``) before they become NaN embeddings.

The manifest is also how an export recognises a folder it may replace
(``foreign``): only files that an export of ours wrote are ever deleted or
overwritten. On an object store a re-export first records every file it is
about to replace or write in ``PENDING_FILE`` and removes that record last,
so an upload cut short is still recognised as ours by the next export.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional

from prolip_jax import errors
from prolip_jax.storage import owned
from prolip_jax.storage import paths

MANIFEST_FILE = 'prolip_jax_manifest.json'
PENDING_FILE = 'prolip_jax_export_pending.json'


class ExportIncompleteError(errors.CheckpointError):
  """An export whose files do not match its manifest (or, on an object
  store, that has none)."""


def build(local_dir: str) -> dict[str, Any]:
  """The manifest of the files in the local folder ``local_dir``."""
  files = {}
  for name in sorted(os.listdir(local_dir)):
    full = os.path.join(local_dir, name)
    if name == MANIFEST_FILE or not os.path.isfile(full):
      continue
    files[name] = {'bytes': os.path.getsize(full),
                   'sha256': paths.sha256(full)}
  return {'format': 1, 'files': files}


def write(local_dir: str) -> dict[str, Any]:
  """Writes ``local_dir/MANIFEST_FILE`` for the files beside it."""
  manifest = build(local_dir)
  paths.write_text(os.path.join(local_dir, MANIFEST_FILE),
                   json.dumps(manifest, indent=1))
  return manifest


def read(directory) -> dict[str, Any] | None:
  """The manifest of ``directory`` (local or remote), or None if absent."""
  path = paths.as_path(directory) / MANIFEST_FILE
  if not path.exists():
    return None
  try:
    manifest = json.loads(paths.read_text(path))
    files = manifest['files']
    assert isinstance(files, dict)
  except (ValueError, KeyError, TypeError, AssertionError) as e:
    raise ExportIncompleteError(f'{path} is not a manifest ({e})') from e
  return manifest


def verify(local_dir: str, manifest: dict[str, Any], where: str,
           names: Optional[Iterable[str]] = None):
  """Raises ``ExportIncompleteError`` naming the first file of
  ``manifest`` (or of ``names`` among them) that is missing from
  ``local_dir`` or differs in size or sha256; ``where`` names the export in
  the message."""
  listed = manifest['files']
  chosen = listed if names is None else [n for n in names if n in listed]
  for name in chosen:
    want = listed[name]
    full = os.path.join(local_dir, name)
    if not os.path.isfile(full):
      raise _missing(where, name)
    size = os.path.getsize(full)
    if size != want.get('bytes') or paths.sha256(full) != want.get('sha256'):
      raise ExportIncompleteError(
          f'{where}: {name} differs from the manifest ({size} bytes, '
          f'manifest {want.get("bytes")}; damaged or replaced bytes): '
          'export again or restore the file')


def _missing(where, name: str) -> ExportIncompleteError:
  return ExportIncompleteError(f'{where}: {name} is missing (the manifest '
                               'lists it): export again')


def download(remote, local_dir: str) -> dict[str, Any]:
  """Downloads the files an object-store export's manifest lists into
  ``local_dir`` and checks them; an export with no manifest (an upload
  still running, or cut short) is refused."""
  manifest = read(remote)
  if manifest is None:
    raise ExportIncompleteError(
        f'{remote} has no {MANIFEST_FILE}: the export is incomplete (an '
        'upload still running or cut short) or was not written by '
        'tools/export_pytorch.py; export again')
  src = paths.as_path(remote)
  for name in manifest['files']:
    if '/' in name or name in ('.', '..'):
      raise ExportIncompleteError(f'{remote}: manifest names {name!r}')
    try:
      paths.copy_file(src / name, os.path.join(local_dir, name))
    except FileNotFoundError as e:
      if (src / name).exists():  # the bucket or the local folder went away
        raise
      raise _missing(remote, name) from e
  verify(local_dir, manifest, str(remote))
  return manifest


def entries(directory) -> list[str]:
  """What ``directory`` holds (``owned.entries``)."""
  return owned.entries(directory)


def write_pending(directory, names: Iterable[str]):
  """Records in ``directory/PENDING_FILE`` the files an export is about to
  replace or write there (object stores: see the module's docstring)."""
  owned.write_record(directory, PENDING_FILE, names)


def _pending(directory) -> Optional[list[str]]:
  """The names ``directory/PENDING_FILE`` records, or None."""
  return owned.listed(directory, PENDING_FILE)


def foreign(directory) -> tuple[list[str], str]:
  """The entries of ``directory`` that no export of ours wrote, and why
  they count as foreign; ``([], '')`` when it is missing, empty, or holds
  nothing but an export's files: those its manifest lists (with the
  manifest itself) or, after an upload cut short, those its pending record
  lists. A file that a manifest lists but that is missing is no reason to
  refuse: only what is there could be lost."""
  present = entries(directory)
  if not present:
    return [], ''
  ours: set[str] = set()
  why = f'no {MANIFEST_FILE} lists them'
  try:
    listed = read(directory)
  except ExportIncompleteError:
    listed, why = None, f'its {MANIFEST_FILE} cannot be read'
  if listed is not None:
    ours |= set(listed['files']) | {MANIFEST_FILE}
    why = f'its {MANIFEST_FILE} does not list them'
  pending = _pending(directory)
  if pending is not None:
    ours |= set(pending) | {PENDING_FILE, MANIFEST_FILE}
  return [n for n in present if n not in ours], why
