"""The array conversion: Flax parameters <-> PyTorch state-dict tensors.

Each tensor of the key table (``keys.state_dict_entries``) is built from its
Flax arrays by its kind: transposed (Dense kernel <-> Linear weight, HWIO
<-> OIHW conv), fused (q, k, v <-> ``in_proj_weight``/``in_proj_bias``) or
taken as is, cast to the target's dtype on import. A scanned model's block
stack is unrolled on export and stacked again on import
(``unstack_layers``/``stack_layers``). Everything here is numpy; JAX is
imported only by ``state_dict_to_params`` (to build the parameter template).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Optional

import numpy as np

from prolip_jax.interop.convert.config_schema import model_dict
from prolip_jax.interop.convert.keys import CONV
from prolip_jax.interop.convert.keys import detect_text_layout
from prolip_jax.interop.convert.keys import flatten
from prolip_jax.interop.convert.keys import LINEAR
from prolip_jax.interop.convert.keys import num_text_special
from prolip_jax.interop.convert.keys import QKV_BIAS
from prolip_jax.interop.convert.keys import QKV_WEIGHT
from prolip_jax.interop.convert.keys import SAME
from prolip_jax.interop.convert.keys import state_dict_entries
from prolip_jax.interop.convert.keys import strip_module_prefix
from prolip_jax.interop.convert.keys import text_prefix
from prolip_jax.interop.convert.keys import unflatten


@dataclasses.dataclass
class ConversionReport:
  """What ``state_dict_to_params`` did beyond renaming and transposing."""
  source_layout: str = ''
  created: list[str] = dataclasses.field(default_factory=list)
  dropped: list[str] = dataclasses.field(default_factory=list)
  reshaped: list[str] = dataclasses.field(default_factory=list)
  cast: list[str] = dataclasses.field(default_factory=list)
  converted: int = 0

  def format(self) -> str:
    lines = [f'converted {self.converted} tensors '
             f'(source text layout: {self.source_layout})']
    for name in ('created', 'dropped', 'reshaped', 'cast'):
      items = getattr(self, name)
      lines.append(f'{name}: {len(items)}')
      lines.extend(f'  {item}' for item in items)
    return '\n'.join(lines)

  __str__ = format


# ----------------------------------------------------------------------------
# Tensor transforms.


def _to_torch_layout(kind: str, arrays: list[np.ndarray]) -> np.ndarray:
  if kind == SAME:
    return arrays[0]
  if kind == LINEAR:
    return arrays[0].T
  if kind == CONV:
    return arrays[0].transpose(3, 2, 0, 1)
  if kind == QKV_WEIGHT:
    return np.concatenate([a.T for a in arrays], axis=0)
  if kind == QKV_BIAS:
    return np.concatenate(arrays, axis=0)
  raise ValueError(kind)


def _from_torch_layout(kind: str, x: np.ndarray) -> list[np.ndarray]:
  if kind == SAME:
    return [x]
  if kind == LINEAR:
    return [x.T]
  if kind == CONV:
    return [x.transpose(2, 3, 1, 0)]
  if kind == QKV_WEIGHT:
    return [a.T for a in np.split(x, 3, axis=0)]
  if kind == QKV_BIAS:
    return np.split(x, 3, axis=0)
  raise ValueError(kind)


def _torch_shape(kind: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
  if kind == SAME:
    return tuple(shapes[0])
  if kind == LINEAR:
    return tuple(shapes[0][::-1])
  if kind == CONV:
    h, w, i, o = shapes[0]
    return (o, i, h, w)
  if kind == QKV_WEIGHT:
    d_in, d_out = shapes[0]
    return (3 * d_out, d_in)
  if kind == QKV_BIAS:
    return (3 * shapes[0][0],)
  raise ValueError(kind)


def to_numpy(x: Any) -> np.ndarray:
  """numpy from numpy/JAX arrays and torch tensors (bf16 goes to float32)."""
  if type(x).__module__.startswith('torch'):
    x = x.detach().cpu()
    if str(x.dtype) == 'torch.bfloat16':
      x = x.float()
    return x.numpy()
  return np.asarray(x)


# ----------------------------------------------------------------------------
# Scanned (stacked) <-> unrolled blocks.


_SCANNED = 'resblocks'  # models.transformer.SCANNED_BLOCKS (no JAX import)
_UNROLLED = re.compile(r'resblocks_(\d+)$')


def _stack_position(path: tuple[str, ...], pattern) -> int:
  """Index of the block-stack key under a ``transformer`` node, or -1."""
  for j in range(1, len(path)):
    if path[j - 1] == 'transformer' and pattern(path[j]):
      return j
  return -1


def is_scanned(params: Mapping[str, Any]) -> bool:
  """Whether ``params`` holds a scanned stack (``transformer/resblocks``)."""
  return any(_stack_position(p, lambda k: k == _SCANNED) >= 0
             for p in flatten(params))


def unstack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
  """Scanned layout -> unrolled: ``transformer/resblocks/...`` leaves of shape
  ``(layers, ...)`` become ``transformer/resblocks_{i}/...`` of shape
  ``(...)``; everything else is unchanged (an unrolled tree comes back as
  is)."""
  out = {}
  for path, x in flatten(params).items():
    j = _stack_position(path, lambda k: k == _SCANNED)
    if j < 0:
      out[path] = x
      continue
    for i in range(x.shape[0]):
      out[path[:j] + (f'resblocks_{i}',) + path[j + 1:]] = x[i]
  return unflatten(out)


def stack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
  """Unrolled layout -> scanned, the inverse of ``unstack_layers``: each
  tower's ``resblocks_{0..L-1}`` become one ``resblocks`` whose leaves are
  the blocks' leaves stacked (numpy) on a new leading axis."""
  out, groups = {}, {}
  for path, x in flatten(params).items():
    j = _stack_position(path, _UNROLLED.match)
    if j < 0:
      out[path] = x
      continue
    i = int(_UNROLLED.match(path[j]).group(1))
    groups.setdefault((path[:j], path[j + 1:]), {})[i] = x
  for (head, tail), layers in groups.items():
    if sorted(layers) != list(range(len(layers))):
      raise ValueError(f"{'/'.join(head)}: blocks {sorted(layers)} are not "
                       f'0..{len(layers) - 1}')
    out[head + (_SCANNED,) + tail] = np.stack(
        [to_numpy(layers[i]) for i in range(len(layers))])
  return unflatten(out)


