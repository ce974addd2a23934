"""What every command line of the package shares before it runs: the config
file an argv names, its overrides checked against the config's keys, stray
arguments refused, the CPU asked for directly on a machine without
accelerators (so the TPU runtime prints no warnings about a missing TPU),
and XLA's CPU thread pool sized so that a run's bits do not depend on the
CPUs it may use."""

from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

from absl import flags
from ml_collections import config_flags

from prolip_jax import errors

# The config of ``python -m prolip_jax.main`` (and ``prolip_jax.aot``)
# without --config: the embedded CPU demo.
DEFAULT_TRAINING_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
    'prolip_tiny.py')


def config_path(argv: Sequence[str], default: Optional[str]) -> Optional[str]:
  """The config file ``argv`` names (the last one, as flags go), else
  ``default``."""
  path = default
  for i, arg in enumerate(argv):
    if arg.startswith('--config='):
      path = arg.split('=', 1)[1]
    elif arg == '--config' and i + 1 < len(argv):
      path = argv[i + 1]
  return path


def check_overrides(argv: Sequence[str], keys: Iterable[str], where: str):
  """Raises ``errors.UserError`` for a ``--config.KEY=...`` of ``argv`` whose
  key is not one of ``keys`` (the config's dotted keys) nor a prefix of
  one: one line with the nearest key, before absl's parser would report it
  (a multi-line message with escaped quotes)."""
  keys = list(keys)
  for arg in argv[1:]:
    if not arg.startswith('--config.'):
      continue
    key = arg[len('--config.'):].split('=', 1)[0]
    if key not in keys and not any(k.startswith(key + '.') for k in keys):
      raise errors.UserError(f'unknown config key {key!r}'
                             f'{errors.nearest(key, keys)}; {where}')


# How a command line writes None ('none': ml_collections' own spelling).
_NONE = ('None', 'none')


def none_overrides(argv: Sequence[str], allowed: Iterable[str]
                   ) -> tuple[list[str], list[str]]:
  """``(argv without its None overrides, their keys)``: the
  ``--config.KEY=None`` (or ``--config.KEY None``) of each key in ``allowed``
  (declared ``none_allowed``) whose last override is None. absl's parser
  reads an override as the type of the key's default (an int has no None),
  so these are set after it ran."""
  allowed = set(allowed)
  kept, last = [], {}
  i = 0
  while i < len(argv):
    arg = argv[i]
    key, eq, value = arg[len('--config.'):].partition('=')
    taken = 1
    if arg.startswith('--config.') and key in allowed:
      if not eq and i + 1 < len(argv):  # --config.KEY VALUE
        value, taken = argv[i + 1], 2
      last[key] = value in _NONE
      if last[key]:
        i += taken
        continue
    kept.extend(argv[i:i + taken])
    i += taken
  return kept, [key for key, is_none in last.items() if is_none]


def refuse_positional(rest: Sequence[str]):
  """Raises ``errors.UserError`` for arguments absl left unparsed (``rest``
  without the program name): a config path without ``--config`` would
  otherwise be ignored and the default config run."""
  if not rest:
    return
  first = rest[0]
  hint = (f'; a config file goes as --config={first}'
          if first.endswith('.py') else '')
  raise errors.UserError(f'unexpected argument{"s" if len(rest) > 1 else ""} '
                         f'{" ".join(rest)}{hint}')


# XLA:CPU splits some sums (YNNPACK reductions and contractions, Eigen
# contractions) into as many parts as its intra-op thread pool has threads,
# so the rounding of a run depends on the pool's size. XLA sizes the pool by
# the CPUs the process may run on (its affinity: taskset, a container's
# cpuset) unless this variable names a size (XLA reads it when it creates
# the pool; tests/test_determinism.py checks that it still does). The emoji
# demo run under `taskset -c 0` first differed from the same run on both
# cores at step 3 (in the loss's last bit), which 600 steps carried to every
# figure of the report.
CPU_POOL_ENV = 'NPROC'


