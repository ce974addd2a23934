"""The valid interval of a number-valued config key, declared beside the key
(``config_keys.Key.within``) as in mathematics: ``'[0, 1)'`` (0 included,
1 not), ``'(0, inf)'`` (any positive finite number), ``'(-inf, inf)'`` (any
finite number), ``'[0, inf]'`` (infinity included: it means something for
that key, e.g. OTTER's diagonal penalty). NaN is in no interval. A tuple
value (``data.std``) holds numbers each in the interval.

Plain Python, no JAX: the key table imports this module.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

_NOTATION = re.compile(r'^([\[(])\s*(-?inf|[-+.\deE]+)\s*,\s*'
                       r'(-?inf|[-+.\deE]+)\s*([\])])$')


class Interval(NamedTuple):
  low: float
  low_closed: bool
  high: float
  high_closed: bool


def parse(notation: str) -> Interval:
  """``Interval`` of ``'[0, 1)'``-style ``notation``; ``ValueError`` for
  anything else (a typo in a declaration)."""
  m = _NOTATION.match(notation.strip())
  if not m:
    raise ValueError(f'not an interval: {notation!r} (write e.g. "[0, 1)")')
  low, high = float(m.group(2)), float(m.group(3))
  if not low <= high:
    raise ValueError(f'empty interval: {notation!r}')
  return Interval(low, m.group(1) == '[', high, m.group(4) == ']')


def is_number(value: Any) -> bool:
  """An int or float, not a bool (``True`` is no learning rate)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def contains(notation: str, value: Any) -> bool:
  """Whether the number ``value`` lies in the interval ``notation``: never
  for NaN, a bool or a non-number."""
  if not is_number(value) or math.isnan(value):
    return False
  i = parse(notation)
  above = value >= i.low if i.low_closed else value > i.low
  below = value <= i.high if i.high_closed else value < i.high
  return above and below


def words(notation: str) -> str:
  """How ``--print_config`` and the errors say the interval: ``'in [0,
  1)'``, ``'finite'`` for ``'(-inf, inf)'``."""
  i = parse(notation)
  if (i.low, i.high, i.low_closed, i.high_closed) == (
      -math.inf, math.inf, False, False):
    return 'finite'
  return f'in {notation}'


def check(key: str, value: Any, notation: str, meaning: str) -> None:
  """Raises ``ValueError`` naming ``key`` unless ``value`` (or each number
  of a tuple/list ``value``) lies in the interval ``notation``."""
  items = value if isinstance(value, (tuple, list)) else (value,)
  if all(contains(notation, v) for v in items):
    return
  what = 'numbers each' if isinstance(value, (tuple, list)) else 'a number'
  raise ValueError(f'{key} must be {what} {words(notation)} (got '
                   f'{value!r}): {meaning}')
