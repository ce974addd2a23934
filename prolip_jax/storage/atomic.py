"""Whole-or-nothing outputs: files and folders that appear complete or not
at all, with the modes the umask asks for.

An export or an import is built in a staging folder beside its target
(``.NAME.partial-PID-XXXX``: same file system, so the final rename is
atomic) and moved into place in one step; a process killed at any point
leaves the old target or the new one, never a mix. Staging folders of dead
processes are removed by the next writer of the same target.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import tempfile
from typing import Iterator

_PARTIAL = '.partial-'
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def umask() -> int:
  """The process umask (read without changing it for good)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def fix_modes(path: str):
  """Gives ``path`` (and everything under it) the modes a plain ``open``/
  ``mkdir`` would have under the current umask: files 0666 & ~umask,
  folders 0777 & ~umask (``tempfile`` creates 0600/0700, e.g. safetensors'
  writer and ``mkdtemp``)."""
  mask = umask()
  os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)
  for root, dirs, files in os.walk(path):
    for d in dirs:
      os.chmod(os.path.join(root, d), 0o777 & ~mask)
    for f in files:
      full = os.path.join(root, f)
      if not os.path.islink(full):
        os.chmod(full, 0o666 & ~mask)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def remove_stale(target: str):
  """Removes staging folders of ``target`` left by processes that died."""
  parent = os.path.dirname(os.path.abspath(target))
  prefix = f'.{os.path.basename(os.path.abspath(target))}{_PARTIAL}'
  if not os.path.isdir(parent):
    return
  for name in os.listdir(parent):
    if not name.startswith(prefix):
      continue
    pid = name[len(prefix):].split('-', 1)[0]
    if pid.isdigit() and not _alive(int(pid)):
      shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


@contextlib.contextmanager
def staging_dir(target: str) -> Iterator[str]:
  """A new empty folder beside ``target`` to build its contents in; removed
  when the block raises (or was not moved into place by ``replace_dir``)."""
  target = os.path.abspath(target)
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  remove_stale(target)
  tmp = tempfile.mkdtemp(
      dir=parent, prefix=f'.{os.path.basename(target)}{_PARTIAL}{os.getpid()}-')
  try:
    yield tmp
  finally:
    if os.path.exists(tmp):
      shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths (Linux ``renameat2(RENAME_EXCHANGE)``);
  False where the system cannot."""
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c'), use_errno=True)
    fn = libc.renameat2
  except (OSError, AttributeError, TypeError):
    return False
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                 ctypes.c_char_p, ctypes.c_uint]
  if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
        _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
    return False  # not supported by this system or file system
  raise OSError(err, os.strerror(err), a, None, b)


def replace_dir(staged: str, target: str):
  """Moves the folder ``staged`` to ``target`` in one step, replacing a
  folder already there whole (its old contents are deleted after the swap).

  With ``renameat2(RENAME_EXCHANGE)`` (Linux) the swap is atomic: ``target``
  always holds the old folder or the new one. Elsewhere the old folder is
  first renamed aside, a short window where ``target`` is missing.
  """
  fix_modes(staged)
  target = os.path.abspath(target)
  if not os.path.lexists(target):
    os.rename(staged, target)
    return
  if os.path.isdir(target) and not os.path.islink(target) and _exchange(
      staged, target):
    shutil.rmtree(staged, ignore_errors=True)  # now holds the old contents
    return
  aside = staged + '-old'
  os.rename(target, aside)
  os.rename(staged, target)
  shutil.rmtree(aside, ignore_errors=True)
