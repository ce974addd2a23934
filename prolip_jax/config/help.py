"""``--print_config``: every config key with its value and meaning.

The meanings are the declarations of ``config_keys.KEYS``; a key marked
``[fixed on resume]`` may not change when a workdir is resumed. A key whose
values are a registry's names lists them when ``describe`` is given the
registries (``prolip_jax/registries.py``, which may import them).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from prolip_jax.config import keys as config_keys
from prolip_jax.config import ranges


def flatten(config: Any, prefix: str = '') -> dict[str, Any]:
  """``{'a.b.c': value}`` of a nested ConfigDict or dict; an empty mapping
  (``evals`` with no evaluators) is a value ``{}``, so the key shows."""
  out = {}
  items = config.items() if isinstance(config, Mapping) else (
      config.to_dict().items() if hasattr(config, 'to_dict') else ())
  for key, value in items:
    name = f'{prefix}{key}'
    if isinstance(value, Mapping) or hasattr(value, 'to_dict'):
      out.update(flatten(value, name + '.') or {name: {}})
    else:
      out[name] = value
  return out


def describe(config: Any,
             names: Optional[Callable[[str], Sequence[str]]] = None) -> str:
  """One line per key: ``key = value  # meaning``; a key whose values are
  the names of a registry lists them, ``(one of a | b | c)``, when
  ``names(registry)`` gives them, a number its valid interval, ``(in [0,
  1))``; keys that may not change on resume end
  in ``[fixed on resume]``, keys that delete files in ``[removes ...]``."""
  flat = flatten(config)
  width = max(len(f'{k} = {v!r}') for k, v in flat.items())
  lines = []
  for key, value in flat.items():
    text = f'{key} = {value!r}'
    note = config_keys.meaning(key)
    declared = config_keys.declaration(key)
    if names is not None and declared is not None and declared.choices:
      note += f' (one of {" | ".join(names(declared.choices))})'
    if declared is not None and declared.within:
      note += f' ({ranges.words(declared.within)})'
    if config_keys.fixed_reason(key):
      note += ' [fixed on resume]'
    if declared is not None and declared.removes:
      note += f' [removes {declared.removes}]'
    lines.append(f'{text:{width}s}  # {note}' if note else text)
  return '\n'.join(lines)
