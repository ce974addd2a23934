"""What every command line of the package shares before it runs: the config
file an argv names, and the CPU asked for directly on a machine without
accelerators (so the TPU runtime prints no warnings about a missing TPU)."""

from __future__ import annotations

import os
from typing import Optional, Sequence


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
