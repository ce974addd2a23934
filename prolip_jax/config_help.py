"""Every config key with a one-line meaning: ``--print_config``.

``MEANINGS`` documents the keys of ``presets.base_config()`` and the keys the
objectives add; a key under a documented section (e.g. ``model.vision.*``)
falls back to the section's line.
"""

from __future__ import annotations

from typing import Any, Mapping

MEANINGS = {
    'seed': 'seeds the parameters, the data order and the step randomness',
    'objective': 'prolip | siglip | clip | pcme | otter | uniclip | pcclip',
    'batch_size': 'global batch (all devices and hosts)',
    'total_steps': 'optimizer steps of the run (the schedule spans them)',
    'log_every_steps': 'progress line and metrics.jsonl row interval',
    'checkpoint_every_steps': 'Orbax checkpoint interval (also on SIGTERM)',
    'keep_checkpoints': 'newest checkpoints kept; older ones are deleted',
    'max_nonfinite_steps': 'stop after this many consecutive steps with a '
                           'non-finite loss/gradient (each is skipped)',
    'debug_nan_steps': 'fault injection for tests: make these steps\' loss '
                       'NaN',
    'model': 'architecture; changing it on resume is refused',
    'model.embed_dim': 'dimension d of the shared embedding space',
    'model.vision': 'image tower (ViT): size, patch, width, layers, heads',
    'model.text': 'text tower: vocabulary, context length, width, layers',
    'model.use_unc': 'add the [UNC] tokens: Gaussian (mu, log sigma^2) '
                     'outputs',
    'model.release_compat': 'layout and quirks of the public PyTorch release',
    'model.init_logit_scale': 'initial a = exp(log a) of the logits',
    'model.init_logit_bias': 'initial b of the logits',
    'model.init_unc_bias': 'initial bias of the [UNC] head (log sigma^2)',
    'model.compute_dtype': 'float32 | bfloat16 activations (params stay fp32)',
    'model.remat': 'rematerialise transformer blocks (less memory)',
    'model.remat_policy': ('what remat keeps: nothing_saveable (remat=True '
                           'as before) | dots_saveable | '
                           'dots_with_no_batch_dims_saveable'),
    'model.scan': ('one nn.scan over the block stack (layer-stacked params, '
                   'faster compile)'),
    'model.attention_impl': ('auto | xla | cudnn: attention kernel; auto is '
                             'cuDNN on NVIDIA GPUs where shapes allow'),
    'loss': 'loss weights and settings of the objectives',
    'loss.alpha1': 'inclusion loss weight, image in text (eq. 6)',
    'loss.alpha2': 'inclusion loss weight, full in masked (eq. 6)',
    'loss.beta': 'VIB weight (eq. 6)',
    'loss.c': 'inclusion-loss sharpness c',
    'loss.eps': 'inclusion-loss stability exponent',
    'loss.vib_release_quirk': 'VIB as the release computes it',
    'loss.guard': 'drop exploding VIB/inclusion terms for a step (release)',
    'loss.otter': 'OTTER: Sinkhorn and EMA-teacher settings',
    'masking': 'masked copies of ProLIP (fraction, keep ratio, text prob)',
    'masking.fraction': 'samples of the batch that get a masked copy',
    'masking.image_keep_ratio': 'patch tokens kept in a masked image',
    'masking.text_mask_prob': 'probability of masking a caption token',
    'optim': 'AdamW and its schedule',
    'optim.lr': 'peak learning rate (after linear warm-up, cosine decay)',
    'optim.b1': 'Adam beta1', 'optim.b2': 'Adam beta2',
    'optim.eps': 'Adam epsilon',
    'optim.weight_decay': 'decoupled weight decay on matrices',
    'optim.warmup_steps': 'linear warm-up steps',
    'optim.end_lr_ratio': 'final lr as a fraction of the peak',
    'optim.grad_clip': 'global-norm gradient clip (0: none)',
    'optim.max_logit_scale': 'clamp of a',
    'optim.unc_lr_mult': ('learning-rate multiplier of the [UNC] tokens and '
                          'uncertainty heads (1: paper)'),
    'data': 'training data and augmentations',
    'data.name': 'digits | emoji | array_record | tfds',
    'data.split': ('split of a bundled source (digits, emoji): train, or fit '
                   '+ val (validation carved from train)'),
    'data.render_size': 'emoji: pixels of the rendered glyphs',
    'data.mean': 'per-channel normalisation mean',
    'data.std': 'per-channel normalisation std',
    'data.crop_scale': 'random resized crop area range',
    'data.jitter': 'colour jitter (brightness, contrast, saturation, hue)',
    'data.jitter_prob': 'probability of colour jitter',
    'data.grayscale_prob': 'probability of grayscale',
    'data.color_on_device': 'apply jitter/grayscale in the train step (the '
                            'host only crops; same random draws)',
    'data.num_views': 'augmented views per image (UniCLIP: > 1)',
    'data.num_workers': 'Grain worker processes (0: in-process)',
    'data.num_threads': 'Grain read threads',
    'data.path': 'array_record shards (glob or brace pattern)',
    'data.tfds_name': 'TFDS dataset name', 'data.tfds_split': 'TFDS split',
    'data.tfds_data_dir': 'TFDS data directory',
    'data.tfds_image_key': 'TFDS image feature',
    'data.tfds_caption_key': 'TFDS caption feature',
    'data.max_bad_fraction': 'stop when more records than this are bad',
    'data.bad_record_warmup': 'records seen before the bad fraction counts',
    'data.tokenizer_max_sentences': 'captions used to train a tokenizer',
    'tokenizer': 'sentencepiece .model or tokenizer.json',
    'tokenizer.model_path': 'a .model file (empty: train one on the captions)',
    'tokenizer.vocab_size': 'pieces of a tokenizer trained here',
    'tokenizer.pad_id': 'pad id (-1: the model\'s)',
    'tokenizer.mask_id': '[MASK] id for masked captions (-1: none)',
    'tokenizer.clean': 'text cleaning: none | whitespace | lower | '
                       'canonicalize (the release)',
    'tokenizer.keep_eos': 'keep EOS when a caption is truncated (release)',
    'init_from': 'start from a Hugging Face snapshot dir or hf-hub:OWNER/NAME',
    'init_tokenizer': 'tokenizer for init_from (file, dir or hf-hub:NAME)',
    'data.eval_view': "eval image transform: default | release (open_clip's)",
    'eval': 'train-time evaluation',
    'eval.every_steps': 'held-out digits eval interval (0: at the end only)',
    'eval.batch_size': 'eval batch',
    'mesh': 'device mesh: data and fsdp axes (-1: the rest)',
    'mesh.data': 'data-parallel axis size', 'mesh.fsdp': 'FSDP axis size',
    'mesh.num_devices': 'devices used (0: all)',
    'uniclip': 'UniCLIP heads and temperature',
}


def flatten(config: Any, prefix: str = '') -> dict[str, Any]:
  """``{'a.b.c': value}`` of a nested ConfigDict or dict."""
  out = {}
  items = config.items() if isinstance(config, Mapping) else (
      config.to_dict().items() if hasattr(config, 'to_dict') else ())
  for key, value in items:
    name = f'{prefix}{key}'
    if isinstance(value, Mapping) or hasattr(value, 'to_dict'):
      out.update(flatten(value, name + '.'))
    else:
      out[name] = value
  return out


def meaning(key: str) -> str:
  """The documented meaning of ``key`` or of its nearest documented
  section."""
  parts = key.split('.')
  for n in range(len(parts), 0, -1):
    found = MEANINGS.get('.'.join(parts[:n]))
    if found:
      return found
  return ''


def describe(config: Any) -> str:
  """One line per key: ``key = value  # meaning``."""
  flat = flatten(config)
  width = max(len(f'{k} = {v!r}') for k, v in flat.items())
  lines = []
  for key, value in flat.items():
    text = f'{key} = {value!r}'
    note = meaning(key)
    lines.append(f'{text:{width}s}  # {note}' if note else text)
  return '\n'.join(lines)
