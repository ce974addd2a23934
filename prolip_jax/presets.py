"""Model presets as ``ConfigDict``s matching ``ModelConfig``'s fields.

``model_preset('B/16')`` is the paper's ProLIP ViT-B/16: 224px, patch 16,
12x768 image and text towers, 12 heads, context 64, embedding 768, vocabulary
32,100 (the SigLIP sentencepiece model).
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

_VISION = {
    # name: (image_size, patch, width, layers, heads)
    'tiny': (32, 8, 128, 4, 4),
    'B/32': (224, 32, 768, 12, 12),
    'B/16': (224, 16, 768, 12, 12),
    'L/16': (224, 16, 1024, 24, 16),
}
_TEXT = {
    # name: (width, layers, heads, context_length, vocab_size)
    'tiny': (128, 3, 4, 32, 256),
    'B/32': (768, 12, 12, 64, 32100),
    'B/16': (768, 12, 12, 64, 32100),
    'L/16': (1024, 24, 16, 64, 32100),
}
_EMBED = {'tiny': 64, 'B/32': 768, 'B/16': 768, 'L/16': 1024}


def model_preset(name: str, use_unc: bool = True) -> ml_collections.ConfigDict:
  """The model config of a named preset (``tiny``, ``B/32``, ``B/16``, ``L/16``)."""
  if name not in _VISION:
    raise ValueError(f'unknown model preset {name!r}; have {sorted(_VISION)}')
  size, patch, vw, vl, vh = _VISION[name]
  tw, tl, th, ctx, vocab = _TEXT[name]
  return ml_collections.ConfigDict({
      'embed_dim': _EMBED[name],
      'vision': {'image_size': size, 'patch_size': patch, 'width': vw,
                 'layers': vl, 'heads': vh, 'mlp_ratio': 4.0, 'act': 'gelu',
                 'ln_eps': 1e-5},
      'text': {'vocab_size': vocab, 'context_length': ctx, 'width': tw,
               'layers': tl, 'heads': th, 'mlp_ratio': 4.0, 'act': 'gelu',
               'ln_eps': 1e-6, 'pad_id': 0, 'proj_bias': True, 'pool': 'cls',
               'causal': False},
      'use_unc': use_unc,
      'release_compat': False,
      'init_logit_scale': 10.0,
      'init_logit_bias': -10.0,
      'init_unc_bias': -10.0,
      'compute_dtype': 'float32',
      'remat': False,
      'remat_policy': 'nothing_saveable',
      'scan': False,
      'attention_impl': 'auto',
  })


def base_config() -> ml_collections.ConfigDict:
  """Run settings shared by every config; each config file overrides some."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.objective = 'prolip'  # see objectives.OBJECTIVES
  c.model = model_preset('tiny')
  c.batch_size = 128  # global, over all devices and hosts
  c.total_steps = 1000
  c.loss = ml_collections.ConfigDict({
      'alpha1': 1e-7, 'alpha2': 1e-3, 'beta': 1e-4, 'c': 1000.0, 'eps': -20.0,
      'vib_release_quirk': False, 'guard': True,
      # OTTER (objective 'otter'): paper section 4 / Algorithm 1 settings.
      'otter': {'alpha': 0.5, 'lam': 0.15, 'n_iter': 5, 'gamma_v': 1.0,
                'gamma_t': 1.0, 'eta': 100.0, 'ema_decay': 0.999}})
  c.masking = ml_collections.ConfigDict({
      'fraction': 0.125,  # samples of the batch that get a masked copy
      'image_keep_ratio': 0.25,  # paper: 75% of patch tokens dropped
      'text_mask_prob': 0.75})
  c.optim = ml_collections.ConfigDict({
      'lr': 5e-4, 'b1': 0.9, 'b2': 0.95, 'eps': 1e-6, 'weight_decay': 0.2,
      'warmup_steps': 100, 'end_lr_ratio': 0.0, 'grad_clip': 0.0,
      'max_logit_scale': 100.0,
      # Learning-rate multiplier of the [UNC] tokens and uncertainty heads
      # (train.UNCERTAINTY_PARAMS); 1 is the paper's recipe.
      'unc_lr_mult': 1.0})
  c.data = ml_collections.ConfigDict({
      'name': 'digits',
      # Bundled sources (digits, emoji): 'train', or 'fit' + 'val' (a
      # validation split carved from 'train' for choosing knobs).
      'split': 'train',
      'render_size': 64,  # emoji: pixels of the rendered glyphs
      'mean': (0.48145466, 0.4578275, 0.40821073),  # CLIP's constants
      'std': (0.26862954, 0.26130258, 0.27577711),
      'crop_scale': (0.8, 1.0),
      'jitter': (0.32, 0.32, 0.32, 0.08),
      'jitter_prob': 0.8,
      'grayscale_prob': 0.2,
      # Apply the jitter and grayscale drawn on the host in the train step
      # (prolip_jax/data/color.py) instead of with PIL in the workers.
      'color_on_device': False,
      # Augmented views per image; > 1 only for multi-view objectives
      # (objectives.MULTI_VIEW: UniCLIP).
      'num_views': 1,
      'num_workers': 0,
      'num_threads': 2,
      # data.name == 'array_record': a glob (or brace pattern) of shards.
      'path': '',
      # data.name == 'tfds': a prepared TFDS dataset read by random access.
      'tfds_name': '', 'tfds_split': 'train', 'tfds_data_dir': '',
      'tfds_image_key': 'image', 'tfds_caption_key': 'caption',
      # Bad records (undecodable image, empty caption) are replaced by the
      # next good one and counted; above this fraction the run stops.
      'max_bad_fraction': 0.01, 'bad_record_warmup': 1000,
      'tokenizer_max_sentences': 1_000_000,
      # Eval-time resize + crop of prolip_jax.load: 'default' or 'release'
      # (open_clip's torchvision roundings).
      'eval_view': 'default',
  })
  c.tokenizer = ml_collections.ConfigDict({
      'model_path': '',  # empty: train one on the dataset's captions
      'vocab_size': 256, 'pad_id': -1, 'mask_id': -1,  # -1: from the model
      # Caption cleaning (data/text_clean.py): none, whitespace, lower,
      # canonicalize (the release's). keep_eos: a truncated sentencepiece row
      # ends in EOS, as Hugging Face tokenizers do.
      'clean': 'none', 'keep_eos': False})
  # A snapshot dir or hf-hub:OWNER/NAME to fine-tune (hub.prepare_init_from);
  # init_tokenizer optionally overrides its tokenizer.
  c.init_from = ''
  c.init_tokenizer = ''
  c.eval = ml_collections.ConfigDict({'every_steps': 0, 'batch_size': 250})
  c.log_every_steps = 20
  c.checkpoint_every_steps = 200
  c.keep_checkpoints = 3
  # num_devices 0: every device of every host.
  c.mesh = ml_collections.ConfigDict({'data': -1, 'fsdp': 1, 'num_devices': 0})
  return c


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file such as ``configs/prolip_tiny.py``."""
  spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f'cannot load a config from {path!r}')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def short_run_uncertainty(c: ml_collections.ConfigDict, beta: float = 0.3
                          ) -> ml_collections.ConfigDict:
  """Knobs under which ProLIP's sigma^2 trains in a few hundred steps.

  The paper's weights are tuned for 1.28B samples: in 600 steps Adam moves
  the [UNC] heads by about 0.3 in log sigma^2, VIB (beta = 1e-4) and
  L_inc(v ⊂ t) (alpha1 = 1e-7) are invisible, and PPCL shrinks every
  caption's sigma^2. A 10x learning rate for the uncertainty parameters, a
  VIB weight that balances PPCL at sigma^2 ~ 1e-3..1e-2 per dimension and a
  visible image ⊂ text inclusion term let general captions end up more
  uncertain than specific ones. Chosen on validation splits carved from
  training; docs/small_scale_uncertainty.md has every setting tried.
  """
  c.optim.unc_lr_mult = 10.0
  c.loss.beta = beta
  c.loss.alpha1 = 1e-3
  return c


def tiny_demo_config(objective: str = 'prolip') -> ml_collections.ConfigDict:
  """The CPU demo on the bundled MNIST digits, for any objective.

  Deterministic objectives ('siglip', 'clip', 'otter', 'uniclip', 'pcclip')
  get towers without [UNC]; set ``model.use_unc`` for OTTER's probabilistic
  (CSD-logit) variant.
  """
  c = base_config()
  c.objective = objective
  c.model = model_preset('tiny', use_unc=objective in ('prolip', 'pcme'))
  if objective in ('clip', 'otter', 'pcclip'):
    c.model.init_logit_scale = 1 / 0.07  # CLIP's temperature init
  if objective == 'pcclip':
    # PC-CLIP (Sam et al.): CLIP + weight * eq. 1 over difference pairs.
    c.loss.pcclip_weight = 1.0
    c.loss.pcclip_tau = 1.0  # appendix C.1: tau = 1 in every run
    c.loss.pcclip_squared = False  # True: eq. 5's squared loss
    # One differing attribute per T_ij: with the 256-piece demo tokenizer one
    # phrase is 15-26 tokens, and two would not fit the 32-token context.
    c.loss.pcclip_max_phrases = 1
  if objective == 'pcme':
    # PCME++'s release inits a = 5, b = 5 (the model stores log a).
    c.model.init_logit_scale = 5.0
    c.model.init_logit_bias = 5.0
  if objective == 'otter':
    # The paper's 0.999 suits long runs; over the demo's 600 steps it would
    # leave the teacher at about half its random init.
    c.loss.otter.ema_decay = 0.99
  c.batch_size = 128
  c.total_steps = 600
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 60
  c.optim.weight_decay = 0.05
  c.data.name = 'digits'
  if objective == 'prolip':
    short_run_uncertainty(c, beta=0.1)
  c.data.mean = (0.5, 0.5, 0.5)
  c.data.std = (0.5, 0.5, 0.5)
  # Grayscale digits: colour jitter and grayscale do nothing useful.
  c.data.jitter_prob = 0.0
  c.data.grayscale_prob = 0.0
  c.log_every_steps = 25
  c.checkpoint_every_steps = 200
  c.eval.every_steps = 300
  if objective == 'uniclip':
    _uniclip_settings(c)
  return c


def _uniclip_settings(c: ml_collections.ConfigDict):
  """UniCLIP on the digits: 3 views per image, heads of section 2.1."""
  c.data.num_views = 3  # the paper's positive group: 3 views + 1 caption
  # Views must differ (image-image positives) and the head must see how:
  # crops and, since grey digits have no colour, brightness/contrast jitter
  # only (saturation/hue factors stay at identity).
  c.data.crop_scale = (0.6, 1.0)
  c.data.jitter = (0.4, 0.4, 0.0, 0.0)
  c.data.jitter_prob = 0.8
  c.loss.mp_nce_weights = 'balanced'  # (1/V^2, 1/(2V), 1): eq. 12's w_D
  c.uniclip = ml_collections.ConfigDict({
      'embed_dim': 0,  # 0: model.embed_dim
      'num_blocks': 3, 'mlp_ratio': 2.0,  # image head: 3 residual blocks
      'aug_features': 64, 'aug_hidden': 64,  # f_A
      'use_aug': True,
      'init_tau': 0.07, 'init_offset': 0.0})  # eq. 16 starts as eq. 13


def emoji_demo_config(objective: str = 'prolip') -> ml_collections.ConfigDict:
  """The tiny model on the bundled emoji hierarchy (``data/emoji.py``).

  OpenMoji glyphs rendered at 64 px, captions drawn per example from five
  levels of specificity (root, group, subgroup, name, templated name);
  held-out names are never trained on. Colour is part of many names ('red
  heart', 'blue heart'), so no colour jitter or grayscale.
  """
  c = tiny_demo_config(objective)
  c.data.name = 'emoji'
  if objective == 'prolip':
    short_run_uncertainty(c, beta=0.3)
  c.data.jitter_prob = 0.0
  c.data.grayscale_prob = 0.0
  # ~1,500 distinct names: a larger vocabulary than the digits' 256.
  c.tokenizer.vocab_size = 1024
  c.model.text.vocab_size = 1024
  return c
