"""Trains a sentencepiece tokenizer on the captions of array_record shards.

python tools/train_tokenizer.py --input 'OUT_DIR/*.array_record' \
    --output tok.model [--vocab_size 32000] [--max_sentences 2000000]

Reads the captions of up to ``--max_sentences`` records spread evenly over
the shards (images are not decoded) and trains a unigram model with
``prolip_jax.data.tokenizer.train_tokenizer``: reserved ids pad 0, eos 1,
unk 2, ``[MASK]`` 3. Point ``tokenizer.model_path`` at the output and set
``model.text.vocab_size`` to at least the printed vocabulary size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from prolip_jax import errors
from prolip_jax.data import record_format
from prolip_jax.data import record_sources
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import train_tokenizer


class _ShardCaptions:
  """Random access to the parsed records of shards, without Grain/JAX."""

  def __init__(self, pattern: str):
    from array_record.python import array_record_module
    self._mod = array_record_module
    self.paths = record_sources.expand_paths(pattern)
    self.sizes = [record_format.num_records(p) for p in self.paths]
    self._readers = {}

  def __len__(self):
    return sum(self.sizes)

  def __getitem__(self, index):
    for path, n in zip(self.paths, self.sizes):
      if index < n:
        if path not in self._readers:
          self._readers[path] = self._mod.ArrayRecordReader(path)
        return record_format.parse_example(self._readers[path].read([index])[0])
      index -= n
    raise IndexError(index)


def main(argv=None) -> str:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--input', required=True,
                      help='array_record shards (glob / brace pattern)')
  parser.add_argument('--output', required=True, help='the .model to write')
  parser.add_argument('--vocab_size', type=int, default=32000)
  parser.add_argument('--max_sentences', type=int, default=2_000_000)
  args = parser.parse_args(argv)
  t0 = time.time()
  source = _ShardCaptions(args.input)
  corpus = record_sources.caption_corpus(source, args.max_sentences)
  if not corpus:
    raise errors.UserError(f'no captions found in {args.input}')
  print(f'{len(corpus)} captions from {len(source)} records in '
        f'{len(source.paths)} shards ({time.time() - t0:.1f}s); training...',
        flush=True)
  path = train_tokenizer(corpus, args.output, args.vocab_size)
  tok = Tokenizer(path, context_length=64)
  print(f'wrote {path}: {tok.vocab_size} pieces, pad {tok.pad_id}, eos '
        f'{tok.eos_id}, unk {tok.sp.unk_id()}, mask {tok.mask_id} '
        f'({time.time() - t0:.1f}s)')
  return path


if __name__ == '__main__':
  sys.exit(errors.cli_main(main))
