"""The base of the kinds that score a bundled set held in memory (the
uncertainty report, BPRW, traversal, filtering): the set (``sets.EvalData``:
images, labels, captions ordered by hierarchy level), and its images and
captions embedded through the evaluator's ``Encoders`` (every device), each
once per run."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.encoders import in_memory
from prolip_jax.evaluation.sets import EvalData


class InMemoryEvaluator(evaluator.Evaluator):
  """An evaluator of a bundled set (``data='digits'``, ``'emoji:val'``...).

  A kind overrides ``evaluate_set(params, data)``; ``images``, ``texts``
  and ``tokens`` embed through the encoders, and ``image_embeddings`` is
  the set's images embedded once per run.
  """

  DEFAULTS = {'data': 'digits:heldout', 'batch_size': 250}
  NEEDS_DATA = False

  def __init__(self, encoders, name: str = '', **cfg):
    super().__init__(encoders, name, **cfg)
    self._image_embeddings = None
    self._text_cache: dict[str, tuple] = {}

  def data(self) -> EvalData:
    """The entry's bundled set, opened once."""
    return self.opened(sets.bundled_data)

  def evaluate(self, params: Any) -> evaluator.Result:
    # Embeddings are kept for one run only: the next has other parameters.
    self._image_embeddings, self._text_cache = None, {}
    try:
      return self.evaluate_set(params, self.data())
    finally:
      self._image_embeddings, self._text_cache = None, {}

  def evaluate_set(self, params: Any, data: EvalData) -> evaluator.Result:
    """The kind's scores on ``data``."""
    raise NotImplementedError

  def images(self, params: Any, images: np.ndarray,
             keep_ratio: Optional[float] = None, desc: str = 'images'
             ) -> tuple:
    """uint8 images ``(n, h, w, 3)`` -> (mu, logvar); ``keep_ratio`` < 1
    keeps that fraction of patch tokens (random, fixed by the entry's
    ``seed``)."""
    emb = self.encoders.embed_images(
        params, in_memory(desc, images), self.batch_size,
        num_threads=int(self.cfg.num_threads), keep_ratio=keep_ratio,
        seed=self.seed, progress=self.progress(desc))
    return emb.pair

  def image_embeddings(self, params: Any) -> tuple:
    """The set's images -> (mu, logvar), embedded once per run."""
    if self._image_embeddings is None:
      data = self.data()
      self._image_embeddings = self.images(params, data.images,
                                           desc=f'{data.name} images')
    return self._image_embeddings

  def tokens(self, params: Any, tokens: np.ndarray, desc: str = 'texts'
             ) -> tuple:
    return self.encoders.embed_tokens(params, tokens, self.batch_size,
                                      self.progress(desc))

  def texts(self, params: Any, texts: Sequence[str], desc: str = 'texts'
            ) -> tuple:
    """Captions -> (mu, logvar), each distinct caption embedded once per
    run."""
    todo = list(dict.fromkeys(t for t in texts if t not in self._text_cache))
    if todo:
      mu, lv = self.tokens(params, self.encoders.tokenizer(todo), desc)
      for i, t in enumerate(todo):
        self._text_cache[t] = (mu[i], None if lv is None else lv[i])
    mu = np.stack([self._text_cache[t][0] for t in texts])
    lv = (None if not self.encoders.probabilistic else
          np.stack([self._text_cache[t][1] for t in texts]))
    return mu, lv

  def require_probabilistic(self, what: str):
    """``SkipEvaluator`` when the model has no sigma^2."""
    if not self.encoders.probabilistic:
      raise evaluator.SkipEvaluator(f'{what} needs a probabilistic model')
