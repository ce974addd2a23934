"""sentencepiece tokenisation to fixed-length id arrays.

Reserved ids of tokenizers trained by this project (``train_tokenizer``):
pad = 0, eos = 1, unk = 2, [MASK] = 3 (a user-defined piece). Any other
``.model`` file works too (e.g. the 32k SigLIP vocabulary: pad 1 in the
release's convention and [MASK] = ``<extra_id_99>`` = 32000): ids the model
does not define come from the config.
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable, Optional, Sequence

import numpy as np
import sentencepiece as spm

MASK_PIECE = '[MASK]'


class Tokenizer:
  """Encodes captions into ``(n, context_length)`` int32 arrays.

  Each caption becomes its pieces, then EOS (when the model has one), then is
  truncated to ``context_length`` and right-padded with ``pad_id``. The model
  relies on right padding: [UNC]/[CLS] go after the last non-pad id.
  """

  def __init__(self, model_path: str, context_length: int,
               pad_id: Optional[int] = None, mask_id: Optional[int] = None,
               add_eos: bool = True):
    if not os.path.exists(model_path):
      raise FileNotFoundError(f'sentencepiece model not found: {model_path}')
    self.model_path = model_path
    self.sp = spm.SentencePieceProcessor(model_file=model_path)
    self.context_length = context_length
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

  def __getstate__(self):  # picklable for Grain worker processes
    return {k: v for k, v in self.__dict__.items() if k != 'sp'}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self.sp = spm.SentencePieceProcessor(model_file=self.model_path)

  def __call__(self, texts: Sequence[str] | str) -> np.ndarray:
    if isinstance(texts, str):
      texts = [texts]
    out = np.full((len(texts), self.context_length), self.pad_id, np.int32)
    for i, ids in enumerate(self.sp.encode(list(texts))):
      if self.eos_id >= 0:
        ids = ids + [self.eos_id]
      ids = ids[:self.context_length]
      out[i, :len(ids)] = ids
    return out


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
