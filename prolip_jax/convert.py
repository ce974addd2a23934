"""Parameters <-> PyTorch state dicts (the ProLIP release / open_clip layout).

Everything here is numpy; JAX is imported only by ``state_dict_to_params``
(to build the parameter template) and ``model_config_from_json``.

Key layout (``visual.*`` and top level, see ``state_dict_keys`` for the full
list of one config)::

  visual.conv1.weight                  (W, 3, p, p)   conv OIHW  <- HWIO kernel
  visual.class_embedding               (W,)
  visual.unc_embedding                 (W,)           use_unc only
  visual.positional_embedding          (1[+1]+P, W)   [CLS], [UNC], patches
  visual.ln_pre.{weight,bias}          (W,)           <- LayerNorm scale, bias
  visual.transformer.resblocks.{i}.ln_1.{weight,bias}
  visual.transformer.resblocks.{i}.attn.in_proj_weight  (3W, W)  [q; k; v]
  visual.transformer.resblocks.{i}.attn.in_proj_bias    (3W,)
  visual.transformer.resblocks.{i}.attn.out_proj.{weight (W, W), bias}
  visual.transformer.resblocks.{i}.ln_2.{weight,bias}
  visual.transformer.resblocks.{i}.mlp.c_fc.{weight (M, W), bias}
  visual.transformer.resblocks.{i}.mlp.c_proj.{weight (W, M), bias}
  visual.ln_post.{weight,bias}
  visual.proj                          (W, E)         used as x @ proj
  visual.uncertainty_proj.{weight (E, W), bias}       use_unc only
  logit_scale, logit_bias              ()             log a, b

Text keys live under ``text.`` (the release's ``ProLIP`` / open_clip's
``CustomTextCLIP``) or, for the open_clip ``CLIP`` text tower
(``model.text.pool='argmax'``), at the top level (``token_embedding.weight``,
``positional_embedding``, ``transformer.resblocks...``, ``ln_final``,
``text_projection``). ``text_projection`` is a Linear (``.weight`` (E, W),
``.bias``) when ``proj_bias`` and a bare ``(W, E)`` matrix otherwise, as in
open_clip. Flax Dense kernels are ``(in, out)``, torch Linear weights
``(out, in)``; the fused ``in_proj_weight`` stacks the q, k, v weights.

A model with ``model.scan`` keeps each tower's blocks in one
``transformer/resblocks`` subtree whose leaves have a leading layer axis;
the table above is written for the unrolled ``resblocks_{i}`` layout, and
``unstack_layers`` / ``stack_layers`` convert at the boundary, so export and
import give the same state dict either way.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
from typing import Any, Iterable, Mapping, Optional

import numpy as np

UNC_BIAS_INIT = -10.0
SIGLIP_HF_TOKENIZER = 'timm/ViT-B-16-SigLIP'

# How one torch tensor is made of Flax parameters.
SAME = 'same'  # identical array
LINEAR = 'linear'  # Dense kernel (in, out) <-> Linear weight (out, in)
CONV = 'conv'  # Conv kernel HWIO <-> Conv2d weight OIHW
QKV_WEIGHT = 'qkv_weight'  # q, k, v kernels <-> in_proj_weight (3W, W)
QKV_BIAS = 'qkv_bias'  # q, k, v biases <-> in_proj_bias (3W,)

TEXT_LAYOUTS = ('custom', 'clip')

# config.json key of this project's fields; the release's ``ProLIPHF`` passes
# every top-level key to its constructor, see ``hub_config``.
PROJECT_KEY = 'prolip_jax'
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Entry:
  """One state-dict tensor: its key, the Flax paths it is built from, how."""
  key: str
  paths: tuple[tuple[str, ...], ...]
  kind: str = SAME


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
# Config access without importing the (JAX) model package.


def _ns(cfg: Any) -> Any:
  """Attribute access for a ModelConfig or its ``to_dict()``/ConfigDict form."""
  if dataclasses.is_dataclass(cfg) or isinstance(cfg, types.SimpleNamespace):
    return cfg  # a ModelConfig, or already converted
  d = model_dict(cfg)
  return types.SimpleNamespace(
      **{**d, 'vision': types.SimpleNamespace(**d['vision']),
         'text': types.SimpleNamespace(**d['text'])})


def config_namespace(model_config: Any) -> types.SimpleNamespace:
  """A ModelConfig-like namespace (``.vision``, ``.text``) of any config form,
  for code that must not import JAX."""
  return _ns(model_dict(model_config))


# Mirrors the dataclass defaults of prolip_jax.models (checked by the tests).
_VISION_DEFAULTS = dict(image_size=224, patch_size=16, width=768, layers=12,
                        heads=12, mlp_ratio=4.0, act='gelu', ln_eps=1e-5)
_TEXT_DEFAULTS = dict(vocab_size=32100, context_length=64, width=768,
                      layers=12, heads=12, mlp_ratio=4.0, act='gelu',
                      ln_eps=1e-6, pad_id=0, proj_bias=True, pool='cls',
                      causal=False)
_MODEL_DEFAULTS = dict(embed_dim=768, use_unc=True, release_compat=False,
                       init_logit_scale=10.0, init_logit_bias=-10.0,
                       init_unc_bias=UNC_BIAS_INIT, compute_dtype='float32',
                       remat=False, remat_policy='nothing_saveable',
                       scan=False, attention_impl='auto')


def model_dict(model_config: Any) -> dict[str, Any]:
  """``ModelConfig.to_dict()`` of a ModelConfig, ConfigDict or dict (missing
  fields get ModelConfig's defaults, unknown ones are kept)."""
  if dataclasses.is_dataclass(model_config):
    return dataclasses.asdict(model_config)
  if isinstance(model_config, types.SimpleNamespace):
    return {k: (dict(vars(v)) if isinstance(v, types.SimpleNamespace) else v)
            for k, v in vars(model_config).items()}
  if hasattr(model_config, 'to_dict'):
    model_config = model_config.to_dict()
  cfg = copy.deepcopy(dict(model_config))
  out = {**_MODEL_DEFAULTS,
         **{k: v for k, v in cfg.items() if k not in ('vision', 'text')}}
  out['vision'] = {**_VISION_DEFAULTS, **dict(cfg.get('vision', {}))}
  out['text'] = {**_TEXT_DEFAULTS, **dict(cfg.get('text', {}))}
  return out


def default_text_layout(model_config: Any) -> str:
  """'clip' (top-level text keys) for the argmax-pooled CLIP text tower."""
  return 'clip' if _ns(model_config).text.pool == 'argmax' else 'custom'


def _text_prefix(layout: str) -> str:
  if layout not in TEXT_LAYOUTS:
    raise ValueError(f'text_layout must be one of {TEXT_LAYOUTS}, got '
                     f'{layout!r}')
  return 'text.' if layout == 'custom' else ''


def num_text_special(model_config: Any) -> int:
  """Rows of the text positional embedding after the context: [UNC], [CLS]."""
  cfg = _ns(model_config)
  if cfg.text.pool == 'argmax':
    return 0
  return 2 if cfg.use_unc else 1


# ----------------------------------------------------------------------------
# The table of tensors.


def _linear(key: str, path: tuple[str, ...], bias: bool = True) -> list[Entry]:
  out = [Entry(f'{key}.weight', (path + ('kernel',),), LINEAR)]
  if bias:
    out.append(Entry(f'{key}.bias', (path + ('bias',),)))
  return out


def _layer_norm(key: str, path: tuple[str, ...]) -> list[Entry]:
  return [Entry(f'{key}.weight', (path + ('scale',),)),
          Entry(f'{key}.bias', (path + ('bias',),))]


def _encoder(key: str, path: tuple[str, ...], layers: int) -> list[Entry]:
  out = []
  for i in range(layers):
    k, p = f'{key}.resblocks.{i}', path + (f'resblocks_{i}',)
    attn = p + ('attn',)
    out += _layer_norm(f'{k}.ln_1', p + ('ln_1',))
    out.append(Entry(f'{k}.attn.in_proj_weight',
                     tuple(attn + (n, 'kernel') for n in 'qkv'), QKV_WEIGHT))
    out.append(Entry(f'{k}.attn.in_proj_bias',
                     tuple(attn + (n, 'bias') for n in 'qkv'), QKV_BIAS))
    out += _linear(f'{k}.attn.out_proj', attn + ('out_proj',))
    out += _layer_norm(f'{k}.ln_2', p + ('ln_2',))
    out += _linear(f'{k}.mlp.c_fc', p + ('mlp', 'c_fc'))
    out += _linear(f'{k}.mlp.c_proj', p + ('mlp', 'c_proj'))
  return out


def state_dict_entries(model_config: Any,
                       text_layout: Optional[str] = None) -> list[Entry]:
  """The state-dict tensors of ``model_config``, in a fixed order."""
  cfg = _ns(model_config)
  layout = text_layout or default_text_layout(cfg)
  t = _text_prefix(layout)
  v = ('visual',)
  out = [Entry('visual.conv1.weight', (v + ('conv1', 'kernel'),), CONV),
         Entry('visual.class_embedding', (v + ('class_embedding',),))]
  if cfg.use_unc:
    out.append(Entry('visual.unc_embedding', (v + ('unc_embedding',),)))
  out.append(Entry('visual.positional_embedding',
                   (v + ('positional_embedding',),)))
  out += _layer_norm('visual.ln_pre', v + ('ln_pre',))
  out += _encoder('visual.transformer', v + ('transformer',), cfg.vision.layers)
  out += _layer_norm('visual.ln_post', v + ('ln_post',))
  out.append(Entry('visual.proj', (v + ('proj', 'kernel'),)))
  if cfg.use_unc:
    out += _linear('visual.uncertainty_proj', v + ('uncertainty_proj',))

  x = ('text',)
  out.append(Entry(f'{t}token_embedding.weight',
                   (x + ('token_embedding', 'embedding'),)))
  out.append(Entry(f'{t}positional_embedding',
                   (x + ('positional_embedding',),)))
  if cfg.text.pool != 'argmax':
    out.append(Entry(f'{t}cls_emb', (x + ('cls_emb',),)))
    if cfg.use_unc:
      out.append(Entry(f'{t}unc_emb', (x + ('unc_emb',),)))
  out += _encoder(f'{t}transformer', x + ('transformer',), cfg.text.layers)
  out += _layer_norm(f'{t}ln_final', x + ('ln_final',))
  if cfg.text.proj_bias:
    out += _linear(f'{t}text_projection', x + ('text_projection',))
  else:
    out.append(Entry(f'{t}text_projection',
                     (x + ('text_projection', 'kernel'),)))
  if cfg.use_unc:
    out += _linear(f'{t}text_uncertainty_projection',
                   x + ('text_uncertainty_projection',))
  out += [Entry('logit_scale', (('logit_scale',),)),
          Entry('logit_bias', (('logit_bias',),))]
  return out


def state_dict_keys(model_config: Any,
                    text_layout: Optional[str] = None) -> list[str]:
  return [e.key for e in state_dict_entries(model_config, text_layout)]


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


def _flatten(tree: Mapping[str, Any], prefix=()) -> dict[tuple[str, ...], Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


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
             for p in _flatten(params))


def unstack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
  """Scanned layout -> unrolled: ``transformer/resblocks/...`` leaves of shape
  ``(layers, ...)`` become ``transformer/resblocks_{i}/...`` of shape
  ``(...)``; everything else is unchanged (an unrolled tree comes back as
  is)."""
  out = {}
  for path, x in _flatten(params).items():
    j = _stack_position(path, lambda k: k == _SCANNED)
    if j < 0:
      out[path] = x
      continue
    for i in range(x.shape[0]):
      out[path[:j] + (f'resblocks_{i}',) + path[j + 1:]] = x[i]
  return _unflatten(out)


def stack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
  """Unrolled layout -> scanned, the inverse of ``unstack_layers``: each
  tower's ``resblocks_{0..L-1}`` become one ``resblocks`` whose leaves are
  the blocks' leaves stacked (numpy) on a new leading axis."""
  out, groups = {}, {}
  for path, x in _flatten(params).items():
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
        [_to_numpy(layers[i]) for i in range(len(layers))])
  return _unflatten(out)


