"""config.json (the release / open_clip model config) <-> ``ModelConfig``,
and the model config's forms without JAX.

``config_json`` writes the release's schema plus this project's exact
settings under ``PROJECT_KEY``; ``model_dict_from_json`` reads either back
(a release config.json gets the release's forward, ``release_compat``, when
it has [CLS]/[UNC] tokens). ``model_dict`` / ``namespace`` give a
``ModelConfig``'s fields from any of its forms (the dataclass, a
ConfigDict, a dict) with the declared defaults filled in, so that the key
table, ``torch_reference`` and ``hub`` never import the JAX model package.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from typing import Any, Mapping, Optional

from prolip_jax.config import keys as config_keys
from prolip_jax.config import presets

UNC_BIAS_INIT = -10.0
SIGLIP_HF_TOKENIZER = 'timm/ViT-B-16-SigLIP'

# config.json key of this project's fields; the release's ``ProLIPHF`` passes
# every top-level key to its constructor, see ``hub_config``.
PROJECT_KEY = 'prolip_jax'
FORMAT_VERSION = 1


# ----------------------------------------------------------------------------
# Config access without importing the (JAX) model package.


def namespace(cfg: Any) -> Any:
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
  return namespace(model_dict(model_config))


# ModelConfig's defaults: the B/16 preset, i.e. the declared ``model.*``
# defaults (config_keys.KEYS) with the B/16 sizes, in declaration order (the
# order an exported config.json lists them in).
_PRESET = presets.model_preset('B/16')


def _declared_fields(prefix: str) -> list[str]:
  """The fields declared directly under ``prefix`` (not in a sub-config)."""
  return [k[len(prefix):] for k in config_keys.defaults(prefix)
          if '.' not in k[len(prefix):]]


_VISION_DEFAULTS = {f: _PRESET.vision[f]
                    for f in _declared_fields('model.vision.')}
_TEXT_DEFAULTS = {f: _PRESET.text[f] for f in _declared_fields('model.text.')}
_MODEL_DEFAULTS = {f: _PRESET[f] for f in _declared_fields('model.')}


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
  cfg = namespace(model_config)
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
