"""Whole-or-nothing outputs: files and folders that appear complete or not
at all, with the modes the umask asks for.

An export or an import is built in a staging folder beside its target
(``.NAME.partial-PID-XXXX``: same file system, so the final rename is
atomic) and moved into place in one step; a process killed at any point
leaves the old target or the new one, never a mix. Staging folders of dead
processes are removed by the next writer of the same target.

A target that is a symbolic link stands for the folder it points to: that
folder is replaced and the link stays a link (``resolve``).
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


def resolve(target: str) -> str:
  """The absolute path ``target`` stands for: where a symbolic link (or a
  chain of them) points, else ``target`` itself. Replacing the link itself
  would turn it into a folder and leave the folder it pointed to behind."""
  return os.path.realpath(os.path.abspath(target))


def _remove(path: str):
  """Removes a folder, or a file or link (``rmtree`` refuses a link)."""
  if os.path.islink(path) or not os.path.isdir(path):
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)
  else:
    shutil.rmtree(path, ignore_errors=True)


def remove_stale(target: str):
  """Removes staging folders of ``target`` (a link's, and those of the
  folder it points to) left by processes that died."""
  for path in {os.path.abspath(target), resolve(target)}:
    parent = os.path.dirname(path)
    prefix = f'.{os.path.basename(path)}{_PARTIAL}'
    if not os.path.isdir(parent):
      continue
    for name in os.listdir(parent):
      if not name.startswith(prefix):
        continue
      pid = name[len(prefix):].split('-', 1)[0]
      if pid.isdigit() and not _alive(int(pid)):
        _remove(os.path.join(parent, name))


@contextlib.contextmanager
def staging_dir(target: str) -> Iterator[str]:
  """A new empty folder beside ``target`` to build its contents in; removed
  when the block raises (or was not moved into place by ``replace_dir``);
  beside the folder a link ``target`` points to (``resolve``)."""
  remove_stale(target)  # the link's own name too
  target = resolve(target)
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
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
  first renamed aside, a short window where ``target`` is missing. A
  ``target`` that is a link: the folder it points to is replaced
  (``resolve``), the link left as it is.
  """
  fix_modes(staged)
  target = resolve(target)
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
  _remove(aside)
