"""The retrieval suite: image->text and text->image recall@k with several
captions per image, by CSD and cosine."""

from __future__ import annotations

from prolip_jax.evaluation.context import captions_at
from prolip_jax.evaluation.context import Context
from prolip_jax.evaluation.context import metrics_for
from prolip_jax.evaluation.metrics import retrieval_recall
from prolip_jax.evaluation.metrics import similarity


def suite_retrieval(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """i2t / t2i recall@k with several captions per image."""
  data = ctx.data
  if data.captions is None:
    raise ValueError(f'{data.name} has no captions for retrieval')
  idx = cfg.get('caption_indices')
  idx = None if idx is None else tuple(idx)
  texts, owner = captions_at(data, idx)
  img = ctx.image_embeddings()
  txt = ctx.embedder.texts(texts, desc='retrieval captions')
  ks = tuple(cfg.get('ks', (1, 5, 10)))
  metrics = {}
  for metric in metrics_for(ctx, cfg):
    for k, v in retrieval_recall(similarity(img, txt, metric), owner,
                                 ks).items():
      metrics[f'{metric}_{k}'] = v
  details = {'num_images': len(data.images), 'num_captions': len(texts),
             'caption_indices': None if idx is None else list(idx)}
  return metrics, details, []

