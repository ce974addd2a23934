"""What every evaluation suite gets: the model, its embedder, the data.

A suite is ``suite(ctx: Context, cfg) -> (scalar metrics, JSON-able details,
figure paths)``; ``suites.SUITES`` names them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import numpy as np

from prolip_jax import plotting
from prolip_jax.evaluation.data import EvalData
from prolip_jax.evaluation.embedder import Embedder
from prolip_jax.evaluation.metrics import scoring_metrics


class SkipSuite(Exception):
  """A suite that does not apply (e.g. needs sigma^2 from a deterministic
  model): ``run`` logs the reason and goes on."""


@dataclasses.dataclass
class Context:
  model: Any
  embedder: Embedder
  data: EvalData
  out_dir: str
  seed: int = 0
  data_cfg: Any = None
  _images: Optional[tuple] = None

  def image_embeddings(self) -> tuple:
    if self._images is None:
      self._images = self.embedder.images(self.data.images,
                                          desc=f'{self.data.name} images')
    return self._images

  def figure(self, fig, name: str, expected_axes: Optional[int] = None
             ) -> str:
    if expected_axes is not None and len(fig.axes) != expected_axes:
      raise AssertionError(f'{name}: {len(fig.axes)} axes, expected '
                           f'{expected_axes}')
    return plotting.save(fig, os.path.join(self.out_dir, name),
                         source=getattr(self.model, 'source', None))


def metrics_for(ctx: Context, cfg) -> list[str]:
  return scoring_metrics(cfg.get('metrics', ('csd', 'cosine')),
                         ctx.embedder.probabilistic)


def captions_at(data: EvalData, indices) -> tuple[list[str], np.ndarray]:
  texts, owner = [], []
  for i, caps in enumerate(data.captions):
    sel = caps if indices is None else [caps[j] for j in indices]
    texts += sel
    owner += [i] * len(sel)
  return texts, np.asarray(owner, np.int32)


