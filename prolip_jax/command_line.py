"""What every command line of the package shares before it runs: the config
file an argv names, its overrides checked against the config's keys, stray
arguments refused, and the CPU asked for directly on a machine without
accelerators (so the TPU runtime prints no warnings about a missing TPU)."""

from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

from prolip_jax import errors


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
