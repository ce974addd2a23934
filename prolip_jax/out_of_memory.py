"""A run that ran out of memory, said in one line: what ran out (a device's
memory, or the host's on JAX's CPU backend), what was asked for, and the
settings that lower it. ``errors.user_error_of`` turns XLA's
``RESOURCE_EXHAUSTED`` errors (``jax.errors.JaxRuntimeError``, jaxlib's
``XlaRuntimeError`` before it) and Python's ``MemoryError`` into an
``errors.OutOfMemoryError`` with this text, instead of a traceback.

Plain Python: ``errors`` imports this module, and JAX is asked which
backend ran out only when it is already imported.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

_XLA_ERRORS = ('JaxRuntimeError', 'XlaRuntimeError')
_XLA_OOM = re.compile(r'RESOURCE_EXHAUSTED|out of memory', re.IGNORECASE)
# 'Out of memory allocating 4294967296 bytes.' (CPU), 'Out of memory while
# trying to allocate 4294967296 bytes.' (GPU).
_ASKED_BYTES = re.compile(r'allocat\w* (\d+) bytes')
# A compile that does not fit: 'Used 20.50G of 15.48G hbm.' (TPU).
_USED = re.compile(r'Used [\d.]+\w* of [\d.]+\w* (\w+)')
_LONGEST = 200  # characters of XLA's own text when nothing above matches

# What lowers the memory a step needs on each device (docs/user_errors.md).
LOWER = ('lower what each device holds at once: a smaller batch per device '
         '(batch_size, or the same batch over more devices), '
         "accum_steps=K (each device's batch split K ways, the same step), "
         'model.remat=True, model.compute_dtype=bfloat16, or a smaller '
         'model; in evaluation, evals.NAME.batch_size')


def _backend() -> str:
  """The JAX backend in use: '' when JAX has not started one (asking would
  start one, inside an error handler) or cannot say."""
  bridge = sys.modules.get('jax._src.xla_bridge')
  if not getattr(bridge, '_backends', None):
    return ''
  try:
    return sys.modules['jax'].default_backend()
  except Exception:  # pylint: disable=broad-except
    return ''


def _what_ran_out(text: str) -> str:
  used = _USED.search(text)
  if used:
    return f'{used.group(1).upper()} device memory'
  backend = _backend()
  if backend == 'cpu':
    return "host memory (JAX's CPU backend)"
  return f'{backend.upper()} device memory' if backend else 'memory'


def _asked(text: str) -> str:
  m = _ASKED_BYTES.search(text)
  if m:
    n = int(m.group(1))
    return f'{n} bytes ({n / 2**30:.1f} GiB) asked for at once'
  used = _USED.search(text)
  if used:
    return f'the compiled step needs more than there is ({used.group(0)})'
  first = ' '.join(text.split())
  return first if len(first) <= _LONGEST else first[:_LONGEST] + '...'


def describe(exc: BaseException) -> Optional[str]:
  """One line for an out-of-memory ``exc`` (not its chain), or None."""
  text = str(exc)
  if type(exc).__name__ in _XLA_ERRORS and _XLA_OOM.search(text):
    return f'out of {_what_ran_out(text)}: {_asked(text)}; {LOWER}'
  if isinstance(exc, MemoryError):
    asked = ' '.join(text.split()) or 'a Python allocation failed'
    return f'out of host memory: {asked}; {LOWER}'
  return None
