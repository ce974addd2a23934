"""A small PyTorch implementation of the dual encoder: the export format's spec.

It reads what ``tools/export_pytorch.py`` writes (``model.safetensors`` and
``config.json``) and computes what the JAX model computes, in every variant
``ModelConfig`` describes: paper mode and ``release_compat`` mode (the public
release's forward), with and without [UNC] (``use_unc=False`` is the
deterministic CLIP/SigLIP dual encoder), [CLS]-pooled or open_clip's argmax
(end-of-text) pooled text tower. Its parameter names are the state-dict keys
(``text.*`` layout; ``load`` maps open_clip's top-level CLIP text keys).

    model = torch_reference.load('export_dir')          # eval mode, fp32
    mu, logvar = model.encode_image(images_nchw)          # logvar None if
    mu, logvar = model.encode_text(tokens)                # use_unc=False

``mu`` is L2-normalised, ``logvar`` is log sigma^2 per dimension. Images are
``(b, 3, h, w)`` already normalised; tokens ``(b, context_length)`` int,
right-padded with ``pad_id``. torch is imported on first use only, so
``import prolip_jax.interop.torch_reference`` works without it. No JAX is
needed.

Forward pass (paper / release differences marked):

* image: patches (conv, no bias) -> prepend [CLS] (, [UNC]) -> + positional
  embedding -> ln_pre -> pre-LN blocks -> ln_post. mu = [CLS] @ proj; release:
  ln_post is applied a second time to [CLS] first. log sigma^2 =
  uncertainty_proj([UNC]).
* text: token embeddings; [CLS]-pooled towers add [UNC] (if any) and [CLS]
  after the caption. Paper: at positions n, n+1 (n = number of non-pad
  tokens) and pad keys are masked out of attention. Release: at positions
  L, L+1 after the whole padded context, no mask at all. Then + positional
  embedding -> blocks (causal mask if the config says so) -> ln_final.
  mu = text_projection([CLS]) (argmax pooling: the token with the largest
  id). log sigma^2: paper = text_uncertainty_projection([UNC]); release =
  text_uncertainty_projection(projected [CLS]).
"""

from __future__ import annotations

import functools
import json
import os
import types
from typing import Any, Mapping, Optional

import numpy as np

from prolip_jax.interop import convert
from prolip_jax.storage.file_names import CONFIG_FILE
from prolip_jax.storage.file_names import WEIGHTS_FILE


@functools.lru_cache(maxsize=None)
def _modules() -> types.SimpleNamespace:
  """Defines the torch modules on first use (torch imported here only)."""
  # pylint: disable=g-import-not-at-top
  import torch
  from torch import nn
  import torch.nn.functional as F
  # pylint: enable=g-import-not-at-top

  transformer_class = _transformer_class(torch, nn, F)
  dual_encoder = _dual_encoder_class(
      torch, nn, _vision_tower_class(torch, nn, F, transformer_class),
      _text_tower_class(torch, nn, F, transformer_class))
  return types.SimpleNamespace(torch=torch, DualEncoder=dual_encoder)


