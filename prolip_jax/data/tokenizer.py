"""Tokenisation to fixed-length id arrays: sentencepiece or ``tokenizer.json``.

One ``Tokenizer`` class reads either kind of file, told apart by content (a
``tokenizer.json`` is JSON, a sentencepiece ``.model`` a protobuf), so a
``tokenizer.json`` copied to ``WORKDIR/tokenizer.model`` still opens:

* sentencepiece ``.model`` files through ``sentencepiece``;
* Hugging Face ``tokenizer.json`` files through the ``tokenizers`` library
  (what ``transformers.AutoTokenizer`` runs for fast tokenizers), with the
  file's own normaliser, pre-tokeniser, model and post-processor (e.g. the
  T5/SigLIP one appending ``</s>``).

Captions are first cleaned (``clean``, see ``text_clean``: 'none',
'whitespace', 'lower', 'canonicalize').

Reserved ids of tokenizers trained by this project (``train_tokenizer``):
pad = 0, eos = 1, unk = 2, [MASK] = 3 (a user-defined piece). Any other
``.model`` file works too (e.g. the 32k SigLIP vocabulary: pad 1 in the
release's convention and [MASK] = ``<extra_id_99>`` = 32000): ids the model
does not define come from the config.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import sentencepiece as spm

from prolip_jax.config import keys as config_keys
from prolip_jax import errors
from prolip_jax.storage import file_names
from prolip_jax.data import text_clean

MASK_PIECE = '[MASK]'
# sentencepiece encodes a list of texts on a thread pool that it starts at
# every call: ~0.3 ms of overhead, 40x the encoding of one caption (8 us),
# which the input pipeline pays for every example. Lists shorter than this
# are encoded one text at a time (the two cross near 100 texts: 1 text
# 327 us against 8 us, 16 texts 615 against 115, 256 texts 943 against
# 1,546; sentencepiece 0.2.3, 2026-12-07, this 2-core VM).
_BATCH_ENCODE_MIN = 64
SENTENCEPIECE = 'sentencepiece'
HF_JSON = file_names.TOKENIZER_JSON  # the kind is named after its file


def file_kind(path: str) -> str:
  """``'tokenizer.json'`` for a JSON file, else ``'sentencepiece'``."""
  with open(path, 'rb') as f:
    head = f.read(64).lstrip()
  return HF_JSON if head.startswith(b'{') else SENTENCEPIECE


def file_sha256(path: str) -> str:
  """Hex sha256 of a file's bytes: the identity of a tokenizer, stored in
  checkpoints and exports so that a model is never run with another one."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def _token_str(value: Any) -> Optional[str]:
  if isinstance(value, dict):
    return value.get('content')
  return value if isinstance(value, str) else None


def hf_special_tokens(path: str) -> dict[str, str]:
  """``{'pad_token': ..., 'eos_token': ..., ...}`` from the
  ``tokenizer_config.json`` / ``special_tokens_map.json`` next to ``path``
  (later files do not override earlier ones; empty when there are none)."""
  out: dict[str, str] = {}
  for name in file_names.TOKENIZER_SIDE_FILES:
    side = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    if not os.path.isfile(side):
      continue
    with open(side) as f:
      cfg = json.load(f)
    for key in ('pad_token', 'eos_token', 'unk_token', 'mask_token'):
      token = _token_str(cfg.get(key))
      if token is not None:
        out.setdefault(key, token)
  return out


