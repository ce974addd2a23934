"""Embedding a loaded model's inputs in fixed-size batches, with progress."""

from __future__ import annotations

import sys
import time
from typing import Optional, Sequence

import numpy as np

from prolip_jax import uncertainty
from prolip_jax.embedding import embed_in_batches


class Progress:
  """``progress(done, total)`` callback: an in-place line on a terminal,
  otherwise a line every ``interval`` seconds and at the end."""

  def __init__(self, desc: str, enabled: bool = True, stream=None,
               interval: float = 5.0):
    self.desc, self.enabled = desc, enabled
    self.stream = stream or sys.stderr
    self.interval = interval
    self.start = self.last = time.time()
    self.tty = hasattr(self.stream, 'isatty') and self.stream.isatty()

  def __call__(self, done: int, total: int):
    if not self.enabled:
      return
    now = time.time()
    finished = done >= total
    if not (self.tty or finished or now - self.last >= self.interval):
      return
    self.last = now
    rate = done / max(now - self.start, 1e-9)
    msg = f'{self.desc}: {done}/{total} ({rate:.0f}/s)'
    if self.tty:
      self.stream.write('\r' + msg + ('\n' if finished else ''))
    else:
      self.stream.write(msg + '\n')
    self.stream.flush()


class Embedder:
  """Embeds images (optionally with patch-token drop) and texts of a
  ``LoadedModel`` in fixed-size batches, with progress and a text cache.

  It goes through the model's own encoders (``image_fn``, ``image_keep_fn``,
  ``text_fn``), so a checkpoint scored through an objective's heads (UniCLIP)
  is scored the same way here as by ``LoadedModel.encode_*``.
  """

  def __init__(self, model, batch_size: int = 256, progress: bool = True):
    self.model = model
    self.batch_size = batch_size
    self.progress = progress
    self._text_cache: dict[str, tuple] = {}

  @property
  def probabilistic(self) -> bool:
    return bool(self.model.config.use_unc)

  def _progress(self, desc):
    return Progress(desc, self.progress)

  def images(self, images, keep_ratio: Optional[float] = None, seed: int = 0,
             desc: str = 'images') -> tuple:
    """uint8 images (any size) -> (mu, logvar); ``keep_ratio`` < 1 keeps
    that fraction of patch tokens (random, fixed by ``seed``)."""
    batch = self.model.preprocess_images(list(images))
    if keep_ratio is None or keep_ratio >= 1:
      return embed_in_batches(self.model.image_fn, batch, self.batch_size,
                              self._progress(desc))
    keep = uncertainty.keep_indices_for(
        len(batch), self.model.config.num_patches, keep_ratio, seed)
    return embed_in_batches(self.model.image_keep_fn, (batch, keep), self.batch_size,
                            self._progress(desc))

  def tokens(self, tokens: np.ndarray, desc: str = 'texts') -> tuple:
    return embed_in_batches(self.model.text_fn, np.asarray(tokens, np.int32),
                            self.batch_size, self._progress(desc))

  def texts(self, texts: Sequence[str], desc: str = 'texts') -> tuple:
    """Captions -> (mu, logvar), each distinct caption embedded once."""
    todo = list(dict.fromkeys(t for t in texts if t not in self._text_cache))
    if todo:
      mu, lv = self.tokens(self.model.tokenizer(todo), desc)
      for i, t in enumerate(todo):
        self._text_cache[t] = (mu[i], None if lv is None else lv[i])
    mu = np.stack([self._text_cache[t][0] for t in texts])
    lv = (None if not self.probabilistic else
          np.stack([self._text_cache[t][1] for t in texts]))
    return mu, lv


