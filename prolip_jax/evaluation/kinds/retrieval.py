"""``retrieval``: image->text and text->image recall@k over the captions of
each image, by CSD and cosine."""

from __future__ import annotations

from typing import Any

import numpy as np

from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.metrics import retrieval_recall
from prolip_jax.evaluation.metrics import similarity


class Evaluator(evaluator.Evaluator):
  """Recall@k both ways over every caption of an image (COCO 5k: 25k
  captions), or only the captions at ``caption_indices`` of each image
  (the bundled sets' hierarchy positions); ``{metric}_i2t_R@k``,
  ``{metric}_t2i_R@k``."""

  OPTIONS = {'metrics': ('csd', 'cosine'), 'ks': (1, 5, 10),
             'images_dir': '', 'caption_key': '', 'caption_indices': ()}

  def evaluate(self, params: Any) -> evaluator.Result:
    rs = self.opened(sets.retrieval_set)
    captions, owner = rs.captions, rs.image_of_text
    indices = tuple(self.cfg.caption_indices)
    if indices:
      captions, owner = _at_positions(captions, owner, indices)
    emb = self.embed_images(params, rs.images)
    txt = self.embed_texts(params, captions, 'captions')
    metrics = {}
    for metric in self.metric_names():
      scores = similarity(emb.pair, txt, metric)
      for k, v in retrieval_recall(scores, owner,
                                   tuple(self.cfg.ks)).items():
        metrics[f'{metric}_{k}'] = v
    details = {'images': rs.images.size, 'captions': len(captions),
               'caption_indices': list(indices) or None,
               'images_per_sec': rs.images.size / max(emb.seconds, 1e-9)}
    return evaluator.Result(metrics, details)


def _at_positions(captions: list[str], owner: np.ndarray,
                  indices: tuple[int, ...]) -> tuple[list[str], np.ndarray]:
  """The captions at ``indices`` of each image's list (in image order,
  then in the order of ``indices``) and their images."""
  by_image: dict[int, list[str]] = {}
  for caption, image in zip(captions, owner):
    by_image.setdefault(int(image), []).append(caption)
  texts, images = [], []
  for image in sorted(by_image):
    for j in indices:
      texts.append(by_image[image][j])
      images.append(image)
  return texts, np.asarray(images, np.int32)