class Tokenizer:
  """Encodes captions into ``(n, context_length)`` int32 arrays.

  Each caption is cleaned (``clean``), split into ids and right-padded to
  ``context_length`` with ``pad_id``. The model relies on right padding:
  [UNC]/[CLS] go after the last non-pad id.

  sentencepiece files: the pieces, then EOS (when the model has one and
  ``add_eos``), then truncation to ``context_length``; with ``keep_eos`` the
  truncated row ends in EOS instead (what Hugging Face tokenizers do, so a
  sentencepiece model and its ``tokenizer.json`` conversion give the same
  ids; the project's own configs keep the historical cut).

  ``tokenizer.json`` files: exactly what ``transformers.AutoTokenizer``
  returns for ``tok(texts, padding='max_length', truncation=True,
  max_length=context_length)``: the file's post-processor adds its special
  tokens (EOS ``</s>`` for T5/SigLIP) and truncation keeps them.
  ``pad_id`` defaults to the ``pad_token`` of a ``tokenizer_config.json`` /
  ``special_tokens_map.json`` beside the file, else the file's padding
  setting; ``mask_id`` to a ``[MASK]`` or ``mask_token`` token.
  """

  def __init__(self, model_path: str, context_length: int,
               pad_id: Optional[int] = None, mask_id: Optional[int] = None,
               add_eos: bool = True, clean: str = 'none',
               keep_eos: bool = False):
    if not os.path.exists(model_path):
      raise FileNotFoundError(f'tokenizer file not found: {model_path}')
    if os.path.isdir(model_path):
      raise errors.TokenizerError(f'tokenizer file {model_path} is a '
                                  'directory')
    if os.path.getsize(model_path) == 0:
      raise errors.TokenizerError(
          f'tokenizer file {model_path} is empty (an interrupted copy?): put '
          'the sentencepiece .model or tokenizer.json back')
    self.model_path = model_path
    self.context_length = context_length
    self.clean = clean
    self.clean_fn = text_clean.get_clean_fn(clean)
    self.keep_eos = keep_eos
    self.kind = file_kind(model_path)
    self.sha256 = file_sha256(model_path)
    if self.kind == HF_JSON:
      self._init_hf(pad_id, mask_id)
    else:
      self._init_sp(pad_id, mask_id, add_eos)

  def _init_sp(self, pad_id, mask_id, add_eos):
    model_path = self.model_path
    try:
      self.sp = spm.SentencePieceProcessor(model_file=model_path)
      if self.sp.get_piece_size() <= 0:
        raise ValueError('no pieces')
    except Exception as e:  # pylint: disable=broad-except
      # sentencepiece says only 'could not parse ModelProto' (or 'unk is not
      # defined'), without the file.
      raise errors.TokenizerError(
          f'tokenizer file {model_path} is not a readable sentencepiece model '
          f'or tokenizer.json ({" ".join(str(e).split())[:120]}): replace it '
          'with the right file') from e
    sp_pad = self.sp.pad_id()
    self.pad_id = pad_id if pad_id is not None else sp_pad
    if self.pad_id is None or self.pad_id < 0:
      raise ValueError(f'{model_path} defines no pad id; set tokenizer.pad_id')
    sp_mask = self.sp.piece_to_id(MASK_PIECE)
    if mask_id is None:
      if sp_mask == self.sp.unk_id():
        raise ValueError(f'{model_path} has no {MASK_PIECE} piece; set '
                         'tokenizer.mask_id')
      mask_id = sp_mask
    self.mask_id = mask_id
    self.eos_id = self.sp.eos_id() if add_eos else -1
    self.vocab_size = self.sp.get_piece_size()

  def _init_hf(self, pad_id, mask_id):
    import tokenizers  # pylint: disable=g-import-not-at-top
    path = self.model_path
    try:
      self.hf = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except
      raise errors.TokenizerError(
          f'tokenizer file {path} is not a readable tokenizer.json '
          f'({" ".join(str(e).split())[:120]}): replace it with the right '
          'file') from e
    special = hf_special_tokens(path)
    to_id = self.hf.token_to_id
    if pad_id is None:
      if 'pad_token' in special:
        pad_id = to_id(special['pad_token'])
      elif self.hf.padding is not None:
        pad_id = self.hf.padding.get('pad_id')
    if pad_id is None or pad_id < 0:
      raise ValueError(f'{path} names no pad token (no tokenizer_config.json '
                       'pad_token beside it, no padding setting); set '
                       'tokenizer.pad_id')
    self.pad_id = int(pad_id)
    if mask_id is None:
      for token in (MASK_PIECE, special.get('mask_token')):
        if token is not None and to_id(token) is not None:
          mask_id = to_id(token)
          break
      else:
        raise ValueError(f'{path} has no {MASK_PIECE} token; set '
                         'tokenizer.mask_id')
    self.mask_id = int(mask_id)
    eos = to_id(special.get('eos_token', '</s>'))
    self.eos_id = -1 if eos is None else int(eos)
    self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
    self.hf.no_padding()
    self.hf.enable_truncation(max_length=self.context_length)

  def __getstate__(self):  # picklable for Grain worker processes
    return {k: v for k, v in self.__dict__.items()
            if k not in ('sp', 'hf', 'clean_fn')}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self.clean_fn = text_clean.get_clean_fn(self.clean)
    if self.kind == HF_JSON:
      import tokenizers  # pylint: disable=g-import-not-at-top
      self.hf = tokenizers.Tokenizer.from_file(self.model_path)
      self.hf.no_padding()
      self.hf.enable_truncation(max_length=self.context_length)
    else:
      self.sp = spm.SentencePieceProcessor(model_file=self.model_path)

  def encode_ids(self, texts: Sequence[str]) -> list[list[int]]:
    """Cleaned, tokenised, truncated ids of each text (no padding)."""
    texts = [self.clean_fn(t) for t in texts]
    n = self.context_length
    if self.kind == HF_JSON:
      return [e.ids for e in self.hf.encode_batch(texts)]
    if len(texts) < _BATCH_ENCODE_MIN:
      pieces = [self.sp.encode(t) for t in texts]
    else:
      pieces = self.sp.encode(texts)
    out = []
    for ids in pieces:
      if self.eos_id >= 0:
        if self.keep_eos and len(ids) >= n:
          ids = ids[:n - 1]
        ids = ids + [self.eos_id]
      out.append(ids[:n])
    return out

  def __call__(self, texts: Sequence[str] | str) -> np.ndarray:
    if isinstance(texts, str):
      texts = [texts]
    out = np.full((len(texts), self.context_length), self.pad_id, np.int32)
    for i, ids in enumerate(self.encode_ids(list(texts))):
      out[i, :len(ids)] = ids
    return out