def to_layout(params: Mapping[str, Any], scan: bool) -> dict[str, Any]:
  """``params`` in the scanned (``scan=True``) or unrolled layout, whichever
  layout they come in."""
  if scan:
    return params if is_scanned(params) else stack_layers(params)
  return unstack_layers(params) if is_scanned(params) else params


# ----------------------------------------------------------------------------
# Export.


def params_to_state_dict(params: Mapping[str, Any], model_config: Any,
                         text_layout: Optional[str] = None
                         ) -> dict[str, np.ndarray]:
  """The PyTorch state dict (C-contiguous numpy arrays) of ``params``.

  ``text_layout``: 'custom' (``text.*`` keys, the ProLIP release) or 'clip'
  (top-level text keys, open_clip's CLIP); defaults to 'clip' exactly for
  ``model.text.pool='argmax'``. ``params`` may be scanned or unrolled
  (``model.scan``): the state dict is the same. Raises ValueError when
  ``params`` does not match ``model_config``.
  """
  flat = {p: to_numpy(v)
          for p, v in flatten(unstack_layers(params)).items()}
  out, used, missing = {}, set(), []
  for e in state_dict_entries(model_config, text_layout):
    absent = [p for p in e.paths if p not in flat]
    if absent:
      missing += ['/'.join(p) for p in absent]
      continue
    used.update(e.paths)
    out[e.key] = np.asarray(  # C order (safetensors), 0-d stays 0-d
        _to_torch_layout(e.kind, [flat[p] for p in e.paths]), order='C')
  extra = sorted('/'.join(p) for p in set(flat) - used)
  if missing or extra:
    raise ValueError(
        'params do not match the model config: '
        + (f'missing {missing}' if missing else '')
        + ('; ' if missing and extra else '')
        + (f'unexpected {extra}' if extra else ''))
  return out


