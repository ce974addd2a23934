"""The one path layer: local paths, ``gs://`` and ``s3://``, through
``etils.epath`` (the layer Orbax itself uses).

Every file a command reads or writes in a workdir, an export or an import
goes through here, so a bucket URL is never mistaken for a local folder
(``./gs:/BUCKET``). What whole-or-nothing means on each kind of storage:

- local: a temporary file beside the target, renamed over it;
- object stores: an object is written whole in one upload (there is no
  partial object to see) and folders cannot be renamed, so multi-file
  outputs are made whole by a marker written last (Orbax's commit marker for
  checkpoints, an export's manifest) and a create-if-absent object
  (``create_exclusive``: a generation precondition on GCS, ``If-None-Match``
  on S3) is the workdir lock (docs/reliability.md).

The object-store clients (gcsfs for ``gs://``, s3fs for ``s3://``) are
imported lazily; a missing one is one line naming the package to install.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import os
import posixpath
import re
import shutil
import tempfile
from typing import Iterator, Union

from etils import epath

from prolip_jax import errors

Path = epath.Path
PathLike = Union[str, os.PathLike]

def _no_listing_cache():
  """Object stores are listed afresh every time: gcsfs and s3fs keep a
  directory listing forever by default, and a process (or Orbax, through
  epath) would not see the checkpoints TensorStore or another host wrote
  after its first listing."""
  try:
    import fsspec.config  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  for protocol in ('gs', 'gcs', 's3', 's3a'):
    fsspec.config.conf.setdefault(protocol, {})['use_listings_cache'] = False


_no_listing_cache()

# URL scheme -> (the fsspec package that reads it, its pip name).
_CLIENTS = {'gs': ('gcsfs', 'gcsfs'), 's3': ('s3fs', 's3fs')}
_URL = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://')


def scheme(path: PathLike) -> str:
  """``'gs'``, ``'s3'``, another URL scheme, or ``''`` for a local path."""
  match = _URL.match(os.fspath(path))
  return match.group(1).lower() if match else ''


def is_remote(path: PathLike) -> bool:
  """True for an object-store URL (``gs://``, ``s3://``)."""
  return scheme(path) in _CLIENTS


def parse(text: PathLike, what: str = 'path') -> Path:
  """``text`` as an ``epath.Path``: a local path (made absolute) or a
  ``gs://BUCKET/...`` / ``s3://BUCKET/...`` URL.

  Raises ``errors.UserError`` (one line naming ``what`` and the URL) for
  an empty path, any other URL scheme (``hdfs://``, ``gcs://``, ``file://``
  ...), a URL without a bucket, or an object-store client that is not
  installed.
  """
  text = os.fspath(text)
  if not text.strip():
    raise errors.UserError(f'{what} is empty: give a local path, '
                           'gs://BUCKET/... or s3://BUCKET/...')
  kind = scheme(text)
  if not kind:
    return epath.Path(os.path.abspath(os.path.expanduser(text)))
  if kind not in _CLIENTS:
    raise errors.UserError(
        f'{what} {text!r}: URL scheme {kind}:// is not supported; use a '
        'local path (a mounted bucket works too), gs://BUCKET/... or '
        's3://BUCKET/...')
  url = _normal_url(kind, text, what)
  module, package = _CLIENTS[kind]
  try:
    __import__(module)
  except ImportError as e:
    raise errors.UserError(
        f'{what} {text!r} needs the {package} package: pip install '
        f'{package}') from e
  return epath.Path(url)


def _normal_url(kind: str, text: str, what: str) -> str:
  """``kind://BUCKET/NAME`` for the URL ``text`` of scheme ``kind``: the
  scheme in lower case (RFC 3986: it is case-insensitive; etils.epath knows
  only ``gs://`` and ``s3://``), the bucket as given, and ``.``, ``..`` and
  ``//`` in the object's name resolved as a local path's would be (a store
  would keep them as literal parts of the name). Raises ``errors.UserError``
  for no bucket, or a ``..`` that climbs above the bucket."""
  bucket, _, name = text[len(kind) + 3:].partition('/')
  if not bucket:
    raise errors.UserError(f'{what} {text!r} names no bucket '
                           f'({kind}://BUCKET/...)')
  name = posixpath.normpath(name.lstrip('/')) if name.strip('/') else '.'
  if name == '..' or name.startswith('../'):
    raise errors.UserError(f"{what} {text!r}: '..' climbs above the bucket "
                           f'{bucket}')
  return f'{kind}://{bucket}' + ('' if name == '.' else f'/{name}')


# Data is read from local files (Grain's array_record reader, TFDS's data
# sources and PIL open paths); on a pod the bucket is mounted.
MOUNT_ROUTE = ('mount the bucket and give its local path (Cloud Storage '
               'FUSE: gcsfuse --implicit-dirs BUCKET /mnt/BUCKET; S3: '
               'mount-s3 BUCKET /mnt/BUCKET), as MaxText does for '
               'array_record: docs/data.md')


def require_local(path: PathLike, what: str):
  """Raises ``errors.ConfigError`` (one line naming ``what`` and the
  supported route) when a data path is a URL: training and evaluation data
  are read from local (or mounted) files."""
  text_ = os.fspath(path)
  if scheme(text_):
    raise errors.ConfigError(f'{what} {text_!r} is a URL; data is read from '
                             f'local files: {MOUNT_ROUTE}')


def as_path(path: PathLike) -> Path:
  """An ``epath.Path`` for ``path`` (already checked by ``parse``)."""
  return path if isinstance(path, epath.Path) else parse(path)


def join(path: PathLike, *parts: str) -> str:
  """``path/part/...`` as a string, for local paths and URLs alike."""
  return os.fspath(as_path(path).joinpath(*parts))


def write_bytes(path: PathLike, data: bytes):
  """Writes ``path`` whole: locally through a temporary file renamed over
  it (with the modes a plain ``open`` would give), on an object store as
  one upload (an object is never seen half written)."""
  path = as_path(path)
  if is_remote(path):
    path.write_bytes(data)
    return
  from prolip_jax.storage import atomic  # pylint: disable=g-import-not-at-top
  local = os.fspath(path)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(local),
                             prefix=f'.{os.path.basename(local)}.partial-')
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~atomic.umask())
    os.replace(tmp, local)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_text(path: PathLike, content: str):
  """``write_bytes`` of UTF-8 text."""
  write_bytes(path, content.encode('utf-8'))


