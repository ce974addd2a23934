"""Every config key, declared once: its default, its meaning and whether a
resumed run may change it.

``KEYS`` is read by ``presets.base_config`` (the defaults), by
``config_help.describe`` (``--print_config``) and by ``config_drift.check``
(what a resume may change). A key that is ``fixed`` says why: it changes the
parameter tree, the optimizer-state tree, the data order or the tokenizer,
or it otherwise defines the model the checkpoint holds. Everything else may
change on resume and the change is printed and applied.

``tests/test_config_keys.py`` derives fixed-ness rather than trusting it:
every ``optim.*`` key whose change alters the optimizer-state tree of
``optimizer.make_optimizer`` and every ``model.*``/``uniclip.*`` key whose change
alters the parameter tree must be declared with ``OPTIMIZER_TREE`` or
``PARAMETER_TREE``, and the other way round.

Adding a key is one line in ``KEYS``, e.g.
``'model.scan': Key(False, 'scan the transformer blocks', PARAMETER_TREE),``
(``fixed`` omitted: the key may change on resume). A key with ``added_by``
belongs to one objective's configs only (not in ``base_config``).

Defaults written elsewhere are read, not repeated: the model sizes are the
``tiny`` row of ``sizes.SIZES`` and the loss weights the papers' values of
``paper`` (which the loss functions take as their keyword defaults).

Names a registry defines are not written here either: a key whose value is
one of them names its registry (``choices``: the objectives, the data
sources, the evaluator kinds). The packages that define them import this
one, so ``prolip_jax/registries.py``, above both, lists them for
``--print_config``; each registry's own lookup names them in its error for
a value it does not hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import ml_collections

from prolip_jax.config import paper
from prolip_jax.config import ranges
from prolip_jax.config import sizes

# Why a key may not change on resume.
PARAMETER_TREE = 'changes the parameter tree'
OPTIMIZER_TREE = 'changes the optimizer-state tree'
DATA = 'changes the data order or the training batches'
TOKENIZER = 'changes the tokenizer (the token ids)'
MODEL = 'changes the model the checkpoint holds'

# OpenAI CLIP's per-channel image mean and std (open_clip's
# OPENAI_DATASET_MEAN/STD): the default normalisation of a run, and what a
# release snapshot or an old checkpoint without its own is normalised with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# The model size of the declared defaults (base_config's model).
_TINY = sizes.SIZES['tiny']


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key: ``default``, one-line ``meaning``, ``fixed`` (why it may
  not change on resume; '' when it may), ``added_by`` (the objective whose
  configs add it; '' for every config), ``minimum`` (a count, size or
  interval: the smallest integer it may be, checked by ``check_values``
  before any work; None: not a count), ``none_allowed`` (None is a valid
  value of such a count, its meaning said in ``meaning``), ``removes``
  (what a value of it
  deletes from the workdir: printed when a run starts with files it will
  delete), ``choices`` (the registry whose names are its values, one
  of ``registries.REGISTRIES``; '' : none) and ``within`` (a number's
  valid interval, e.g. ``'[0, 1)'`` in ``config/ranges.py``'s notation,
  checked by ``check_values`` with the counts; '' : not a number)."""
  default: Any
  meaning: str
  fixed: str = ''
  added_by: str = ''
  minimum: int | None = None
  none_allowed: bool = False
  removes: str = ''
  choices: str = ''
  within: str = ''


