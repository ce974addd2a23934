"""Zero-shot classification and retrieval metrics.

Probabilistic zero-shot follows paper 4.2: each class is the Gaussian
N(mean of the prompts' mu, mean of the prompts' sigma^2) over its prompt
templates, and an image goes to the class at the smallest CSD (eq. 1). Cosine
similarity of the means is reported beside it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax.losses import csd

Array = jax.Array


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


def embed_in_batches(fn: Callable[[np.ndarray], tuple], inputs: np.ndarray,
                     batch_size: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
  """Runs ``fn`` over ``inputs`` in batches; pads the last batch (one shape)."""
  mus, logvars = [], []
  n = len(inputs)
  for i in range(0, n, batch_size):
    chunk = inputs[i:i + batch_size]
    pad = batch_size - len(chunk)
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
    mu, logvar = fn(chunk)
    mus.append(np.asarray(mu)[:batch_size - pad])
    if logvar is not None:
      logvars.append(np.asarray(logvar)[:batch_size - pad])
  return (np.concatenate(mus),
          np.concatenate(logvars) if logvars else None)


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


def zero_shot_digits(model, params, tokenizer, config) -> dict[str, float]:
  """Zero-shot and retrieval on the held-out bundled digits (train-time eval)."""
  from prolip_jax import train  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  images, labels = digits.split('heldout')
  size = model.config.vision.image_size
  images = pipeline.eval_images(np.repeat(images[..., None], 3, -1), size)
  params = jax.device_get(params)

  @jax.jit
  def enc_img(x):
    x = train.normalize_images(x, config.data.mean, config.data.std)
    return model.apply({'params': params}, x, method='encode_image')

  @jax.jit
  def enc_txt(t):
    return model.apply({'params': params}, t, method='encode_text')

  bs = config.eval.batch_size
  img = embed_in_batches(enc_img, images, bs)
  prompts = [t.format(n) for n in digits.CLASS_NAMES
             for t in digits.EVAL_TEMPLATES]
  p_mu, p_lv = embed_in_batches(enc_txt, tokenizer(prompts), bs)
  shape = (len(digits.CLASS_NAMES), len(digits.EVAL_TEMPLATES), -1)
  out = zero_shot_report(
      img, (p_mu.reshape(shape), None if p_lv is None else p_lv.reshape(shape)),
      labels)
  # Retrieval: each held-out image with its most specific caption.
  caps = [c[-1] for c in digits.captions_for(*digits.split('heldout'))]
  t_mu, t_lv = embed_in_batches(enc_txt, tokenizer(caps), bs)
  if img[1] is not None:
    scores = -np.asarray(csd(img[0], img[1], t_mu, t_lv))
    out['sigma2_captions'] = float(np.mean(np.exp(t_lv)))
  else:
    scores = img[0] @ t_mu.T
  out.update(retrieval_recall(scores, np.arange(len(caps))))
  return out


def format_summary(summary: dict[str, Any]) -> str:
  lines = [f"Finished at step {summary['step']}.",
           f"Checkpoint: {summary['checkpoint']}"]
  ev = summary.get('eval') or {}
  for k in sorted(ev):
    lines.append(f'  {k:28s} {ev[k]:.4g}')
  return '\n'.join(lines)