# ----------------------------------------------------------------------------
# Import.


def state_dict_to_params(state_dict: Mapping[str, Any], model_config: Any,
                         rng: Any = None
                         ) -> tuple[dict[str, Any], ConversionReport]:
  """Parameters of ``model_config`` (nested dict of numpy) from a state dict.

  Accepts the release/``CustomTextCLIP`` layout and open_clip's ``CLIP``
  layout whatever the target's text pooling. Beyond exact key/shape matches:

  * created: tensors the source lacks that a model variant adds ([UNC] and
    [CLS] embeddings, the log-variance heads (bias -10), a text projection
    bias, ``logit_bias``/``logit_scale``) come from ``init_params(rng)``
    (a tower's [UNC] token and head only together: a source with one but
    not the other is an error);
  * dropped: such tensors in the source that ``model_config`` has no use
    for (e.g. the heads when ``use_unc=False``; a text projection bias only
    if it is all zeros);
  * reshaped: positional embeddings that differ only in their [CLS]/[UNC]
    rows get those rows added (from ``init_params``) or removed.

  Anything else missing, unexpected or of the wrong shape raises one
  ValueError listing every offending key with expected and found shapes.
  ``model_config``: a ModelConfig or its dict form; with ``scan`` the blocks
  come back stacked (``stack_layers``).
  """
  # pylint: disable=g-import-not-at-top
  import jax
  from prolip_jax.models.prolip import ModelConfig
  from prolip_jax.models.prolip import init_params
  # pylint: enable=g-import-not-at-top

  if not isinstance(model_config, ModelConfig):
    model_config = ModelConfig.from_config(model_dict(model_config))
  # The table is written for unrolled blocks; a scanned model's are stacked
  # at the end.
  cfg = dataclasses.replace(model_config, scan=False)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  sd = strip_module_prefix({k: v for k, v in state_dict.items()})
  layout = detect_text_layout(sd)
  report = ConversionReport(source_layout=layout or '?')
  if layout is None:
    raise ValueError('cannot convert state dict: no text tower found (neither '
                     "'text.token_embedding.weight' nor "
                     "'token_embedding.weight'); keys start with "
                     f'{sorted({k.split(".")[0] for k in sd})}')
  t = text_prefix(layout)

  abstract = flatten(jax.eval_shape(lambda r: init_params(cfg, r), rng))
  expect = {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in abstract.items()}
  init_value = _initial_value_fn(cfg, rng, expect, init_params)
  state = _ImportState(source={k: to_numpy(v) for k, v in sd.items()},
                       report=report)
  # Created tensors are named as in the target's own layout.
  target_key = {e.key: e2.key for e, e2 in zip(
      state_dict_entries(cfg, layout), state_dict_entries(cfg))}

  for e in state_dict_entries(cfg, layout):
    shapes = [expect[p][0] for p in e.paths]
    dtype = expect[e.paths[0]][1]
    want = _torch_shape(e.kind, shapes)
    if e.paths[0][-2:] == ('text_projection', 'kernel'):
      _import_text_projection(state, e, t, shapes, dtype)
    elif e.paths[0][-1] == 'positional_embedding':
      _import_positional(state, e, cfg, layout, want, dtype, init_value,
                         target_key[e.key])
    else:
      _import_tensor(state, e, t, want, dtype, init_value, target_key[e.key])
  _sort_unused(state, cfg, t)

  if state.problems:
    raise ValueError(
        f'cannot convert state dict ({layout} text layout) to the model '
        f'config: {len(state.problems)} offending keys:\n  '
        + '\n  '.join(state.problems))
  missing = sorted('/'.join(p) for p in set(abstract) - set(state.flat))
  if missing:  # the entry table and the model disagree: a bug here
    raise AssertionError(f'conversion table misses params {missing}')
  report.converted = len(state.consumed)
  params = unflatten({p: state.flat[p] for p in abstract})
  return to_layout(params, model_config.scan), report