KEYS: dict[str, Key] = {
    'seed': Key(0, 'seeds the parameters, the data order and the step '
                'randomness', DATA),
    'objective': Key('prolip', 'the training objective: a module of '
                     'prolip_jax/objectives/', MODEL, choices='objectives'),
    'batch_size': Key(128, 'global batch (all devices and hosts)', DATA, minimum=1),
    # May change on resume: the step's loss, masks and data are the whole
    # batch's whatever the split (training/accumulation.py).
    'accum_steps': Key(1, "micro-batches per step: each device's batch is "
                       'split K ways, the towers run one micro-batch at a '
                       'time, the loss sees the whole global batch (exact)',
                       minimum=1),
    'total_steps': Key(1000, 'optimizer steps of the run (the schedule spans '
                       'them)', minimum=1),
    # -- the model: the sizes are the tiny row of sizes.SIZES (a preset or
    # presets.model_size lays another row over them)
    'model.embed_dim': Key(_TINY.embed_dim, 'dimension d of the shared '
                           'embedding space', PARAMETER_TREE, minimum=1),
    'model.vision.image_size': Key(_TINY.image_size, 'image side in pixels',
                                   PARAMETER_TREE, minimum=1),
    'model.vision.patch_size': Key(_TINY.patch_size, 'ViT patch side in '
                                   'pixels', PARAMETER_TREE, minimum=1),
    'model.vision.width': Key(_TINY.vision.width, 'image tower width',
                              PARAMETER_TREE, minimum=1),
    'model.vision.layers': Key(_TINY.vision.layers, 'image tower blocks',
                               PARAMETER_TREE, minimum=1),
    'model.vision.heads': Key(_TINY.vision.heads, 'image tower attention '
                              'heads', MODEL, minimum=1),
    'model.vision.mlp_ratio': Key(_TINY.vision.mlp_ratio, 'image MLP width / '
                                  'tower width', PARAMETER_TREE,
                                  within='(0, inf)'),
    'model.vision.act': Key(_TINY.vision.act, 'image MLP activation: gelu | '
                            'gelu_tanh | quick_gelu', MODEL),
    'model.vision.ln_eps': Key(1e-5, 'image LayerNorm epsilon', MODEL,
                               within='(0, inf)'),
    'model.text.vocab_size': Key(_TINY.vocab_size, 'text embedding rows (>= '
                                 'tokenizer pieces)', PARAMETER_TREE,
                                 minimum=1),
    'model.text.context_length': Key(_TINY.context_length, 'caption tokens',
                                     PARAMETER_TREE, minimum=1),
    'model.text.width': Key(_TINY.text.width, 'text tower width',
                            PARAMETER_TREE, minimum=1),
    'model.text.layers': Key(_TINY.text.layers, 'text tower blocks',
                             PARAMETER_TREE, minimum=1),
    'model.text.heads': Key(_TINY.text.heads, 'text tower attention heads',
                            MODEL, minimum=1),
    'model.text.mlp_ratio': Key(_TINY.text.mlp_ratio, 'text MLP width / tower '
                                'width', PARAMETER_TREE, within='(0, inf)'),
    'model.text.act': Key(_TINY.text.act, 'text MLP activation: gelu | '
                          'gelu_tanh | quick_gelu', MODEL),
    'model.text.ln_eps': Key(1e-6, 'text LayerNorm epsilon', MODEL,
                             within='(0, inf)'),
    'model.text.pad_id': Key(0, "pad id (replaced by the tokenizer's)",
                             TOKENIZER),
    'model.text.proj_bias': Key(True, 'text projection has a bias',
                                PARAMETER_TREE),
    'model.text.pool': Key('cls', "text pooling: cls | argmax (open_clip's "
                           'end-of-text)', PARAMETER_TREE),
    'model.text.causal': Key(False, 'causal text attention mask', MODEL),
    'model.use_unc': Key(True, 'add the [UNC] tokens: Gaussian (mu, log '
                         'sigma^2) outputs', PARAMETER_TREE),
    'model.release_compat': Key(False, 'layout and quirks of the public '
                                'PyTorch release', PARAMETER_TREE),
    'model.init_logit_scale': Key(10.0, 'initial a = exp(log a) of the '
                                  'logits', MODEL, within='(0, inf)'),
    'model.init_logit_bias': Key(-10.0, 'initial b of the logits', MODEL,
                                 within='(-inf, inf)'),
    'model.init_unc_bias': Key(-10.0, 'initial bias of the [UNC] head (log '
                               'sigma^2)', MODEL, within='(-inf, inf)'),
    'model.compute_dtype': Key('float32', 'float32 | bfloat16 activations '
                               '(params stay fp32)'),
    'model.remat': Key(False, 'rematerialise transformer blocks (less '
                       'memory)'),
    'model.remat_policy': Key('nothing_saveable', 'what remat keeps: '
                              'nothing_saveable (remat=True as before) | '
                              'dots_saveable | '
                              'dots_with_no_batch_dims_saveable'),
    'model.scan': Key(False, 'one nn.scan over the block stack (layer-'
                      'stacked params, faster compile)', PARAMETER_TREE),
    'model.attention_impl': Key('auto', 'auto | xla | cudnn: attention '
                                'kernel; auto is cuDNN on NVIDIA GPUs where '
                                'shapes allow'),
    'model.attention_logits_dtype': Key(
        'float32', 'float32 | bfloat16: the dtype XLA attention rounds q.k '
        'to before its float32 softmax (bfloat16: less memory traffic, '
        'slightly different numbers; docs/scaling.md); cuDNN ignores it'),
    # -- losses (the papers' values: config/paper.py)
    'loss.alpha1': Key(paper.ALPHA1, 'inclusion loss weight, image in text '
                       '(eq. 6)', within='[0, inf)'),
    'loss.alpha2': Key(paper.ALPHA2, 'inclusion loss weight, full in masked '
                       '(eq. 6)', within='[0, inf)'),
    'loss.beta': Key(paper.BETA, 'VIB weight (eq. 6)', within='[0, inf)'),
    'loss.c': Key(paper.INCLUSION_C, 'inclusion-loss sharpness c',
                  within='(0, inf)'),
    'loss.eps': Key(paper.INCLUSION_EPS, 'inclusion-loss stability exponent',
                    within='(-inf, inf)'),
    'loss.vib_release_quirk': Key(False, 'VIB as the release computes it'),
    'loss.guard': Key(True, 'drop exploding VIB/inclusion terms for a step '
                      '(release)'),
    'loss.otter.alpha': Key(paper.OTTER_ALPHA, 'OTTER: weight of the hard '
                            'InfoNCE labels', within='[0, 1]'),
    'loss.otter.lam': Key(paper.OTTER_LAMBDA, 'OTTER: Sinkhorn temperature '
                          'lambda', within='(0, inf)'),
    'loss.otter.n_iter': Key(paper.OTTER_ITERS, 'OTTER: Sinkhorn iterations',
                             minimum=1),
    'loss.otter.gamma_v': Key(paper.OTTER_GAMMA_V, 'OTTER: weight of '
                              'image-image similarity', within='[0, inf)'),
    'loss.otter.gamma_t': Key(paper.OTTER_GAMMA_T, 'OTTER: weight of '
                              'text-text similarity', within='[0, inf)'),
    'loss.otter.eta': Key(paper.OTTER_ETA, 'OTTER: diagonal penalty of the '
                          'targets', within='[0, inf]'),
    'loss.pcclip_weight': Key(1.0, 'PC-CLIP: weight of eq. 1', added_by=
                              'pcclip', within='[0, inf)'),
    'loss.pcclip_tau': Key(paper.PCCLIP_TAU, 'PC-CLIP: tau of eq. 4 '
                           '(appendix C.1: 1)',
                           added_by='pcclip', within='(0, inf)'),
    'loss.pcclip_squared': Key(False, "PC-CLIP: eq. 5's squared loss",
                               added_by='pcclip'),
    'loss.pcclip_max_phrases': Key(1, 'PC-CLIP: differing attributes per '
                                   'pair (0: all)', DATA, added_by='pcclip', minimum=0),
    'loss.mp_nce_weights': Key('balanced', 'UniCLIP domain weights: balanced '
                               '| uniform | (w_II, w_IT, w_TT)',
                               added_by='uniclip'),
    # -- masked copies (ProLIP)
    'masking.fraction': Key(0.125, 'samples of the batch that get a masked '
                            'copy', DATA, within='[0, 1]'),
    'masking.image_keep_ratio': Key(0.25, 'patch tokens kept in a masked '
                                    'image (paper: 75% dropped)', DATA,
                                    within='(0, 1]'),
    'masking.text_mask_prob': Key(0.75, 'probability of masking a caption '
                                  'token', DATA, within='[0, 1]'),
    # -- optimizer
    'optim.lr': Key(5e-4, 'peak learning rate (after linear warm-up, cosine '
                    'decay)', within='[0, inf)'),
    'optim.b1': Key(0.9, 'Adam beta1', within='[0, 1)'),
    'optim.b2': Key(0.95, 'Adam beta2', within='[0, 1)'),
    'optim.eps': Key(1e-6, 'Adam epsilon', within='(0, inf)'),
    'optim.weight_decay': Key(0.2, 'decoupled weight decay on matrices',
                              within='[0, inf)'),
    'optim.warmup_steps': Key(100, 'linear warm-up steps', minimum=0),
    'optim.end_lr_ratio': Key(0.0, 'final lr as a fraction of the peak',
                              within='[0, 1]'),
    'optim.grad_clip': Key(0.0, 'global-norm gradient clip (0: none)',
                           OPTIMIZER_TREE, within='[0, inf)'),
    'optim.max_logit_scale': Key(100.0, 'clamp of a', within='(0, inf)'),
    'optim.unc_lr_mult': Key(1.0, 'learning-rate multiplier of the [UNC] '
                             'tokens and uncertainty heads (1: paper)',
                             OPTIMIZER_TREE, within='[0, inf)'),
    # May change on resume: turned on, the average starts from the restored
    # parameters (a notice says so); turned off, it is dropped.
    'optim.ema_decay': Key(0.0, 'decay m of an exponential moving average '
                           'of the parameters, kept in the train state and '
                           'saved with it (0: none); the evaluators score it; '
                           f'OTTER distils from it (paper m = '
                           f'{paper.OTTER_EMA_DECAY})', within='[0, 1)'),
    'optim.freeze': Key((), 'frozen (locked) parameters: regular expressions '
                        "matched in full against '/'-joined parameter paths, "
                        "e.g. ('visual/.*',) locks the image tower (LiT); "
                        'no update, no optimizer state', OPTIMIZER_TREE),
    # -- data
    'data.name': Key('digits', 'the training data source', DATA,
                     choices='sources'),
    # An open subtree read by data/sources/mixture.py. An entry's
    # weight is SOURCE_WEIGHT (may change on resume), its data.* fields are
    # declared as data's own (ENTRY_FIELDS_OF); adding or removing a source
    # is fixed (docs/config_and_resume.md).
    'data.sources': Key({}, 'weighted mixture instead of data.name: {label: '
                        '{name, weight, <data.* source fields: path, split, '
                        'tfds_name, ...>}} mixed by grain.MapDataset.mix '
                        '(empty: data.name alone)', DATA),
    'data.split': Key('train', 'split of a bundled source (digits, emoji): '
                      'train, or fit + val (validation carved from train)',
                      DATA),
    'data.render_size': Key(64, 'emoji: pixels of the rendered glyphs',
                            DATA, minimum=1),
    'data.captions': Key('templates', 'digits, emoji: templates | '
                         'paraphrases (every level worded with the same '
                         'phrasings, one drawn per example)', DATA),
    'data.mean': Key(CLIP_MEAN, "per-channel normalisation mean (CLIP's)",
                     DATA, within='(-inf, inf)'),
    'data.std': Key(CLIP_STD, "per-channel normalisation std (CLIP's)",
                    DATA, within='(0, inf)'),
    'data.crop_scale': Key((0.8, 1.0), 'random resized crop area range',
                           DATA, within='(0, 1]'),
    'data.jitter': Key((0.32, 0.32, 0.32, 0.08), 'colour jitter (brightness, '
                       'contrast, saturation, hue)', DATA, within='[0, inf)'),
    'data.jitter_prob': Key(0.8, 'probability of colour jitter', DATA,
                            within='[0, 1]'),
    'data.grayscale_prob': Key(0.2, 'probability of grayscale', DATA,
                               within='[0, 1]'),
    'data.color_on_device': Key(False, 'apply jitter/grayscale in the train '
                                'step (the host only crops)', DATA),
    'data.decode': Key('host', "training decode, crop and resize: host "
                       "(Grain's CPU threads) | dali (NVIDIA DALI: nvJPEG on "
                       'a GPU, its CPU backend without one; needs encoded '
                       "records; implies color_on_device; pip install -e "
                       "'.[dali]')", DATA),
    'data.num_views': Key(1, 'augmented views per image (UniCLIP: > 1)',
                          DATA, minimum=1),
    'data.num_workers': Key(0, 'Grain worker processes (0: in-process)', minimum=0),
    'data.num_threads': Key(2, 'Grain read threads', minimum=1),
    'data.path': Key('', 'array_record shards (glob or brace pattern)', DATA),
    'data.tfds_name': Key('', 'TFDS dataset name', DATA),
    'data.tfds_split': Key('train', 'TFDS split', DATA),
    'data.tfds_data_dir': Key('', 'TFDS data directory'),
    'data.tfds_image_key': Key('image', 'TFDS image feature', DATA),
    'data.tfds_caption_key': Key('caption', 'TFDS caption feature', DATA),
    'data.max_bad_fraction': Key(0.01, 'stop when more records than this are '
                                 'bad', within='[0, 1)'),
    'data.bad_record_warmup': Key(1000, 'records seen before the bad '
                                  'fraction counts', minimum=0),
    'data.tokenizer_max_sentences': Key(1_000_000, 'captions used to train a '
                                        'tokenizer (first run only)', minimum=1),
    'data.eval_view': Key('default', "eval image transform: default | "
                          "release (open_clip's)"),
    'data.eval_image_order': Key('rgb_first', 'eval decode: rgb_first | '
                                 'release (resize in the stored mode, RGB '
                                 'last)'),
    # -- tokenizer
    'tokenizer.model_path': Key('', 'a .model file (empty: train one on the '
                                'captions)', TOKENIZER),
    'tokenizer.vocab_size': Key(256, 'pieces of a tokenizer trained here',
                                TOKENIZER, minimum=1),
    'tokenizer.pad_id': Key(-1, "pad id (-1: the model's)", TOKENIZER),
    'tokenizer.mask_id': Key(-1, '[MASK] id for masked captions (-1: none)',
                             TOKENIZER),
    'tokenizer.clean': Key('none', 'text cleaning: none | whitespace | lower '
                           '| canonicalize (the release)', TOKENIZER),
    'tokenizer.keep_eos': Key(False, 'keep EOS when a caption is truncated '
                              '(release)', TOKENIZER),
    'init_from': Key('', 'start from a Hugging Face snapshot dir or '
                     'hf-hub:OWNER/NAME'),
    'init_tokenizer': Key('', 'tokenizer for init_from (file, dir or '
                          'hf-hub:NAME)'),
    'init_image_size': Key(0, 'image side in pixels to fine-tune init_from '
                           "at (0: the snapshot's); its image position "
                           'embeddings are resampled', minimum=0),
    # -- evaluation, logging, checkpoints, devices
    'eval.tfds_data_dir': Key('', 'TFDS data_dir of the evaluators that set '
                              'none (config.evals)'),
    # An open subtree: every key under it is this declaration's.
    'evals': Key({}, 'evaluators run in training and by evaluate: {name: '
                 '{kind, data, every_steps, ...}} (evaluation/evaluator.py; '
                 'one module per kind in evaluation/kinds/)'),
    'log_every_steps': Key(20, 'progress line and metrics.jsonl row '
                           'interval', minimum=1),
    # -- reporting (may change on resume; docs/training.md)
    'profile_steps': Key('', 'A:B: jax.profiler trace of steps A..B into '
                         'WORKDIR/tensorboard (empty: none)'),
    'wandb.project': Key('', 'Weights & Biases project: every metrics.jsonl '
                         'row also goes to W&B (empty: off; needs pip '
                         'install wandb)'),
    'wandb.entity': Key('', 'W&B entity (team or user; empty: your '
                        'default)'),
    'wandb.name': Key('', 'W&B run name (empty: the workdir folder name)'),
    'wandb.mode': Key('', 'online | offline | disabled (empty: WANDB_MODE, '
                      'else online)'),
    'checkpoint_every_steps': Key(200, 'Orbax checkpoint interval (also on '
                                  'SIGTERM)', minimum=1),
    'keep_checkpoints': Key(3, 'newest checkpoints kept (None: every one); '
                            'older ones are deleted', minimum=1,
                            none_allowed=True,
                            removes='the checkpoints older than the newest '
                            'keep_checkpoints'),
    'max_nonfinite_steps': Key(5, 'stop after this many consecutive steps '
                               'with a non-finite loss/gradient (each is '
                               'skipped)', minimum=1),
    'debug_nan_steps': Key((), "fault injection for tests: make these "
                           "steps' loss NaN"),
    'debug_raise_at_step': Key(0, 'fault injection for tests: raise a '
                               'RuntimeError after this step (0: never)'),
    'debug_raise_process': Key(-1, 'fault injection for tests: the process '
                               'that raises at debug_raise_at_step (-1: '
                               'every process)'),
    'mesh.data': Key(-1, 'data-parallel axis size (-1: the rest)'),
    'mesh.fsdp': Key(1, 'FSDP axis size', minimum=1),
    'mesh.num_devices': Key(0, 'devices used (0: all)', minimum=0),
    'mesh.fsdp_min_size_mb': Key(4.0, 'FSDP floor: parameters (and their '
                                 'optimizer state) under this many MiB stay '
                                 'replicated', within='[0, inf)'),
    # -- UniCLIP heads (objectives/uniclip.py)
    'uniclip.embed_dim': Key(0, 'UniCLIP: head output dimension (0: '
                             'model.embed_dim)', PARAMETER_TREE,
                             added_by='uniclip', minimum=0),
    'uniclip.num_blocks': Key(3, 'UniCLIP: residual blocks of the image head',
                              PARAMETER_TREE, added_by='uniclip', minimum=1),
    'uniclip.mlp_ratio': Key(2.0, 'UniCLIP: image-head MLP ratio',
                             PARAMETER_TREE, added_by='uniclip',
                             within='(0, inf)'),
    'uniclip.aug_features': Key(128, 'UniCLIP: width of the augmentation '
                                'encoder f_A', PARAMETER_TREE,
                                added_by='uniclip', minimum=1),
    'uniclip.aug_hidden': Key(128, 'UniCLIP: hidden width of f_A',
                              PARAMETER_TREE, added_by='uniclip', minimum=1),
    'uniclip.use_aug': Key(True, 'UniCLIP: augmentation-aware image head',
                           PARAMETER_TREE, added_by='uniclip'),
    'uniclip.init_tau': Key(0.07, 'UniCLIP: initial tau_D of eq. 16', MODEL,
                            added_by='uniclip', within='(0, inf)'),
    'uniclip.init_offset': Key(0.0, 'UniCLIP: initial b_D of eq. 16', MODEL,
                               added_by='uniclip', within='(-inf, inf)'),
}


