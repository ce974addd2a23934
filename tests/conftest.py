"""Test set-up: eight host CPU devices, before anything imports JAX."""

import os

os.environ.setdefault('XLA_FLAGS', '')
if '--xla_force_host_platform_device_count' not in os.environ['XLA_FLAGS']:
  os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# Every JAX program the suite compiles, in this process and in the
# processes tests start (``prolip_jax.main`` and the tools, dozens of them on
# the same small configs), goes through one persistent compilation cache for
# the session: a repeated program loads instead of compiling again (a 4-step
# micro run 16.5 s -> 7.8 s; the in-process training tests 227 s -> 181 s).
# Set before JAX is imported, which reads these once.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  import atexit  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  _CACHE = tempfile.mkdtemp(prefix='prolip_jax-test-jax-cache-')
  atexit.register(shutil.rmtree, _CACHE, True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'

# As prolip_jax.main on a CPU: XLA's freed step buffers stay in the heap
# for the next step (host_memory.py); before JAX starts its threads.
from prolip_jax import host_memory  # pylint: disable=g-import-not-at-top,wrong-import-position
host_memory.keep_freed_memory()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update('jax_default_matmul_precision', 'highest')

# grain defines its absl flags (grain_py_*) once, when first imported, and
# reads them while iterating; imported here, before any test, they are not
# among the flags _fresh_absl_flags drops after the test that first imports
# grain (a later training test would find them gone).
import grain  # pylint: disable=g-import-not-at-top,wrong-import-position
del grain  # imported for its flags only


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


# The suite's shared fixtures (``workdir``, ``tokenizers``, the export and
# import tools): imported after the set-up above, as every test module is.
# (Not 'fixtures': pytest's own fixtures plugin is registered by that name,
# and a second plugin of one name is silently skipped.)
pytest_plugins = ('shared_fixtures',)


def pytest_collection_modifyitems(config, items):
  """A ``timing`` or ``waits`` test is also ``slow``: CI runs the timing
  step and the waits lane of the slow tier only (.ci/run's
  ``parallel_tier``), so a fast one would never run there."""
  del config
  for marker in ('timing', 'waits'):
    fast = [item.nodeid for item in items
            if item.get_closest_marker(marker) is not None
            and item.get_closest_marker('slow') is None]
    if fast:
      raise pytest.UsageError(
          f'tests marked {marker} must be marked slow too: {fast}')
