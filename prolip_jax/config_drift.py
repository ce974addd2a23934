"""Config drift on resume: what a run may change and what it may not.

Resuming a workdir with a config that differs from the one stored in its
checkpoint: changes that alter the parameters' shapes or the data stream
(``FIXED``: the model, tokenizer, batch size, data source, seed, objective,
masking) would silently train a different run, so they stop the run with
every differing key listed; other changes (learning rate, total steps,
logging, evaluation, mesh) are printed and applied.
"""

from __future__ import annotations

from typing import Any, Mapping

from prolip_jax import config_help
from prolip_jax import errors

# Prefixes of the keys that may not change on resume.
FIXED = ('model.', 'tokenizer.', 'batch_size', 'seed', 'objective', 'masking.',
         'data.name', 'data.path', 'data.tfds_', 'data.num_views',
         'data.split', 'data.render_size',
         'data.crop_scale', 'data.jitter', 'data.jitter_prob',
         'data.grayscale_prob', 'data.color_on_device', 'data.mean',
         'data.std', 'uniclip.',
         # Adds a parameter group, so the optimizer state changes structure.
         'optim.unc_lr_mult')
_ABSENT = '<absent>'

# Keys added after runs were stored without them, with the value that means
# what those runs did: absent in a stored config equals this value.
ADDED_WITH_DEFAULT = {'model.remat_policy': 'nothing_saveable',
                      'model.scan': False, 'model.attention_impl': 'auto'}


def _norm(value: Any) -> Any:
  # JSON turns tuples into lists: compare them as the same thing.
  if isinstance(value, (list, tuple)):
    return [_norm(v) for v in value]
  return value


def diff(stored: Mapping[str, Any], requested: Any
         ) -> dict[str, tuple[Any, Any]]:
  """``{key: (stored, requested)}`` for every key whose value differs."""
  old = config_help.flatten(stored)
  new = config_help.flatten(requested)
  out = {}
  for key in sorted(set(old) | set(new)):
    a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
    if key in ADDED_WITH_DEFAULT:
      a, b = (ADDED_WITH_DEFAULT[key] if v is _ABSENT else v for v in (a, b))
    if _norm(a) != _norm(b):
      out[key] = (a, b)
  return out


def is_fixed(key: str) -> bool:
  return any(key == p.rstrip('.') or key.startswith(p) for p in FIXED)


def check(stored: Mapping[str, Any], requested: Any, step: int) -> list[str]:
  """Raises ``ConfigDriftError`` listing fixed keys that differ; returns
  lines ``key: old -> new`` for the changes that will be applied."""
  changes = diff(stored, requested)
  fixed = [k for k in changes if is_fixed(k)]
  if fixed:
    listed = ', '.join(f'{k}: {changes[k][0]!r} -> {changes[k][1]!r}'
                       for k in fixed)
    raise errors.ConfigDriftError(
        f'the workdir holds a run at step {step} with other settings that '
        f'change the model or the data ({listed}); use the same settings '
        'or a new --workdir')
  return [f'{k}: {a!r} -> {b!r}' for k, (a, b) in changes.items()]