def default(key: str) -> Any:
  """The declared default of ``key`` (KeyError for an undeclared one)."""
  return KEYS[key].default


def get(config: Any, key: str) -> Any:
  """``config``'s value of the dotted ``key``, or its declared default when
  ``config`` (e.g. one stored by an older version) lacks it."""
  node = config
  for part in key.split('.'):
    if not isinstance(node, (Mapping, ml_collections.ConfigDict)) or (
        part not in node):
      return default(key)
    node = node[part]
  return node


def check_values(config: Any) -> None:
  """Raises ``ValueError`` naming the first count, size or interval of
  ``config`` (a key declared with a ``minimum``) that is not an integer at
  least that large, e.g. ``checkpoint_every_steps=0``, or the first number
  outside its declared interval (``within``; NaN never inside), e.g.
  ``optim.ema_decay=1.0``: caught with the rest of the config before any
  work, not as a ZeroDivisionError at step 1 or a model that never moves."""
  for key, declared in KEYS.items():
    value = get(config, key)
    if declared.within:
      ranges.check(key, value, declared.within, declared.meaning)
    if declared.minimum is None:
      continue
    if value is None and declared.none_allowed:
      continue
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole and isinstance(value, float) and value.is_integer():
      whole = True
    if not whole or value < declared.minimum:
      raise ValueError(f'{key} must be an integer >= {declared.minimum} '
                       f'(got {value!r}): {declared.meaning}')


