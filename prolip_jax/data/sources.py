"""Training record sources selected by ``config.data.name``.

A source is a random-access sequence of records (see ``pipeline``) plus an
optional caption corpus for training a tokenizer when none is configured.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from prolip_jax.data import digits

SOURCES = ('digits',)


def train_source(config) -> tuple[Sequence[dict], Optional[Callable[[], list]]]:
  """The training records and a caption corpus for the tokenizer (or None)."""
  if config.data.name == 'digits':
    return digits.records('train'), digits.tokenizer_corpus
  raise ValueError(f'unknown data.name {config.data.name!r}; have {SOURCES}')
