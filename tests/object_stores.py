"""Real object-store servers on 127.0.0.1 for the tests: a GCS JSON-API
server (gcp-storage-emulator, with the generation headers and upload
preconditions of real GCS added by ``gcs_server.py``) and an S3 server
(moto in server mode).

Each is started once per test session on a free port; ``env`` holds the
variables that route the standard clients to it (gcsfs and etils.epath,
TensorStore's gcs driver that Orbax uses, boto/s3fs), which is all a real
bucket replaces with credentials (docs/training.md).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import urllib.request

GCS_BUCKET = 'prolip-test'
S3_BUCKET = 'prolip-test'


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _log_file(name: str):
  """Where a server's output goes: a file, never a pipe (a pipe nobody reads
  fills up and stalls the server mid-response)."""
  return tempfile.NamedTemporaryFile(prefix=f'{name}-', suffix='.log',
                                     delete=False)


def _wait(url: str, proc: subprocess.Popen, what: str, timeout: float = 60):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      with open(proc.args_log) as f:
        raise RuntimeError(f'{what} exited with {proc.returncode}: '
                           f'{f.read()[-2000:]}')
    try:
      urllib.request.urlopen(url, timeout=2)
      return
    except urllib.error.HTTPError:
      return  # answering (an error page is an answer)
    except OSError:
      time.sleep(0.2)
  raise RuntimeError(f'{what} did not answer at {url} in {timeout} s')


class Server:
  """One running server: ``env`` routes clients to it, ``url(prefix)``
  gives a fresh ``gs://``/``s3://`` prefix in its bucket."""

  def __init__(self, scheme: str, bucket: str, proc: subprocess.Popen,
               env: dict[str, str]):
    self.scheme, self.bucket, self.proc, self.env = scheme, bucket, proc, env

  def url(self, name: str = 'run') -> str:
    return f'{self.scheme}://{self.bucket}/{uuid.uuid4().hex[:10]}/{name}'

  def stop(self):
    stop(self.proc)


def stop(proc: subprocess.Popen):
  """Ends a server process (SIGTERM, then SIGKILL after 10 s) and removes
  its log, which is only read while it starts (``_wait``)."""
  proc.terminate()
  try:
    proc.wait(10)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  log = getattr(proc, 'args_log', None)
  if log:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(log)


def start_gcs() -> Server:
  port = free_port()
  log = _log_file('gcs-server')
  proc = subprocess.Popen(
      [sys.executable, os.path.join(os.path.dirname(__file__), 'gcs_server.py'),
       'start',
       '--host=127.0.0.1', f'--port={port}', '--in-memory',
       f'--default-bucket={GCS_BUCKET}'],
      stdout=log, stderr=subprocess.STDOUT)
  proc.args_log = log.name
  url = f'http://127.0.0.1:{port}'
  _wait(url + f'/storage/v1/b/{GCS_BUCKET}', proc, 'gcp-storage-emulator')
  env = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
         # Without credentials gcsfs's newer client would first probe the
         # bucket's layout over gRPC (a warning per call); the emulator is a
         # plain bucket.
         'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false'}
  return Server('gs', GCS_BUCKET, proc, env)


def start_s3() -> Server:
  port = free_port()
  log = _log_file('s3-server')
  exe = os.path.join(os.path.dirname(sys.executable), 'moto_server')
  proc = subprocess.Popen(
      [exe if os.path.exists(exe) else 'moto_server', '-H', '127.0.0.1',
       '-p', str(port)],
      stdout=log, stderr=subprocess.STDOUT)
  proc.args_log = log.name
  url = f'http://127.0.0.1:{port}'
  _wait(url, proc, 'moto_server')
  env = {'AWS_ENDPOINT_URL': url, 'AWS_ACCESS_KEY_ID': 'testing',
         'AWS_SECRET_ACCESS_KEY': 'testing', 'AWS_DEFAULT_REGION': 'us-east-1'}
  with _environ(env):
    import boto3  # pylint: disable=g-import-not-at-top
    boto3.client('s3', endpoint_url=url).create_bucket(Bucket=S3_BUCKET)
  return Server('s3', S3_BUCKET, proc, env)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
  saved = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