# ``data.sources.<label>.weight``: may change on resume, the new weights mix
# from the resumed step on and each source continues where it stopped (the
# checkpoint keeps the weight history: data/mixture.py continue_history).
SOURCE_WEIGHT = Key(1.0, "a source's weight in data.sources (> 0); on "
                    'resume new weights apply from the resumed step, each '
                    'source continuing where it stopped')

# ``evals.<name>.kind``: which evaluator an entry of the open subtree
# ``evals`` is (its other fields are the kind's options, checked by
# evaluation/evaluator.py).
EVAL_KIND = Key('', "an evaluator's kind: a module of "
                'prolip_jax/evaluation/kinds/', choices='evaluator kinds')

# Open subtrees whose entries repeat the fields of another section: a field
# ``data.sources.<label>.path`` is declared as ``data.path`` is (its meaning
# and its fixed-ness on resume); other fields (``weight``) are the subtree's.
ENTRY_FIELDS_OF = {'data.sources': 'data'}


def declaration(key: str) -> Key | None:
  """``key``'s declaration: its own, or that of the open subtree holding it
  (a declared key whose default is a dict, such as ``evals``; for an entry
  field of ``ENTRY_FIELDS_OF``, the field's own declaration in its
  section; ``SOURCE_WEIGHT`` and ``EVAL_KIND`` for a source's weight and an
  evaluator's kind); None when undeclared."""
  if key in KEYS:
    return KEYS[key]
  parts = key.split('.')
  if len(parts) == 4 and parts[:2] == ['data', 'sources'] and (
      parts[3] == 'weight'):
    return SOURCE_WEIGHT
  if len(parts) == 3 and parts[0] == 'evals' and parts[2] == 'kind':
    return EVAL_KIND
  for subtree, section in ENTRY_FIELDS_OF.items():
    depth = subtree.count('.') + 1
    if (len(parts) == depth + 2 and '.'.join(parts[:depth]) == subtree
        and f'{section}.{parts[-1]}' in KEYS):
      return KEYS[f'{section}.{parts[-1]}']
  for i in range(len(parts) - 1, 0, -1):
    found = KEYS.get('.'.join(parts[:i]))
    if found is not None and isinstance(found.default, dict):
      return found
  return None


def fixed_reason(key: str) -> str:
  """Why ``key`` may not change on resume ('' when it may, or when it is
  not declared)."""
  found = declaration(key)
  return found.fixed if found else ''


def meaning(key: str) -> str:
  """The declared meaning of ``key`` ('' when undeclared)."""
  found = declaration(key)
  return found.meaning if found else ''


def defaults(prefix: str = '', added_by: str = '') -> dict[str, Any]:
  """``{key: default}`` of the keys under ``prefix`` (e.g. ``'uniclip.'``)
  that ``added_by`` adds ('' : the keys of every config)."""
  return {k: v.default for k, v in KEYS.items()
          if k.startswith(prefix) and v.added_by == added_by}


def nested(flat: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A ConfigDict from ``{'a.b': value}``."""
  out = ml_collections.ConfigDict()
  for key, value in flat.items():
    node = out
    *parents, last = key.split('.')
    for part in parents:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    node[last] = value
  return out


def add(config: ml_collections.ConfigDict, added_by: str):
  """Adds the declared keys of objective ``added_by`` (their defaults) that
  ``config`` lacks."""
  for key, value in defaults(added_by=added_by).items():
    node = config
    *parents, last = key.split('.')
    for part in parents:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    if last not in node:
      node[last] = value