def tokenizer_from_config(path: str, config: Any, context_length: int,
                          pad_id: Optional[int] = None) -> Tokenizer:
  """The ``Tokenizer`` of file ``path`` with a run config's ``tokenizer.*``
  settings: ``pad_id`` and ``mask_id`` (-1: the file's own / none),
  ``clean`` and ``keep_eos``.

  ``config``: a ConfigDict, or the dict a checkpoint stores; a key it lacks
  (a run stored by an older version) takes its declared default
  (``config_keys``). ``pad_id``, when given, replaces the config's: a
  trained model pads with the id its model config recorded.
  """
  if pad_id is None:
    pad = config_keys.get(config, 'tokenizer.pad_id')
    pad_id = None if pad < 0 else pad
  mask = config_keys.get(config, 'tokenizer.mask_id')
  return Tokenizer(path, context_length, pad_id=pad_id,
                   mask_id=None if mask < 0 else mask,
                   clean=config_keys.get(config, 'tokenizer.clean'),
                   keep_eos=config_keys.get(config, 'tokenizer.keep_eos'))


def train_tokenizer(sentences: Iterable[str], model_path: str,
                    vocab_size: int) -> str:
  """Trains a unigram sentencepiece model with the reserved ids above.

  Deterministic for a given list of sentences (one thread). ``vocab_size`` is
  an upper bound: small corpora get the vocabulary they can support. The
  model is written atomically to ``model_path``.
  """
  model_path = os.path.abspath(model_path)
  os.makedirs(os.path.dirname(model_path), exist_ok=True)
  with tempfile.TemporaryDirectory(dir=os.path.dirname(model_path)) as tmp:
    prefix = os.path.join(tmp, 'spm')
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(sentences)), model_prefix=prefix,
        vocab_size=vocab_size, model_type='unigram', pad_id=0, eos_id=1,
        unk_id=2, bos_id=-1, user_defined_symbols=[MASK_PIECE],
        character_coverage=1.0, hard_vocab_limit=False, num_threads=1,
        minloglevel=2)
    os.replace(prefix + '.model', model_path)
  return model_path
