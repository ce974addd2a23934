"""Scores and metrics over embeddings: pure functions, no model.

Zero-shot follows paper 4.2: each class is the Gaussian N(mean of the prompts'
mu, mean of the prompts' sigma^2) over its prompt templates, and an image goes
to the class at the smallest CSD (eq. 1); cosine similarity of the means is
the deterministic counterpart.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax.losses import csd

Array = jax.Array


def scoring_metrics(requested, probabilistic: bool) -> list[str]:
  """The requested scores (``'csd'``, ``'cosine'``) a model can give: CSD
  needs sigma^2, so a deterministic model is scored by cosine only."""
  names = list(requested)
  if not probabilistic:
    names = [m for m in names if m != 'csd'] or ['cosine']
  return names


def class_gaussians(mu: Array, logvar: Optional[Array]
                    ) -> tuple[Array, Optional[Array]]:
  """Prompt ensemble: ``(C, N, d)`` -> (mean mu ``(C, d)``, mean sigma^2).

  The variance is the plain mean of the N prompt variances (not divided by N
  again), as in the paper and release.
  """
  var = None if logvar is None else jnp.mean(jnp.exp(logvar), axis=1)
  return jnp.mean(mu, axis=1), var


def zero_shot_scores(mu_img: Array, logvar_img: Optional[Array],
                     cls_mu: Array, cls_var: Optional[Array],
                     metric: str = 'csd') -> Array:
  """``(n, C)`` scores, higher is better: ``-CSD`` or cosine similarity."""
  if metric == 'csd':
    if logvar_img is None or cls_var is None:
      raise ValueError('CSD needs variances; use metric="cosine"')
    return -csd(mu_img, logvar_img, cls_mu, jnp.log(cls_var))
  if metric == 'cosine':
    norm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return norm(mu_img.astype(jnp.float32)) @ norm(cls_mu).T
  raise ValueError(f"metric must be 'csd' or 'cosine', got {metric!r}")


def topk_accuracy(scores: np.ndarray, labels: np.ndarray,
                  ks: Sequence[int] = (1, 5)) -> dict[str, float]:
  """Fraction of rows whose label is among the k best-scoring columns."""
  scores = np.asarray(scores)
  order = np.argsort(-scores, axis=1)
  out = {}
  for k in ks:
    hit = (order[:, :min(k, scores.shape[1])] == np.asarray(labels)[:, None])
    out[f'top{k}'] = float(hit.any(1).mean())
  return out


def retrieval_recall(scores: np.ndarray, image_of_text: np.ndarray,
                     ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
  """Image->text and text->image recall@k.

  Args:
    scores: ``(n_images, n_texts)`` similarity, higher is better.
    image_of_text: ``(n_texts,)`` index of each text's image (several texts
      may share an image).

  Returns:
    ``i2t_R@k`` (an image counts as found if any of its texts is in its top k)
    and ``t2i_R@k``.
  """
  scores = np.asarray(scores)
  image_of_text = np.asarray(image_of_text)
  n_img = scores.shape[0]
  out = {}
  i2t_rank = np.argsort(-scores, axis=1)
  t2i_rank = np.argsort(-scores.T, axis=1)
  for k in ks:
    top = image_of_text[i2t_rank[:, :k]]
    out[f'i2t_R@{k}'] = float((top == np.arange(n_img)[:, None]).any(1).mean())
    out[f't2i_R@{k}'] = float(
        (t2i_rank[:, :k] == image_of_text[:, None]).any(1).mean())
  return out


def zero_shot_report(img: tuple, prompts: tuple, labels: np.ndarray
                     ) -> dict[str, float]:
  """Top-1/top-5 by CSD (if probabilistic) and cosine.

  Args:
    img: (mu ``(n, d)``, logvar or None) of the images.
    prompts: (mu ``(C, N, d)``, logvar or None) of the prompt embeddings.
    labels: ``(n,)`` true classes.
  """
  cls_mu, cls_var = class_gaussians(*prompts)
  out = {}
  metrics = ['cosine'] if img[1] is None else ['csd', 'cosine']
  for metric in metrics:
    scores = zero_shot_scores(img[0], img[1], cls_mu, cls_var, metric)
    for k, v in topk_accuracy(scores, labels).items():
      out[f'zeroshot_{metric}_{k}'] = v
  if img[1] is not None:
    out['sigma2_img'] = float(np.mean(np.exp(img[1])))
    out['sigma2_prompts'] = float(np.mean(np.exp(prompts[1])))
  return out


def flat_hit_at_k(scores: np.ndarray, label_sets: Sequence[Sequence[int]],
                  ks: Sequence[int] = (1, 5)) -> dict[str, float]:
  """Multi-label top-k: a row is a hit at k when any of its k best-scoring
  columns is one of its labels (reduces to ``topk_accuracy`` for one label
  per row)."""
  scores = np.asarray(scores)
  order = np.argsort(-scores, axis=1, kind='stable')
  out = {}
  for k in ks:
    top = order[:, :min(k, scores.shape[1])]
    hits = [bool(set(top[i].tolist()) & set(int(x) for x in label_sets[i]))
            for i in range(len(top))]
    out[f'flat_hit@{k}'] = float(np.mean(hits))
  return out


def similarity(a: tuple, b: tuple, metric: str = 'csd') -> np.ndarray:
  """``(n, m)`` similarity of Gaussians ``a`` and ``b`` (``(mu, logvar)``):
  ``-CSD`` or the cosine of the means; higher is better."""
  if metric == 'csd':
    if a[1] is None or b[1] is None:
      raise ValueError('CSD needs variances; use metric="cosine"')
    return -np.asarray(csd(a[0], a[1], b[0], b[1]))
  if metric == 'cosine':
    na = np.asarray(a[0], np.float32)
    nb = np.asarray(b[0], np.float32)
    na = na / np.linalg.norm(na, axis=-1, keepdims=True)
    nb = nb / np.linalg.norm(nb, axis=-1, keepdims=True)
    return na @ nb.T
  raise ValueError(f"metric must be 'csd' or 'cosine', got {metric!r}")


def auc(pos_scores, neg_scores) -> float:
  """P(score of a positive > score of a negative), ties counting 1/2."""
  p = np.asarray(pos_scores)[:, None]
  q = np.asarray(neg_scores)[None, :]
  return float(((p > q) + 0.5 * (p == q)).mean())