def read_bytes(path: PathLike) -> bytes:
  """``path``'s bytes as one version of it: on an object store one request
  (``epath``'s ``read_bytes`` asks an object's size, then reads that many
  bytes, so an object rewritten between the two came back cut short: 182
  of 300 reads of an object another thread kept rewriting, against the GCS
  emulator, 2026-12-07). ``FileNotFoundError`` naming ``path`` when
  absent."""
  path = as_path(path)
  if not is_remote(path):
    with open(os.fspath(path), 'rb') as f:
      return f.read()
  import fsspec  # pylint: disable=g-import-not-at-top
  fs, key = fsspec.core.url_to_fs(os.fspath(path))
  try:
    return fs.cat_file(key)
  except FileNotFoundError:
    pass
  # Raised outside the handler, so with no context: gcsfs's error names its
  # download request, whose 404 the error layer reads as a store's fault
  # ("check that the bucket exists") anywhere in the chain; a missing
  # object is the user's, named by its URL.
  raise FileNotFoundError(errno.ENOENT, 'no such object', os.fspath(path))


def read_text(path: PathLike) -> str:
  """``read_bytes`` as UTF-8 text."""
  return read_bytes(path).decode('utf-8')


def create_exclusive(path: PathLike, data: bytes) -> bool:
  """Creates ``path`` with ``data`` only if it does not exist yet; False if
  it does. Local: ``O_CREAT | O_EXCL``; GCS: an upload with the
  ``ifGenerationMatch=0`` precondition; S3: ``If-None-Match: *``. Two
  writers racing on a real store: exactly one succeeds."""
  path = as_path(path)
  if not is_remote(path):
    try:
      fd = os.open(os.fspath(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                   0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    return True
  if path.exists():
    return False
  import fsspec  # pylint: disable=g-import-not-at-top
  fs, key = fsspec.core.url_to_fs(os.fspath(path))
  try:
    with fs.open(key, 'xb') as f:  # gcsfs/s3fs turn 'x' into the precondition
      f.write(data)
  except FileExistsError:
    return False
  except OSError as e:  # gcsfs reports a failed precondition as HTTP 412
    if '412' in str(e) or 'precondition' in str(e).lower():
      return False
    raise
  return True


def copy_file(src: PathLike, dst: PathLike):
  """Copies one file (any side local or remote); ``dst`` is written whole."""
  write_bytes(dst, read_bytes(src))


def upload_tree(local_dir: PathLike, dst: PathLike,
                last: tuple[str, ...] = ()):
  """Copies every file under the local folder ``local_dir`` to ``dst``
  (local or remote), keeping the relative layout; the files named in
  ``last`` (relative paths) are written after all others, so a marker or
  manifest appears only once everything it vouches for is there."""
  local_dir = os.fspath(local_dir)
  names = []
  for root, _, files in os.walk(local_dir):
    for name in files:
      names.append(os.path.relpath(os.path.join(root, name), local_dir))
  names.sort(key=lambda n: (n in last, n))
  dst = as_path(dst)
  for name in names:
    target = dst.joinpath(*name.split(os.sep))
    if not is_remote(target):
      target.parent.mkdir(parents=True, exist_ok=True)
    copy_file(os.path.join(local_dir, name), target)


def files_under(path: PathLike) -> list[str]:
  """The relative paths (``/``-separated, sorted) of every file under the
  folder or prefix ``path``, local or remote."""
  path = as_path(path)
  if not is_remote(path):
    root = os.fspath(path)
    return sorted(os.path.relpath(os.path.join(d, f), root).replace(os.sep,
                                                                     '/')
                  for d, _, files in os.walk(root) for f in files)
  import fsspec  # pylint: disable=g-import-not-at-top
  fs, key = fsspec.core.url_to_fs(os.fspath(path))
  key = key.rstrip('/')
  # fsspec names objects without the scheme ('bucket/key').
  return sorted(found[len(key) + 1:] for found in fs.find(key)
                if found.startswith(key + '/'))


def copy_tree(src: PathLike, dst: PathLike):
  """Copies every file under ``src`` to ``dst`` (either side local or
  remote), keeping the relative layout."""
  src, dst = as_path(src), as_path(dst)
  for rel in files_under(src):
    target = dst.joinpath(*rel.split('/'))
    if not is_remote(target):
      target.parent.mkdir(parents=True, exist_ok=True)
    copy_file(src.joinpath(*rel.split('/')), target)


def local_copy(path: PathLike) -> str:
  """A local file name for ``path``: the path itself when local, else a
  fresh download, removed when the process ends (for readers that take only
  file names: sentencepiece, tokenizers)."""
  path = as_path(path)
  if not is_remote(path):
    return os.fspath(path)
  folder = tempfile.mkdtemp(prefix='prolip_jax-')
  atexit.register(shutil.rmtree, folder, True)
  local = os.path.join(folder, path.name)
  with open(local, 'wb') as f:
    f.write(read_bytes(path))
  return local


@contextlib.contextmanager
def local_dir_for(path: PathLike) -> Iterator[str]:
  """A local folder whose files end up under ``path``: ``path`` itself when
  local (created), else a temporary folder uploaded there when the block
  ends without an exception."""
  path = as_path(path)
  if not is_remote(path):
    path.mkdir(parents=True, exist_ok=True)
    yield os.fspath(path)
    return
  tmp = tempfile.mkdtemp(prefix='prolip_jax-')
  try:
    yield tmp
    upload_tree(tmp, path)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def sha256(path: PathLike) -> str:
  """The hex sha256 of a file, read in 1 MiB chunks."""
  digest = hashlib.sha256()
  with as_path(path).open('rb') as f:
    for chunk in iter(lambda: f.read(1 << 20), b''):
      digest.update(chunk)
  return digest.hexdigest()