@dataclasses.dataclass
class _ImportState:
  """The state of one ``state_dict_to_params``: the source tensors (numpy,
  by state-dict key), the keys used so far, every problem found and the
  parameters built so far (by flattened path)."""
  source: dict[str, np.ndarray]
  report: ConversionReport
  consumed: set[str] = dataclasses.field(default_factory=set)
  problems: list[str] = dataclasses.field(default_factory=list)
  flat: dict[tuple[str, ...], np.ndarray] = dataclasses.field(
      default_factory=dict)

  def take(self, key: str, dtype: np.dtype) -> np.ndarray:
    """The source tensor ``key``, marked used, cast (and reported) to
    ``dtype`` where it differs."""
    self.consumed.add(key)
    x = self.source[key]
    if x.dtype != dtype:
      self.report.cast.append(f'{key}: {x.dtype} -> {dtype}')
      x = x.astype(dtype)
    return x


def _initial_value_fn(cfg, rng, expect, init_params):
  """``init_value(path)``: the initial value of one parameter of ``cfg``.
  The two scalars are constants; anything else needs a (slow) full
  ``init_params(cfg, rng)``, run at most once and only when needed."""
  init_cache: list[dict] = []

  def init_value(path):
    if path == ('logit_scale',):
      return np.asarray(math.log(cfg.init_logit_scale), expect[path][1])
    if path == ('logit_bias',):
      return np.asarray(cfg.init_logit_bias, expect[path][1])
    if not init_cache:
      init_cache.append({p: np.asarray(v) for p, v in
                         flatten(init_params(cfg, rng)).items()})
    return init_cache[0][path]

  return init_value


def _creatable_keys(t: str) -> set[str]:
  """The state-dict keys (text prefix ``t``) of tensors a model variant
  adds: created from init when the source lacks them, dropped when the
  target has no use for them."""
  return {'visual.unc_embedding', 'visual.uncertainty_proj.weight',
          'visual.uncertainty_proj.bias', f'{t}cls_emb', f'{t}unc_emb',
          f'{t}text_uncertainty_projection.weight',
          f'{t}text_uncertainty_projection.bias',
          f'{t}text_projection.bias', 'logit_scale', 'logit_bias'}


def _unc_group_partners(t: str) -> dict[str, tuple[str, ...]]:
  """Per key of a tower's [UNC] token and head, the group's other keys: the
  group is created only as a whole (a source with part of it is broken)."""
  groups = {}
  for group in (('visual.unc_embedding', 'visual.uncertainty_proj.weight',
                 'visual.uncertainty_proj.bias'),
                (f'{t}unc_emb', f'{t}text_uncertainty_projection.weight',
                 f'{t}text_uncertainty_projection.bias')):
    for k in group:
      groups[k] = tuple(g for g in group if g != k)
  return groups


def _import_text_projection(state: _ImportState, e, t: str, shapes, dtype):
  """The text projection kernel from a Linear (weight (E, W)) or a bare
  matrix (W, E), whichever the source has."""
  if f'{t}text_projection.weight' in state.source:
    key, kind = f'{t}text_projection.weight', LINEAR
  else:
    key, kind = f'{t}text_projection', SAME
  want = _torch_shape(kind, shapes)
  if key not in state.source:
    state.problems.append(f'{key}: missing (expected {want})')
  elif tuple(state.source[key].shape) != want:
    state.consumed.add(key)
    state.problems.append(f'{key}: expected {want}, found '
                          f'{tuple(state.source[key].shape)}')
  else:
    state.flat[e.paths[0]] = _from_torch_layout(kind, state.take(key, dtype))[0]


def _import_positional(state: _ImportState, e, cfg, layout, want, dtype,
                       init_value, name):
  """A positional embedding (``_positional``), cast to ``dtype``."""
  key = e.key
  x = _positional(e, state.source, cfg, layout, want, state.problems,
                  state.report, init_value, name)
  state.consumed.add(key)
  if x is not None:
    if x.dtype != dtype:
      state.report.cast.append(f'{key}: {x.dtype} -> {dtype}')
    state.flat[e.paths[0]] = x.astype(dtype)