def to_layout(params: Mapping[str, Any], scan: bool) -> dict[str, Any]:
  """``params`` in the scanned (``scan=True``) or unrolled layout, whichever
  layout they come in."""
  if scan:
    return params if is_scanned(params) else stack_layers(params)
  return unstack_layers(params) if is_scanned(params) else params


def _to_numpy(x: Any) -> np.ndarray:
  """numpy from numpy/JAX arrays and torch tensors (bf16 goes to float32)."""
  if type(x).__module__.startswith('torch'):
    x = x.detach().cpu()
    if str(x.dtype) == 'torch.bfloat16':
      x = x.float()
    return x.numpy()
  return np.asarray(x)


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
  flat = {p: _to_numpy(v)
          for p, v in _flatten(unstack_layers(params)).items()}
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


def detect_text_layout(keys: Iterable[str]) -> Optional[str]:
  keys = set(keys)
  if 'text.token_embedding.weight' in keys:
    return 'custom'
  if 'token_embedding.weight' in keys:
    return 'clip'
  return None


def _strip_module_prefix(sd: dict[str, Any]) -> dict[str, Any]:
  """Drops DistributedDataParallel's ``module.`` prefix."""
  if sd and all(k.startswith('module.') for k in sd):
    return {k[len('module.'):]: v for k, v in sd.items()}
  return sd


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
  import jax  # pylint: disable=g-import-not-at-top
  from prolip_jax.models.prolip import ModelConfig  # pylint: disable=g-import-not-at-top
  from prolip_jax.models.prolip import init_params  # pylint: disable=g-import-not-at-top

  if not isinstance(model_config, ModelConfig):
    model_config = ModelConfig.from_config(model_dict(model_config))
  # The table is written for unrolled blocks; a scanned model's are stacked
  # at the end.
  cfg = dataclasses.replace(model_config, scan=False)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  sd = _strip_module_prefix({k: v for k, v in state_dict.items()})
  layout = detect_text_layout(sd)
  report = ConversionReport(source_layout=layout or '?')
  if layout is None:
    raise ValueError('cannot convert state dict: no text tower found (neither '
                     "'text.token_embedding.weight' nor "
                     "'token_embedding.weight'); keys start with "
                     f'{sorted({k.split(".")[0] for k in sd})}')
  t = _text_prefix(layout)

  abstract = _flatten(jax.eval_shape(lambda r: init_params(cfg, r), rng))
  expect = {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in abstract.items()}
  init_cache: list[dict] = []

  def init_value(path):
    # The two scalars are constants; anything else needs a (slow) full init.
    if path == ('logit_scale',):
      return np.asarray(math.log(cfg.init_logit_scale), expect[path][1])
    if path == ('logit_bias',):
      return np.asarray(cfg.init_logit_bias, expect[path][1])
    if not init_cache:
      init_cache.append({p: np.asarray(v) for p, v in
                         _flatten(init_params(cfg, rng)).items()})
    return init_cache[0][path]

  source = {k: _to_numpy(v) for k, v in sd.items()}
  consumed: set[str] = set()
  problems: list[str] = []
  flat: dict[tuple[str, ...], np.ndarray] = {}

  # Tensors a model variant adds; created from init when absent.
  creatable = {'visual.unc_embedding', 'visual.uncertainty_proj.weight',
               'visual.uncertainty_proj.bias', f'{t}cls_emb', f'{t}unc_emb',
               f'{t}text_uncertainty_projection.weight',
               f'{t}text_uncertainty_projection.bias',
               f'{t}text_projection.bias', 'logit_scale', 'logit_bias'}

  # Created only as a whole: a source with part of a group is broken.
  groups = {}
  for group in (('visual.unc_embedding', 'visual.uncertainty_proj.weight',
                 'visual.uncertainty_proj.bias'),
                (f'{t}unc_emb', f'{t}text_uncertainty_projection.weight',
                 f'{t}text_uncertainty_projection.bias')):
    for k in group:
      groups[k] = tuple(g for g in group if g != k)

  def take(key, shape, dtype):
    consumed.add(key)
    x = source[key]
    if x.dtype != dtype:
      report.cast.append(f'{key}: {x.dtype} -> {dtype}')
      x = x.astype(dtype)
    return x

  # Created tensors are named as in the target's own layout.
  target_key = {e.key: e2.key for e, e2 in zip(
      state_dict_entries(cfg, layout), state_dict_entries(cfg))}

  for e in state_dict_entries(cfg, layout):
    shapes = [expect[p][0] for p in e.paths]
    dtype = expect[e.paths[0]][1]
    want = _torch_shape(e.kind, shapes)
    key = e.key
    if e.paths[0][-2:] == ('text_projection', 'kernel'):
      # Linear (weight (E, W)) or bare matrix (W, E), whichever the source has.
      if f'{t}text_projection.weight' in source:
        key, kind = f'{t}text_projection.weight', LINEAR
      else:
        key, kind = f'{t}text_projection', SAME
      want = _torch_shape(kind, shapes)
      if key not in source:
        problems.append(f'{key}: missing (expected {want})')
      elif tuple(source[key].shape) != want:
        consumed.add(key)
        problems.append(f'{key}: expected {want}, found '
                        f'{tuple(source[key].shape)}')
      else:
        flat[e.paths[0]] = _from_torch_layout(kind, take(key, want, dtype))[0]
      continue
    if e.paths[0][-1] == 'positional_embedding':
      x = _positional(e, source, cfg, layout, want, problems, report,
                      init_value, target_key[key])
      consumed.add(key)
      if x is not None:
        if x.dtype != dtype:
          report.cast.append(f'{key}: {x.dtype} -> {dtype}')
        flat[e.paths[0]] = x.astype(dtype)
      continue
    if key not in source:
      partial = [k for k in groups.get(key, ()) if k in source]
      if key in creatable and not partial:
        report.created.append(f'{target_key[key]} {want}')
        for p in e.paths:
          flat[p] = init_value(p)
      else:
        problems.append(f'{key}: missing (expected {want})' + (
            f'; the source has {partial}' if partial else ''))
      continue
    found = tuple(source[key].shape)
    if found != want:
      consumed.add(key)
      problems.append(f'{key}: expected {want}, found {found}')
      continue
    arrays = _from_torch_layout(e.kind, take(key, want, dtype))
    for p, x in zip(e.paths, arrays):
      flat[p] = x

  for key in sorted(set(source) - consumed):
    shape = tuple(source[key].shape)
    if key == f'{t}text_projection.bias' and not cfg.text.proj_bias:
      if np.any(source[key] != 0):
        problems.append(f'{key}: unexpected nonzero bias {shape} '
                        '(model.text.proj_bias=False)')
      else:
        report.dropped.append(f'{key} {shape} (all zeros)')
    elif key in creatable:
      report.dropped.append(f'{key} {shape}')
    else:
      problems.append(f'{key}: unexpected key {shape}')

  if problems:
    raise ValueError(
        f'cannot convert state dict ({layout} text layout) to the model '
        f'config: {len(problems)} offending keys:\n  ' + '\n  '.join(problems))
  missing = sorted('/'.join(p) for p in set(abstract) - set(flat))
  if missing:  # the entry table and the model disagree: a bug here
    raise AssertionError(f'conversion table misses params {missing}')
  report.converted = len(consumed)
  params = _unflatten({p: flat[p] for p in abstract})
  return to_layout(params, model_config.scan), report


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
  t = _text_prefix(layout)
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


