"""Host memory of XLA's CPU runtime: keep a freed step buffer for the next step.

On the CPU backend each execution of a compiled function allocates one host
buffer for all of its temporaries and frees it when it ends: 440 MiB for the
train step of ``benchmarks/cpu_vs_torch.py``'s 64 px architecture, 406 MiB
for the tiny demo's. glibc's ``malloc`` serves any block over 32 MiB with a
fresh ``mmap`` and gives it back with ``munmap``, so every step touches
440 MiB of new pages: about 110,000 page faults per step, each zeroing a 4 KiB
page. On a virtual machine that hands free memory back to its host (free page
reporting, as on the 2-core CI machine) a fault is also a host fault: 1.6 to
2.8 us a page measured there, about 190 ms of CPU time per step, a third of
the step's CPU time, and more or less of it as the host's memory comes and
goes. PyTorch's step never pays it: its tensors are each under the 32 MiB
limit and glibc keeps them in the heap.

``keep_freed_memory()`` tells glibc (``mallopt``) to serve every thread from
the main heap (``M_ARENA_MAX`` 1: a thread arena cannot hold a block over
64 MiB and would ``mmap`` it anyway), to never ``mmap`` a block
(``M_MMAP_MAX`` 0) and to never give the top of the heap back
(``M_TRIM_THRESHOLD``): the buffer one step frees is the buffer of the next.
Nothing computed changes. The cost: the process keeps its peak heap size
until it exits, and its threads share one malloc arena. Hence
``keep_freed_memory_on_cpu()``, what the command lines call: only where JAX
computes on the CPU alone (no TPU chip, no GPU, or ``JAX_PLATFORMS=cpu``),
not on accelerator hosts, whose steps keep their temporaries on the device.

Call it before JAX starts its CPU backend: a thread keeps the arena it got at
its first ``malloc``, and the backend's threads start with it. Without glibc
(macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# The largest value M_TRIM_THRESHOLD takes (an int): never trim in practice.
NO_TRIM = 2**31 - 1

_applied = None


def keep_freed_memory() -> bool:
  """Sets glibc's malloc as the module docstring says; True when applied
  (now or by an earlier call), False where the C library is not glibc."""
  global _applied
  if _applied is not None:
    return _applied
  _applied = False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    mallopt = libc.mallopt
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement
  except (OSError, AttributeError):
    return False  # not glibc: its malloc has neither arenas nor mallopt
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  _applied = all(mallopt(param, value) == 1 for param, value in (
      (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NO_TRIM)))
  return _applied


def cpu_only() -> bool:
  """Whether JAX in this process will compute on the CPU alone: the platforms
  asked for (``JAX_PLATFORMS`` or ``jax.config.jax_platforms``) are 'cpu'
  only, or none is asked for and jax finds no TPU chip and no NVIDIA or AMD
  GPU (its own detection; starts no backend)."""
  import jax  # pylint: disable=g-import-not-at-top
  asked = (os.environ.get('JAX_PLATFORMS') or jax.config.jax_platforms
           or '')
  if asked:
    return {p.strip() for p in asked.split(',') if p.strip()} == {'cpu'}
  try:  # private: a later jax may move it; then assume an accelerator
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    return (hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0
            and not hardware_utils.has_visible_nvidia_gpu()
            and not hardware_utils.num_available_amd_gpus())
  except (ImportError, AttributeError, OSError):
    return False


def keep_freed_memory_on_cpu() -> bool:
  """``keep_freed_memory()`` where JAX computes on the CPU alone
  (``cpu_only()``); True when applied."""
  return cpu_only() and keep_freed_memory()