def _import_tensor(state: _ImportState, e, t: str, want, dtype, init_value,
                   name):
  """Any other entry: taken from the source when its shape matches, created
  from init when a model variant adds it and the source lacks it."""
  key = e.key
  if key not in state.source:
    partial = [k for k in _unc_group_partners(t).get(key, ())
               if k in state.source]
    if key in _creatable_keys(t) and not partial:
      state.report.created.append(f'{name} {want}')
      for p in e.paths:
        state.flat[p] = init_value(p)
    else:
      state.problems.append(f'{key}: missing (expected {want})' + (
          f'; the source has {partial}' if partial else ''))
    return
  found = tuple(state.source[key].shape)
  if found != want:
    state.consumed.add(key)
    state.problems.append(f'{key}: expected {want}, found {found}')
    return
  arrays = _from_torch_layout(e.kind, state.take(key, dtype))
  for p, x in zip(e.paths, arrays):
    state.flat[p] = x


def _sort_unused(state: _ImportState, cfg, t: str):
  """The source tensors no entry used: dropped (a variant's tensor, a text
  projection bias of zeros) or a problem (anything else)."""
  creatable = _creatable_keys(t)
  for key in sorted(set(state.source) - state.consumed):
    shape = tuple(state.source[key].shape)
    if key == f'{t}text_projection.bias' and not cfg.text.proj_bias:
      if np.any(state.source[key] != 0):
        state.problems.append(f'{key}: unexpected nonzero bias {shape} '
                              '(model.text.proj_bias=False)')
      else:
        state.report.dropped.append(f'{key} {shape} (all zeros)')
    elif key in creatable:
      state.report.dropped.append(f'{key} {shape}')
    else:
      state.problems.append(f'{key}: unexpected key {shape}')


def _positional(e, source, cfg, layout, want, problems, report, init_value,
                name):
  """A positional embedding, adding/removing [CLS]/[UNC] rows if needed."""
  key, path = e.key, e.paths[0]
  if key not in source:
    problems.append(f'{key}: missing (expected {want})')
    return None
  x = source[key]
  found = tuple(x.shape)
  if found == want:
    return x
  if x.ndim != 2 or found[1] != want[1]:
    problems.append(f'{key}: expected {want}, found {found}')
    return None
  t = text_prefix(layout)
  if path[0] == 'visual':
    body = cfg.num_patches
    tgt = ['cls', 'unc'] if cfg.use_unc else ['cls']
    src_n = found[0] - body
    src = {1: ['cls'], 2: ['cls', 'unc']}.get(src_n)
    head = True  # special rows come first
  else:
    body = cfg.text.context_length
    tgt = {0: [], 1: ['cls'], 2: ['unc', 'cls']}[num_text_special(cfg)]
    src_n = found[0] - body
    if layout == 'clip':
      src = [] if src_n == 0 else None
    else:
      src = {1: ['cls'], 2: ['unc', 'cls']}.get(src_n)
      # A row is only meaningful if its token exists in the source.
      if src is not None and ('unc' in src) != (f'{t}unc_emb' in source):
        src = None
    head = False  # special rows come after the context
  if src is None:
    problems.append(f'{key}: expected {want}, found {found} (not the same '
                    'grid/context with other [CLS]/[UNC] rows)')
    return None
  init = init_value(path)
  n_s = len(src)
  src_rows = {n: x[i] if head else x[body + i] for i, n in enumerate(src)}
  init_rows = {n: init[i] if head else init[body + i]
               for i, n in enumerate(tgt)}
  special = [src_rows.get(n, init_rows[n]) for n in tgt]
  body_rows = x[n_s:] if head else x[:body]
  parts = ([np.stack(special)] if head and special else []) + [body_rows] + (
      [np.stack(special)] if not head and special else [])
  out = np.concatenate([p.astype(x.dtype) for p in parts], axis=0)
  added = [n for n in tgt if n not in src_rows]
  removed = [n for n in src if n not in tgt]
  report.reshaped.append(
      f'{name}: {found} -> {want}'
      + (f'; new rows {added} from init' if added else '')
      + (f'; dropped rows {removed}' if removed else ''))
  return out