# ----------------------------------------------------------------------------
# config.json


def config_json(model_config: Any, extra: Optional[Mapping[str, Any]] = None,
                hf_tokenizer_name: Optional[str] = None) -> dict[str, Any]:
  """The release's config.json schema plus this project's ``prolip_jax`` key.

  Top level: ``embed_dim``, ``init_logit_scale`` (log), ``init_logit_bias``,
  ``quick_gelu``, ``vision_cfg`` and ``text_cfg`` as the release/open_clip
  read them. ``prolip_jax``: ``model`` (``ModelConfig.to_dict()``, exact),
  ``release_compat``, ``format_version`` and ``extra`` merged in (the export
  tool adds ``tokenizer_file``, ``mask_id``, ``mean``, ``std``, ``step``).
  ``hub_config`` drops the ``prolip_jax`` key, which the release's
  ``ProLIPHF.from_pretrained`` would pass on to its constructor.
  ``hf_tokenizer_name`` defaults to SigLIP's for the 32,100-piece
  vocabulary, else None.
  """
  cfg = _ns(model_config)
  v, t = cfg.vision, cfg.text
  vision_cfg = {
      'image_size': v.image_size, 'layers': v.layers, 'width': v.width,
      'head_width': v.width // v.heads, 'patch_size': v.patch_size,
      'mlp_ratio': v.mlp_ratio, 'embed_unc': bool(cfg.use_unc),
      'init_unc_bias': cfg.init_unc_bias,
  }
  if v.ln_eps != 1e-5:
    vision_cfg['norm_kwargs'] = {'eps': v.ln_eps}
  if hf_tokenizer_name is None and t.vocab_size == 32100:
    hf_tokenizer_name = SIGLIP_HF_TOKENIZER
  text_cfg = {
      'context_length': t.context_length, 'vocab_size': t.vocab_size,
      'hf_tokenizer_name': hf_tokenizer_name,
      'width': t.width, 'heads': t.heads, 'layers': t.layers,
      'mlp_ratio': t.mlp_ratio, 'no_causal_mask': not t.causal,
      'proj_bias': bool(t.proj_bias),
      # With embed_cls the [CLS] output is used whatever pool_type says.
      'pool_type': 'argmax',
      'embed_cls': t.pool != 'argmax', 'embed_unc': bool(cfg.use_unc),
      'pad_id': t.pad_id, 'norm_kwargs': {'eps': t.ln_eps},
      'init_unc_bias': cfg.init_unc_bias,
  }
  for tower, c in ((vision_cfg, v), (text_cfg, t)):
    if c.act == 'gelu_tanh':
      tower['act_kwargs'] = {'approximate': 'tanh'}
  project = {
      'format_version': FORMAT_VERSION,
      'model': model_dict(cfg),
      'release_compat': bool(cfg.release_compat),
  }
  return {
      'embed_dim': cfg.embed_dim,
      'init_logit_scale': math.log(cfg.init_logit_scale),
      'init_logit_bias': cfg.init_logit_bias,
      'quick_gelu': v.act == 'quick_gelu' and t.act == 'quick_gelu',
      'vision_cfg': vision_cfg,
      'text_cfg': text_cfg,
      PROJECT_KEY: _merge(project, extra or {}),
  }


