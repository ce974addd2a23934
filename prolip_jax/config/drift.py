"""Config drift on resume: what a run may change and what it may not.

Resuming a workdir with a config that differs from the one stored in its
checkpoint: a change of a key declared ``fixed`` in ``config_keys.KEYS``
(it changes the parameter tree, the optimizer-state tree, the data order or
the tokenizer, or the model the checkpoint holds) would train a different
run or fail to restore, so the run stops with every such key listed and
nothing touched; other changes (learning rate, total steps, logging,
evaluation, mesh) are printed and applied. A key absent from either config
counts as its declared default, so a key added to ``KEYS`` after a run was
stored is not a change; a changed key that ``KEYS`` does not declare (a
user's own) is refused, since what it changes is unknown.
"""

from __future__ import annotations

from typing import Any, Mapping

from prolip_jax import errors
from prolip_jax.config import help as config_help
from prolip_jax.config import keys as config_keys

_ABSENT = '<absent>'


def _norm(value: Any) -> Any:
  # JSON turns tuples into lists: compare them as the same thing.
  if isinstance(value, (list, tuple)):
    return [_norm(v) for v in value]
  return value


def _value(flat: Mapping[str, Any], key: str) -> Any:
  if key in flat:
    return flat[key]
  found = config_keys.KEYS.get(key)
  return found.default if found else _ABSENT  # open subtrees: absent


def diff(stored: Mapping[str, Any], requested: Any
         ) -> dict[str, tuple[Any, Any]]:
  """``{key: (stored, requested)}`` for every key whose value differs."""
  old = config_help.flatten(stored)
  new = config_help.flatten(requested)
  out = {}
  for key in sorted(set(old) | set(new)):
    a, b = _value(old, key), _value(new, key)
    if _norm(a) != _norm(b):
      out[key] = (a, b)
  return out


def is_fixed(key: str) -> bool:
  """Whether ``key`` may not change on resume (``config_keys.KEYS``)."""
  return bool(config_keys.fixed_reason(key))


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
  """``key: old -> new (why it is fixed), ...``."""
  return ', '.join(
      f'{k}: {a!r} -> {b!r}'
      + (f' ({config_keys.fixed_reason(k)})' if is_fixed(k) else
         ' (not declared in config_keys.KEYS)'
         if config_keys.declaration(k) is None
         else '')
      for k, (a, b) in changes.items())


def check(stored: Mapping[str, Any], requested: Any, step: int) -> list[str]:
  """Raises ``ConfigDriftError`` listing fixed keys that differ; returns
  lines ``key: old -> new`` for the changes that will be applied."""
  changes = diff(stored, requested)
  # A key the requested config has but KEYS does not declare (a user's own
  # key) may change anything: refuse its change rather than guess. A stored
  # key that no config has any more (a retired setting) is not a change.
  fixed = {k: v for k, v in changes.items()
           if is_fixed(k) or (config_keys.declaration(k) is None
                              and v[1] != _ABSENT)}
  if fixed:
    raise errors.ConfigDriftError(
        f'the workdir holds a run at step {step} with other settings that '
        f'may not change on resume ({describe_changes(fixed)}); nothing was '
        'changed: resume with the stored settings or start a new --workdir')
  return [f'{k}: {a!r} -> {b!r}' for k, (a, b) in changes.items()]
