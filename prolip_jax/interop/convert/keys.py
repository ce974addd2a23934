"""The key layout: Flax parameter paths <-> PyTorch state-dict keys (the
ProLIP release / open_clip layout), as a table of ``Entry``s.

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
``arrays.unstack_layers`` / ``arrays.stack_layers`` convert at the
boundary, so export and import give the same state dict either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional

from prolip_jax.interop.convert.config_schema import namespace

# How one torch tensor is made of Flax parameters.
SAME = 'same'  # identical array
LINEAR = 'linear'  # Dense kernel (in, out) <-> Linear weight (out, in)
CONV = 'conv'  # Conv kernel HWIO <-> Conv2d weight OIHW
QKV_WEIGHT = 'qkv_weight'  # q, k, v kernels <-> in_proj_weight (3W, W)
QKV_BIAS = 'qkv_bias'  # q, k, v biases <-> in_proj_bias (3W,)

TEXT_LAYOUTS = ('custom', 'clip')


@dataclasses.dataclass(frozen=True)
class Entry:
  """One state-dict tensor: its key, the Flax paths it is built from, how."""
  key: str
  paths: tuple[tuple[str, ...], ...]
  kind: str = SAME


def default_text_layout(model_config: Any) -> str:
  """'clip' (top-level text keys) for the argmax-pooled CLIP text tower."""
  return 'clip' if namespace(model_config).text.pool == 'argmax' else 'custom'


def text_prefix(layout: str) -> str:
  """The key prefix of the text tower in ``layout``: ``'text.'`` or ''."""
  if layout not in TEXT_LAYOUTS:
    raise ValueError(f'text_layout must be one of {TEXT_LAYOUTS}, got '
                     f'{layout!r}')
  return 'text.' if layout == 'custom' else ''


def num_text_special(model_config: Any) -> int:
  """Rows of the text positional embedding after the context: [UNC], [CLS]."""
  cfg = namespace(model_config)
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
  cfg = namespace(model_config)
  layout = text_layout or default_text_layout(cfg)
  t = text_prefix(layout)
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
  """The state-dict keys of ``model_config``, in a fixed order."""
  return [e.key for e in state_dict_entries(model_config, text_layout)]


# ----------------------------------------------------------------------------
# Nested-dict paths.


def flatten(tree: Mapping[str, Any], prefix=()) -> dict[tuple[str, ...], Any]:
  """``{path: leaf}`` of a nested mapping (a path is a tuple of keys)."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
  """The nested dict of ``{path: leaf}``, the inverse of ``flatten``."""
  out: dict[str, Any] = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out


# ----------------------------------------------------------------------------
# A state dict's keys.


def detect_text_layout(keys: Iterable[str]) -> Optional[str]:
  """The text layout of a state dict's ``keys`` ('custom', 'clip'), or None
  when it has no text tower."""
  keys = set(keys)
  if 'text.token_embedding.weight' in keys:
    return 'custom'
  if 'token_embedding.weight' in keys:
    return 'clip'
  return None


def strip_module_prefix(sd: dict[str, Any]) -> dict[str, Any]:
  """Drops DistributedDataParallel's ``module.`` prefix."""
  if sd and all(k.startswith('module.') for k in sd):
    return {k[len('module.'):]: v for k, v in sd.items()}
  return sd
