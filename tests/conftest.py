"""Test set-up: eight host CPU devices, before anything imports JAX."""

import os

os.environ.setdefault('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update('jax_default_matmul_precision', 'highest')


@pytest.fixture(autouse=True)
def _fresh_absl_flags():
  """Commands (``main.run``, ``aot.run``, ``evaluate``) define absl flags,
  including their ``--config.KEY`` overrides, once per process; drop the
  flags a test defined so the next test parses its command line afresh."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  before = set(flags.FLAGS)
  yield
  for name in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, name)


@pytest.fixture(autouse=True)
def _restored_environment():
  """A test that changes ``os.environ`` (directly or through the code it
  calls) must not change it for the processes later tests start."""
  saved = dict(os.environ)
  yield
  saved.update(_SERVER_ENV)  # servers started during the test stay routed
  if dict(os.environ) != saved:
    os.environ.clear()
    os.environ.update(saved)


# The variables routing clients to the object-store servers of this session.
_SERVER_ENV: dict[str, str] = {}


def _object_store(start):
  import object_stores  # pylint: disable=g-import-not-at-top
  server = getattr(object_stores, start)()
  _SERVER_ENV.update(server.env)
  os.environ.update(server.env)  # in-process clients (gcsfs, TensorStore)
  return server


@pytest.fixture(scope='session')
def gcs():
  """A GCS JSON-API server on 127.0.0.1 (``tests/object_stores.py``) for
  the whole session; its variables are set in this process, and
  ``gcs.env`` is for the processes a test starts."""
  server = _object_store('start_gcs')
  yield server
  server.stop()


@pytest.fixture(scope='session')
def s3():
  """An S3 server on 127.0.0.1 (moto), like ``gcs``."""
  server = _object_store('start_s3')
  yield server
  server.stop()