def _transformer_class(torch, nn, F):  # pylint: disable=invalid-name
  """The pre-LN block stack's module class (``Transformer``), open_clip's
  parameter names: ``resblocks.{i}.{ln_1,attn,ln_2,mlp}``."""

  class QuickGELU(nn.Module):

    def forward(self, x):
      return x * torch.sigmoid(1.702 * x)

  def activation(name):
    return {'gelu': lambda: nn.GELU(),
            'gelu_tanh': lambda: nn.GELU(approximate='tanh'),
            'quick_gelu': QuickGELU}[name]()

  class Attention(nn.Module):
    """Multi-head self-attention with open_clip's fused q/k/v projection."""

    def __init__(self, width, heads):
      super().__init__()
      self.heads = heads
      self.in_proj_weight = nn.Parameter(torch.zeros(3 * width, width))
      self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
      self.out_proj = nn.Linear(width, width)

    def forward(self, x, mask=None):
      """``mask``: bool, broadcastable to (b, heads, t, t), True = attend."""
      b, t, w = x.shape
      q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1)
      split = lambda y: y.reshape(b, t, self.heads, -1).transpose(1, 2)
      q, k, v = split(q), split(k), split(v)
      scores = q @ k.transpose(-1, -2) / (w // self.heads) ** 0.5
      if mask is not None:
        scores = scores.masked_fill(~mask, float('-inf'))
      out = scores.softmax(-1) @ v
      return self.out_proj(out.transpose(1, 2).reshape(b, t, w))

  class Block(nn.Module):
    """x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, width, heads, mlp_ratio, act, eps):
      super().__init__()
      hidden = int(width * mlp_ratio)
      self.ln_1 = nn.LayerNorm(width, eps=eps)
      self.attn = Attention(width, heads)
      self.ln_2 = nn.LayerNorm(width, eps=eps)
      self.mlp = nn.Sequential()
      self.mlp.add_module('c_fc', nn.Linear(width, hidden))
      self.mlp.add_module('act', activation(act))
      self.mlp.add_module('c_proj', nn.Linear(hidden, width))

    def forward(self, x, mask=None):
      x = x + self.attn(self.ln_1(x), mask)
      return x + self.mlp(self.ln_2(x))

  class Transformer(nn.Module):

    def __init__(self, c):
      super().__init__()
      self.resblocks = nn.ModuleList(
          Block(c.width, c.heads, c.mlp_ratio, c.act, c.ln_eps)
          for _ in range(c.layers))

    def forward(self, x, mask=None):
      for block in self.resblocks:
        x = block(x, mask)
      return x

  return Transformer


def _vision_tower_class(torch, nn, F,  # pylint: disable=invalid-name
                        transformer_class):
  """The image tower's module class (``VisionTower``): patches, [CLS]
  (and [UNC]) -> ``(mu, logvar)``."""

  class VisionTower(nn.Module):

    def __init__(self, cfg):
      super().__init__()
      c = cfg.vision
      self.use_unc, self.release_compat = cfg.use_unc, cfg.release_compat
      n_special = 2 if cfg.use_unc else 1
      n_patches = (c.image_size // c.patch_size)**2
      self.conv1 = nn.Conv2d(3, c.width, c.patch_size, c.patch_size,
                             bias=False)
      self.class_embedding = nn.Parameter(torch.zeros(c.width))
      if cfg.use_unc:
        self.unc_embedding = nn.Parameter(torch.zeros(c.width))
      self.positional_embedding = nn.Parameter(
          torch.zeros(n_special + n_patches, c.width))
      self.ln_pre = nn.LayerNorm(c.width, eps=c.ln_eps)
      self.transformer = transformer_class(c)
      self.ln_post = nn.LayerNorm(c.width, eps=c.ln_eps)
      self.proj = nn.Parameter(torch.zeros(c.width, cfg.embed_dim))
      if cfg.use_unc:
        self.uncertainty_proj = nn.Linear(c.width, cfg.embed_dim)

    def forward(self, images):
      x = self.conv1(images).flatten(2).transpose(1, 2)  # (b, patches, w)
      special = [self.class_embedding]
      if self.use_unc:
        special.append(self.unc_embedding)
      special = torch.stack(special).expand(x.shape[0], -1, -1)
      x = torch.cat([special, x], dim=1) + self.positional_embedding
      x = self.ln_post(self.transformer(self.ln_pre(x)))
      cls = self.ln_post(x[:, 0]) if self.release_compat else x[:, 0]
      mu = F.normalize(cls @ self.proj, dim=-1)
      logvar = self.uncertainty_proj(x[:, 1]) if self.use_unc else None
      return mu, logvar

  return VisionTower


def _text_tower_class(torch, nn, F,  # pylint: disable=invalid-name
                      transformer_class):
  """The text tower's module class (``TextTower``): tokens, [UNC] and
  [CLS] where the config puts them -> ``(mu, logvar)``."""

  class TextTower(nn.Module):

    def __init__(self, cfg):
      super().__init__()
      c = cfg.text
      self.c, self.use_unc = c, cfg.use_unc
      self.release_compat = cfg.release_compat
      self.n_special = convert.num_text_special(cfg)
      self.token_embedding = nn.Embedding(c.vocab_size, c.width)
      self.positional_embedding = nn.Parameter(
          torch.zeros(c.context_length + self.n_special, c.width))
      if c.pool != 'argmax':
        self.cls_emb = nn.Parameter(torch.zeros(c.width))
        if cfg.use_unc:
          self.unc_emb = nn.Parameter(torch.zeros(c.width))
      self.transformer = transformer_class(c)
      self.ln_final = nn.LayerNorm(c.width, eps=c.ln_eps)
      if c.proj_bias:
        self.text_projection = nn.Linear(c.width, cfg.embed_dim)
      else:
        self.text_projection = nn.Parameter(torch.zeros(c.width, cfg.embed_dim))
      if cfg.use_unc:
        # Paper: applied to the [UNC] output; release: to the projected [CLS].
        head_in = cfg.embed_dim if cfg.release_compat else c.width
        self.text_uncertainty_projection = nn.Linear(head_in, cfg.embed_dim)

    def forward(self, tokens):
      c, n_special = self.c, self.n_special
      b, length = tokens.shape
      if length != c.context_length:
        raise ValueError(f'tokens have length {length}, the model expects '
                         f'{c.context_length}')
      rows = torch.arange(b)
      x = self.token_embedding(tokens)
      x = torch.cat([x, x.new_zeros(b, n_special, c.width)], dim=1)
      if self.release_compat:
        n_real = torch.full((b,), length)
      else:
        n_real = (tokens != c.pad_id).sum(1)
      cls_pos = n_real + n_special - 1
      if n_special:
        x[rows, cls_pos] = self.cls_emb
        if self.use_unc:
          x[rows, n_real] = self.unc_emb  # [UNC] right before [CLS]
      x = x + self.positional_embedding
      total = length + n_special
      mask = None
      if not self.release_compat:  # keys: the caption and the special tokens
        valid = torch.arange(total)[None] < (n_real + n_special)[:, None]
        mask = valid[:, None, None, :]
      if c.causal:
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        mask = causal if mask is None else mask & causal
      x = self.ln_final(self.transformer(x, mask))
      pooled = x[rows, tokens.argmax(1) if c.pool == 'argmax' else cls_pos]
      if isinstance(self.text_projection, nn.Linear):
        projected = self.text_projection(pooled)
      else:
        projected = pooled @ self.text_projection
      logvar = None
      if self.use_unc:
        head_in = projected if self.release_compat else x[rows, n_real]
        logvar = self.text_uncertainty_projection(head_in)
      return F.normalize(projected, dim=-1), logvar

  return TextTower


def _dual_encoder_class(torch, nn, vision_tower_class, text_tower_class):
  """The whole model's module class (``DualEncoder``): both towers and the
  logit scale and bias."""

  class DualEncoder(nn.Module):
    """``visual``, ``text``, ``logit_scale`` (log a), ``logit_bias`` (b)."""

    def __init__(self, model_config):
      super().__init__()
      cfg = convert.config_namespace(model_config)
      self.config = cfg
      self.visual = vision_tower_class(cfg)
      self.text = text_tower_class(cfg)
      self.logit_scale = nn.Parameter(torch.zeros(()))
      self.logit_bias = nn.Parameter(torch.zeros(()))

    def encode_image(self, images):
      return self.visual(images)

    def encode_text(self, tokens):
      return self.text(tokens)

    def forward(self, images, tokens):
      return (self.encode_image(images), self.encode_text(tokens),
              self.logit_scale.exp(), self.logit_bias)

  return DualEncoder


def build(model_config: Any):
  """An uninitialised (zeros) reference model of a ModelConfig or its dict."""
  return _modules().DualEncoder(model_config)


def to_reference_layout(state_dict: Mapping[str, Any]) -> dict[str, Any]:
  """Moves open_clip CLIP's top-level text keys under ``text.``."""
  if convert.detect_text_layout(state_dict) != 'clip':
    return dict(state_dict)
  return {(k if k.startswith('visual.') or k in ('logit_scale', 'logit_bias')
           else 'text.' + k): v for k, v in state_dict.items()}


def load_state_dict(model, state_dict: Mapping[str, Any]):
  """Strictly loads a numpy/torch state dict (either text layout)."""
  torch = _modules().torch

  def tensor(v):
    if isinstance(v, torch.Tensor):
      return v
    return torch.from_numpy(np.array(v, copy=True))  # writable copy

  sd = {k: tensor(v) for k, v in to_reference_layout(state_dict).items()}
  model.load_state_dict(sd, strict=True)
  return model


def read_config(path: str) -> dict[str, Any]:
  """config.json of an export directory (or the file itself)."""
  if os.path.isdir(path):
    path = os.path.join(path, CONFIG_FILE)
  with open(path) as f:
    return json.load(f)


def load(path: str, weights: Optional[str] = None):
  """The reference model of an export directory, in eval mode.

  ``path``: a directory with ``config.json`` and ``model.safetensors`` (or
  the config.json itself, with ``weights`` the safetensors file).
  """
  from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
  cfg = read_config(path)
  if weights is None:
    weights = os.path.join(path if os.path.isdir(path) else
                           os.path.dirname(path), WEIGHTS_FILE)
  model = build(convert.model_dict_from_json(cfg))
  load_state_dict(model, {k: v.float() for k, v in load_file(weights).items()})
  return model.eval()