def _merge(a: dict, b: Mapping) -> dict:
  out = copy.deepcopy(a)
  for k, val in b.items():
    if isinstance(val, Mapping) and isinstance(out.get(k), dict):
      out[k] = _merge(out[k], val)
    else:
      out[k] = copy.deepcopy(val)
  return out


def hub_config(cfg_json: Mapping[str, Any]) -> dict[str, Any]:
  """config.json without this project's fields (loadable by ``ProLIPHF``)."""
  return {k: copy.deepcopy(v) for k, v in cfg_json.items()
          if k != PROJECT_KEY}


def model_dict_from_json(cfg_json: Mapping[str, Any]) -> dict[str, Any]:
  """``ModelConfig.to_dict()`` form of a config.json (no JAX needed).

  Uses ``prolip_jax.model`` when present (exact). Otherwise rebuilds it from
  the release/open_clip schema: [CLS]/[UNC] tokens (``embed_cls``,
  ``embed_unc``) mean the release's forward (``release_compat=True``),
  neither means open_clip's CLIP (argmax pooling).
  """
  project = cfg_json.get(PROJECT_KEY) or {}
  if project.get('model'):
    return model_dict(project['model'])
  vc = dict(cfg_json.get('vision_cfg', {}))
  tc = dict(cfg_json.get('text_cfg', {}))
  unknown = [f'vision_cfg.{k}' for k in ('timm_model_name',) if vc.get(k)] + [
      f'text_cfg.{k}' for k in ('hf_model_name',) if tc.get(k)]
  if unknown:
    raise ValueError(f'unsupported config.json fields {unknown}')

  def act(c):
    if cfg_json.get('quick_gelu'):
      return 'quick_gelu'
    if (c.get('act_kwargs') or {}).get('approximate') == 'tanh':
      return 'gelu_tanh'
    return 'gelu'

  width = vc.get('width', 768)
  vision = {
      'image_size': vc.get('image_size', 224),
      'patch_size': vc.get('patch_size', 16), 'width': width,
      'layers': vc.get('layers', 12),
      'heads': width // vc.get('head_width', 64),
      'mlp_ratio': vc.get('mlp_ratio', 4.0), 'act': act(vc),
      'ln_eps': (vc.get('norm_kwargs') or {}).get('eps', 1e-5),
  }
  embed_cls = bool(tc.get('embed_cls', False))
  unc_v, unc_t = bool(vc.get('embed_unc', False)), bool(tc.get('embed_unc',
                                                              False))
  if unc_v != unc_t:
    raise ValueError('config.json: vision_cfg.embed_unc and '
                     'text_cfg.embed_unc differ; unsupported')
  if not embed_cls and tc.get('pool_type', 'argmax') != 'argmax':
    raise ValueError("config.json: only pool_type 'argmax' (or embed_cls) "
                     f"text towers are supported, got {tc.get('pool_type')!r}")
  text = {
      'vocab_size': tc.get('vocab_size', 49408),
      'context_length': tc.get('context_length', 77),
      'width': tc.get('width', 512), 'layers': tc.get('layers', 12),
      'heads': tc.get('heads', 8), 'mlp_ratio': tc.get('mlp_ratio', 4.0),
      'act': act(tc),
      'ln_eps': (tc.get('norm_kwargs') or {}).get('eps', 1e-5),
      'pad_id': tc.get('pad_id', 0), 'proj_bias': bool(tc.get('proj_bias',
                                                             False)),
      'pool': 'cls' if embed_cls else 'argmax',
      'causal': not tc.get('no_causal_mask', False),
  }
  scale = cfg_json.get('init_logit_scale')
  bias = cfg_json.get('init_logit_bias')
  return model_dict({  # the fields the schema has no word for: defaults
      'embed_dim': cfg_json.get('embed_dim', 512), 'vision': vision,
      'text': text, 'use_unc': unc_v,
      'release_compat': bool(project.get('release_compat',
                                         embed_cls or unc_v)),
      'init_logit_scale': math.exp(scale) if scale is not None else 10.0,
      'init_logit_bias': bias if bias is not None else -10.0,
      'init_unc_bias': vc.get('init_unc_bias', UNC_BIAS_INIT),
      'compute_dtype': 'float32', 'remat': False,
  })


def model_config_from_json(cfg_json: Mapping[str, Any]):
  """The ModelConfig of a config.json written by ``config_json`` (or the
  release); see ``model_dict_from_json``."""
  from prolip_jax.models.prolip import ModelConfig  # pylint: disable=g-import-not-at-top
  return ModelConfig.from_config(model_dict_from_json(cfg_json))