def pin_cpu_thread_pool():
  """Sizes XLA's CPU thread pool by the machine's CPU count
  (``os.cpu_count()``), not by the CPUs this process may use now, so that a
  run computes the same bits on a machine whatever its affinity or load.
  Called before JAX starts its CPU backend (later it changes nothing); a
  size the user set in ``NPROC`` is kept (in a container confined to a few
  of a large host's CPUs, a pool of every CPU oversubscribes them: 32
  threads on 2 cores made the emoji step 1.1-2.6x slower)."""
  if CPU_POOL_ENV not in os.environ:
    os.environ[CPU_POOL_ENV] = str(os.cpu_count() or 1)


def cpu_only_without_accelerators():
  """On a machine with neither TPU chips nor an NVIDIA GPU but with libtpu
  installed (the ``tpu`` and ``test`` extras, for ``prolip_jax.aot``), jax
  would start the TPU runtime, which prints warnings about the missing TPU
  before jax falls back to the CPU: ask for the CPU directly. An explicit
  ``JAX_PLATFORMS`` is left alone."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  if 'JAX_PLATFORMS' in os.environ or importlib.util.find_spec(
      'libtpu') is None:
    return
  try:  # jax's own detection (private: a later jax may move it)
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    no_accelerator = (
        hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0
        and not hardware_utils.has_visible_nvidia_gpu())
  except (ImportError, AttributeError):
    return  # then jax decides, warnings and all
  if no_accelerator:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update('jax_platforms', 'cpu')  # jax has read the env already


def define_training_flags(argv: Sequence[str]):
  """Defines the flags; the config flag reads its file and the overrides in
  ``argv`` at definition."""
  if 'config' in flags.FLAGS:
    return
  config_flags.DEFINE_config_file(
      'config', DEFAULT_TRAINING_CONFIG, 'Training configuration file.',
      lock_config=True, sys_argv=argv)
  flags.DEFINE_string('workdir', 'workdirs/prolip_tiny',
                      'Checkpoints, tokenizer, metrics and TensorBoard files.')
  flags.DEFINE_string('coordinator_address', None,
                      'host:port of process 0 for multi-host runs without '
                      'auto-detection (TPU and SLURM are detected).')
  flags.DEFINE_integer('num_processes', None, 'Number of processes (hosts).')
  flags.DEFINE_integer('process_id', None, 'This process index.')
  flags.DEFINE_bool('print_config', False, 'Print every config key with its '
                    'value and meaning, then exit.')
  flags.DEFINE_bool('debug', False, 'Show the traceback of user errors too '
                    '(also PROLIP_DEBUG=1).')
  flags.DEFINE_bool('allow_fresh_start', False, 'Train from step 0 although '
                    'checkpoints_unreadable/ holds steps set aside by an '
                    'earlier run (refused otherwise).')


def parse_training_config(argv: Sequence[str]):
  """The training config of ``argv`` (``python -m prolip_jax.main``'s and
  ``prolip_jax.aot``'s flags, defining them first); raises ``UserError``
  with a one-line reason."""
  from prolip_jax.config import help as config_help  # pylint: disable=g-import-not-at-top
  from prolip_jax.config import keys as config_keys  # pylint: disable=g-import-not-at-top
  from prolip_jax.config import presets  # pylint: disable=g-import-not-at-top
  path = config_path(argv, DEFAULT_TRAINING_CONFIG)
  if not os.path.isfile(path):
    raise errors.UserError(f'config file {path!r} not found')
  try:
    keys = config_help.flatten(presets.load_config_file(path))
  except Exception as e:  # the user's file: report it, don't trace us
    raise errors.UserError(f'config file {path!r} failed to load: '
                           f'{type(e).__name__}: {e}') from e
  check_overrides(argv, keys, '--print_config lists them')
  argv, to_none = none_overrides(argv, (
      k for k, d in config_keys.KEYS.items() if d.none_allowed))
  try:
    define_training_flags(argv)
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    raise errors.UserError(str(e)) from e
  refuse_positional(rest[1:])
  config = flags.FLAGS.config
  for key in to_none:  # e.g. keep_checkpoints=None: keep every one
    *parents, last = key.split('.')
    node = config
    for part in parents:
      node = node[part]
    node[last] = None
  return config
