"""Evaluation: zero-shot, retrieval, the uncertainty report and applications.

Probabilistic zero-shot follows paper 4.2: each class is the Gaussian
N(mean of the prompts' mu, mean of the prompts' sigma^2) over its prompt
templates, and an image goes to the class at the smallest CSD (eq. 1). Cosine
similarity of the means is reported beside it.

Command line (absl flags; the config is an ``ml_collections`` file, any value
can be overridden with ``--config.x.y=...``)::

  python -m prolip_jax.evaluate --workdir DIR --config configs/eval/digits.py

``DIR`` is a training workdir or an export directory (anything
``prolip_jax.load`` reads). The configured suites run in order and write
``DIR/eval/<suite>.json``, PNG figures beside them, and ``summary.json``
with every scalar; a summary table is printed at the end. Suites:

* ``zero_shot``: top-1/top-5 by CSD and cosine over the prompt ensemble
  (and flat hit@k when the data has label sets);
* ``retrieval``: image->text and text->image R@1/5/10, several captions per
  image, by CSD and cosine;
* ``uncertainty``: sigma^2 histograms of images vs texts (Fig. 5), sigma_t^2
  vs caption length with Spearman's rho (Fig. 6), sigma_t^2 by hierarchy
  level with the C.6 adjacent-order metric (Fig. 7, C.4), inclusion tests of
  occluded / token-dropped images and masked captions (Fig. 8), and the most
  and least uncertain images and captions (Fig. 4);
* ``bprw``, ``traversal``, ``filtering``: the applications of
  ``prolip_jax.applications``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
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
                     batch_size: int,
                     progress: Optional[Callable[[int, int], None]] = None
                     ) -> tuple[np.ndarray, Optional[np.ndarray]]:
  """Runs ``fn`` over ``inputs`` in batches; pads the last batch (one shape).

  ``inputs`` may be an array or a tuple of arrays (``fn`` then gets the tuple
  of batch slices); ``progress(done, total)`` is called after each batch.
  """
  mus, logvars = [], []
  multi = isinstance(inputs, tuple)
  n = len(inputs[0]) if multi else len(inputs)

  def take(x, i, pad):
    chunk = x[i:i + batch_size]
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
    return chunk

  for i in range(0, n, batch_size):
    pad = batch_size - min(batch_size, n - i)
    chunk = (tuple(take(x, i, pad) for x in inputs) if multi
             else take(inputs, i, pad))
    mu, logvar = fn(chunk)
    mus.append(np.asarray(mu)[:batch_size - pad])
    if logvar is not None:
      logvars.append(np.asarray(logvar)[:batch_size - pad])
    if progress is not None:
      progress(min(i + batch_size, n), n)
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


def _digits_eval_images(split: str, image_size: int
                        ) -> tuple[np.ndarray, np.ndarray]:
  """Eval views ``(n, s, s, 3)`` uint8 of a digits split, and its labels."""
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  images, labels = digits.split(split)
  return pipeline.eval_images(np.repeat(images[..., None], 3, -1),
                              image_size), labels


def _digits_encoders(model, params, config) -> tuple[Callable, Callable]:
  """Jitted ``(enc_img(uint8 images), enc_txt(tokens))`` of the towers."""
  from prolip_jax import train  # pylint: disable=g-import-not-at-top

  @jax.jit
  def enc_img(x):
    x = train.normalize_images(x, config.data.mean, config.data.std)
    return model.apply({'params': params}, x, method='encode_image')

  @jax.jit
  def enc_txt(t):
    return model.apply({'params': params}, t, method='encode_text')

  return enc_img, enc_txt


def zero_shot_digits(model, params, tokenizer, config) -> dict[str, float]:
  """Zero-shot and retrieval on the held-out bundled digits (train-time eval)."""
  from prolip_jax import train  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  images, labels = _digits_eval_images('heldout',
                                      model.config.vision.image_size)
  params = jax.device_get(params)
  enc_img, enc_txt = _digits_encoders(model, params, config)
  if config.objective == 'uniclip':
    # Only UniCLIP's head outputs share a space: evaluate through the heads,
    # images as un-augmented views (identity augmentation vector).
    from prolip_jax import uniclip_train  # pylint: disable=g-import-not-at-top
    enc_img, enc_txt = uniclip_train.eval_encoders(model, params, config,
                                                   train.normalize_images)

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


def difference_classification_digits(model, params, tokenizer, config,
                                     num_pairs: int = 500, seed: int = 0,
                                     split: str = 'heldout'
                                     ) -> dict[str, float]:
  """PC-CLIP's difference-based classification (eq. 2) on the digits.

  For each ordered attribute of ``losses.pcclip.DIGIT_SCHEMA`` that varies
  over ``split`` (digit value, thickness, width; the bundled digits are all
  centred, so position never differs): ``num_pairs`` random ordered pairs of
  ``split`` images that differ in it, the prompt T = the attribute's "first
  has more" phrase (e.g. "the first digit is larger than the second"), and
  the prediction 1{(g(I_i) - g(I_j)) . f(T) >= 0}. Chance is 50%.

  Returns:
    ``{'diff_acc/<attribute>': accuracy, 'diff_acc': their mean}``.
  """
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import pairs  # pylint: disable=g-import-not-at-top
  from prolip_jax.losses import pcclip  # pylint: disable=g-import-not-at-top
  images, _ = _digits_eval_images(split, model.config.vision.image_size)
  enc_img, enc_txt = _digits_encoders(model, jax.device_get(params), config)
  attrs = digits.attributes(split)
  g, _ = embed_in_batches(enc_img, images, config.eval.batch_size)
  out = {}
  for attr in pcclip.DIGIT_SCHEMA:
    if attr.more is None:
      continue
    f_t = np.asarray(enc_txt(tokenizer([attr.more]))[0])[0]
    i, j, truth = pairs.difference_eval_pairs(attrs, attr, num_pairs, seed)
    if not len(i):  # no two images differ in it: nothing to rank
      continue
    pred = np.asarray(pcclip.difference_classify(g[i], g[j], f_t))
    out[f'diff_acc/{attr.name}'] = float(np.mean(pred == truth))
  out['diff_acc'] = float(np.mean(list(out.values())))
  return out


def format_summary(summary: dict[str, Any]) -> str:
  lines = [f"Finished at step {summary['step']}.",
           f"Checkpoint: {summary['checkpoint']}"]
  ev = summary.get('eval') or {}
  for k in sorted(ev):
    lines.append(f'  {k:28s} {ev[k]:.4g}')
  return '\n'.join(lines)


# ---------------------------------------------------------------------------
# More metrics.


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


# ---------------------------------------------------------------------------
# Progress, embedding and data.


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
  ``LoadedModel`` in fixed-size batches, with progress and a text cache."""

  def __init__(self, model, batch_size: int = 256, progress: bool = True):
    from prolip_jax.models import ProLIP  # pylint: disable=g-import-not-at-top
    self.model = model
    self.batch_size = batch_size
    self.progress = progress
    self._text_cache: dict[str, tuple] = {}
    net = ProLIP(model.config)
    params = model.params
    mean = jnp.asarray(model.mean, jnp.float32)
    std = jnp.asarray(model.std, jnp.float32)

    def norm(images):
      return (images.astype(jnp.float32) / 255.0 - mean) / std

    self._img = jax.jit(lambda x: net.apply({'params': params}, norm(x),
                                            method='encode_image'))
    self._img_keep = jax.jit(lambda xk: net.apply(
        {'params': params}, norm(xk[0]), xk[1], method='encode_image'))
    self._txt = jax.jit(lambda t: net.apply({'params': params}, t,
                                            method='encode_text'))

  @property
  def probabilistic(self) -> bool:
    return bool(self.model.config.use_unc)

  def _progress(self, desc):
    return Progress(desc, self.progress)

  def images(self, images, keep_ratio: Optional[float] = None, seed: int = 0,
             desc: str = 'images') -> tuple:
    """uint8 images (any size) -> (mu, logvar); ``keep_ratio`` < 1 keeps
    that fraction of patch tokens (random, fixed by ``seed``)."""
    from prolip_jax.data import pipeline  # pylint: disable=g-import-not-at-top
    from prolip_jax import uncertainty  # pylint: disable=g-import-not-at-top
    batch = pipeline.eval_images(list(images),
                                 self.model.config.vision.image_size)
    if keep_ratio is None or keep_ratio >= 1:
      return embed_in_batches(self._img, batch, self.batch_size,
                              self._progress(desc))
    keep = uncertainty.keep_indices_for(
        len(batch), self.model.config.num_patches, keep_ratio, seed)
    return embed_in_batches(self._img_keep, (batch, keep), self.batch_size,
                            self._progress(desc))

  def tokens(self, tokens: np.ndarray, desc: str = 'texts') -> tuple:
    return embed_in_batches(self._txt, np.asarray(tokens, np.int32),
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


@dataclasses.dataclass
class EvalData:
  """An evaluation set held in memory.

  ``images``: ``(n, h, w, 3)`` uint8; ``labels``/``class_names``/``templates``
  for zero-shot (optional); ``captions[i]``: image i's captions, ordered from
  the most general to the most specific when they form a hierarchy;
  ``level_names`` names those positions; ``label_sets`` for multi-label
  zero-shot; ``keys`` name the images.
  """
  name: str
  images: np.ndarray
  keys: list[str]
  labels: Optional[np.ndarray] = None
  class_names: Optional[Sequence[str]] = None
  templates: Optional[Sequence[str]] = None
  captions: Optional[list[list[str]]] = None
  level_names: Optional[Sequence[str]] = None
  label_sets: Optional[list[list[int]]] = None


DIGITS_LEVEL_NAMES = (
    'name', 'numeral', "'a' + name", 'handwritten digit', '1 attribute',
    '2 attributes', '3 attributes', '3 attributes, long')


def digits_data(split: str = 'heldout', per_class: int = 0) -> EvalData:
  """The bundled MNIST digits with all eight captions per image
  (``digits.captions_for``; ``per_class`` > 0 keeps the first k of each
  class)."""
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  images, labels = digits.split(split)
  if per_class:
    idx = np.concatenate([np.flatnonzero(labels == c)[:per_class]
                          for c in range(len(digits.CLASS_NAMES))])
    images, labels = images[idx], labels[idx]
  else:
    idx = np.arange(len(labels))
  caps = digits.captions_for(images, labels)
  return EvalData(
      name=f'digits-{split}', images=np.repeat(images[..., None], 3, -1),
      keys=[f'{split}-{i:05d}' for i in idx], labels=labels,
      class_names=digits.CLASS_NAMES, templates=digits.EVAL_TEMPLATES,
      captions=caps, level_names=DIGITS_LEVEL_NAMES)


def load_data(cfg) -> EvalData:
  if cfg.dataset == 'digits':
    return digits_data(cfg.get('split', 'heldout'), cfg.get('per_class', 0))
  raise ValueError(f'unknown eval dataset {cfg.dataset!r} (known: digits)')


# ---------------------------------------------------------------------------
# Suites. Each takes the shared context and its config section and returns
# (scalar metrics, JSON-able details, figure paths).


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
    from prolip_jax import uncertainty  # pylint: disable=g-import-not-at-top
    if expected_axes is not None and len(fig.axes) != expected_axes:
      raise AssertionError(f'{name}: {len(fig.axes)} axes, expected '
                           f'{expected_axes}')
    return uncertainty.save_figure(fig, os.path.join(self.out_dir, name))


def _metrics_for(ctx: Context, cfg) -> list[str]:
  metrics = list(cfg.get('metrics', ('csd', 'cosine')))
  if not ctx.embedder.probabilistic:
    metrics = [m for m in metrics if m != 'csd'] or ['cosine']
  return metrics


def _class_prompts(ctx: Context, templates) -> tuple:
  data = ctx.data
  prompts = [t.format(c) for c in data.class_names for t in templates]
  mu, lv = ctx.embedder.texts(prompts, desc='prompts')
  shape = (len(data.class_names), len(templates), -1)
  return mu.reshape(shape), None if lv is None else lv.reshape(shape)


def suite_zero_shot(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """Top-k by CSD / cosine against the prompt-ensemble class Gaussians."""
  data = ctx.data
  if data.class_names is None or data.labels is None:
    raise ValueError(f'{data.name} has no class labels for zero-shot')
  templates = tuple(cfg.get('templates') or data.templates)
  img = ctx.image_embeddings()
  p_mu, p_lv = _class_prompts(ctx, templates)
  cls_mu, cls_var = class_gaussians(p_mu, p_lv)
  ks = tuple(cfg.get('ks', (1, 5)))
  metrics, details = {}, {'templates': list(templates), 'per_class_top1': {}}
  for metric in _metrics_for(ctx, cfg):
    scores = np.asarray(zero_shot_scores(img[0], img[1], cls_mu, cls_var,
                                         metric))
    for k, v in topk_accuracy(scores, data.labels, ks).items():
      metrics[f'{metric}_{k}'] = v
    if data.label_sets is not None:
      for k, v in flat_hit_at_k(scores, data.label_sets, ks).items():
        metrics[f'{metric}_{k}'] = v
    pred = scores.argmax(1)
    details['per_class_top1'][metric] = {
        name: float((pred[data.labels == c] == c).mean())
        for c, name in enumerate(data.class_names)
        if (data.labels == c).any()}
  return metrics, details, []


def _captions_at(data: EvalData, indices) -> tuple[list[str], np.ndarray]:
  texts, owner = [], []
  for i, caps in enumerate(data.captions):
    sel = caps if indices is None else [caps[j] for j in indices]
    texts += sel
    owner += [i] * len(sel)
  return texts, np.asarray(owner, np.int32)


def suite_retrieval(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """i2t / t2i recall@k with several captions per image."""
  data = ctx.data
  if data.captions is None:
    raise ValueError(f'{data.name} has no captions for retrieval')
  idx = cfg.get('caption_indices')
  idx = None if idx is None else tuple(idx)
  texts, owner = _captions_at(data, idx)
  img = ctx.image_embeddings()
  txt = ctx.embedder.texts(texts, desc='retrieval captions')
  ks = tuple(cfg.get('ks', (1, 5, 10)))
  metrics = {}
  for metric in _metrics_for(ctx, cfg):
    for k, v in retrieval_recall(similarity(img, txt, metric), owner,
                                 ks).items():
      metrics[f'{metric}_{k}'] = v
  details = {'num_images': len(data.images), 'num_captions': len(texts),
             'caption_indices': None if idx is None else list(idx)}
  return metrics, details, []


def _parse_view(spec: str) -> tuple[str, float, str]:
  """'drop:0.25' (keep 25% of patch tokens) or 'occlude:0.25' (zero the
  central 25% of the area) -> (kind, value, display name)."""
  kind, _, val = spec.partition(':')
  v = float(val)
  if kind == 'drop':
    return kind, v, f'{1 - v:.0%} patches dropped'
  if kind == 'occlude':
    return kind, v, f'{v:.0%} centre occluded'
  raise ValueError(f"image view must be 'drop:KEEP' or 'occlude:FRACTION', "
                   f'got {spec!r}')


def suite_uncertainty(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """The uncertainty report of paper 4.3 (Figs. 4-8, C.6)."""
  from prolip_jax import uncertainty as U  # pylint: disable=g-import-not-at-top
  if not ctx.embedder.probabilistic:
    raise SkipSuite('the uncertainty report needs a probabilistic model')
  data, emb, tok = ctx.data, ctx.embedder, ctx.model.tokenizer
  metrics, details, figs = {}, {}, []
  img = ctx.image_embeddings()
  s_img = U.sigma2(img[1])

  # Every distinct caption, first-appearance order.
  texts = list(dict.fromkeys(c for caps in data.captions for c in caps))
  txt = emb.texts(texts, desc='captions')
  s_txt = U.sigma2(txt[1])
  s_of = dict(zip(texts, s_txt))
  metrics['sigma2_img_mean'] = float(s_img.mean())
  metrics['sigma2_txt_mean'] = float(s_txt.mean())
  pair_t = np.array([s_of[c] for caps in data.captions for c in caps])
  pair_v = np.repeat(s_img, [len(c) for c in data.captions])
  metrics['txt_more_uncertain_than_img'] = float((pair_t > pair_v).mean())
  details['sigma2_img'] = U.summary_stats(s_img)
  details['sigma2_txt'] = U.summary_stats(s_txt)
  figs.append(ctx.figure(U.fig_sigma2_hist(s_img, s_txt), 'sigma2_hist.png',
                         1))

  # sigma_t^2 vs caption length (tokens, EOS included).
  lengths = U.num_tokens(tok(texts), tok.pad_id)
  rho = U.spearman(lengths, s_txt)
  metrics['spearman_length_sigma2'] = rho
  figs.append(ctx.figure(U.fig_sigma2_vs_length(lengths, s_txt, rho),
                         'sigma2_vs_length.png', 1))

  # Hierarchy levels (C.6).
  levels = cfg.get('levels')
  if levels:
    levels = tuple(levels)
    sl = np.array([[s_of[caps[j]] for j in levels] for caps in data.captions])
    order = U.hierarchy_order(sl)
    metrics['level_adjacent_decreasing'] = order['adjacent_decreasing']
    names = [(data.level_names[j] if data.level_names else str(j))
             for j in levels]
    details['levels'] = {'indices': list(levels), 'names': names, **order}
    figs.append(ctx.figure(U.fig_sigma2_by_level(sl, names,
                                                 np.array(order['pairwise'])),
                           'sigma2_by_level.png', 3))

  # Inclusion of originals in partial views (Fig. 8).
  eps = float(cfg.get('inclusion_eps', 0.0))
  tests, inc_details = {}, {}
  n_img = int(cfg.get('num_inclusion_images', 0)) or len(data.images)
  sub = np.arange(min(n_img, len(data.images)))
  orig = (img[0][sub], img[1][sub])
  for spec in cfg.get('image_views', ()):
    kind, v, name = _parse_view(spec)
    if kind == 'drop':
      view = emb.images(data.images[sub], keep_ratio=v, seed=ctx.seed,
                        desc=f'images, {name}')
    else:
      view = emb.images(U.occlude_center(data.images[sub], v),
                        desc=f'images, {name}')
    tests[f'image, {name}'] = U.inclusion_test(orig, view, eps)
  prob = float(cfg.get('text_mask_prob', 0.0))
  if prob > 0:
    tokens = tok(texts)
    masked = U.mask_tokens(tokens, prob, tok.mask_id, tok.pad_id,
                           seed=ctx.seed, eos_id=getattr(tok, 'eos_id', None))
    view = emb.tokens(masked, desc='masked captions')
    tests[f'text, {prob:.0%} tokens masked'] = U.inclusion_test(txt, view,
                                                                 eps)
  for name, t in tests.items():
    key = name.replace(', ', '_').replace(' ', '_').replace('%', 'pct')
    metrics[f'inclusion_positive/{key}'] = t['positive_fraction']
    inc_details[name] = {k: v for k, v in t.items() if k != 'h'}
    inc_details[name]['h'] = U.summary_stats(t['h'])
  details['inclusion'] = inc_details
  if tests:
    figs.append(ctx.figure(U.fig_inclusion_hist(tests, eps),
                           'inclusion_hist.png', len(tests)))

  # Most / least uncertain samples (Fig. 4).
  k = int(cfg.get('num_examples', 8))
  most, least = U.extremes(s_txt, k)
  details['most_uncertain_captions'] = [[texts[i], float(s_txt[i])]
                                        for i in most]
  details['least_uncertain_captions'] = [[texts[i], float(s_txt[i])]
                                         for i in least]
  most_i, least_i = U.extremes(s_img, k)
  details['most_uncertain_images'] = [[data.keys[i], float(s_img[i])]
                                      for i in most_i]
  details['least_uncertain_images'] = [[data.keys[i], float(s_img[i])]
                                       for i in least_i]
  figs.append(ctx.figure(U.fig_extreme_images(data.images, s_img, most_i,
                                              least_i),
                         'uncertain_images.png',
                         2 * max(len(most_i), len(least_i))))
  if data.labels is not None:
    # C.8 "understanding image dataset": sigma_v^2 vs being misclassified.
    details['sigma2_img_by_class'] = {
        n: float(s_img[data.labels == c].mean())
        for c, n in enumerate(data.class_names) if (data.labels == c).any()}
  return metrics, details, figs


def suite_bprw(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """BPRW before/after accuracy, zero-shot and few-shot (A.8, C.7)."""
  from prolip_jax.applications import bprw  # pylint: disable=g-import-not-at-top
  data = ctx.data
  templates = tuple(cfg.get('templates') or data.templates)
  p_mu, p_lv = _class_prompts(ctx, templates)
  if p_lv is None:
    raise SkipSuite('BPRW needs a probabilistic model')
  img = ctx.image_embeddings()
  ks = (1, 5)

  def acc(mu, var):
    s = np.asarray(zero_shot_scores(img[0], img[1], mu, var, 'csd'))
    return topk_accuracy(s, data.labels, ks)

  metrics, details, pis = {}, {'templates': list(templates)}, {}
  u_mu, u_var = class_gaussians(p_mu, p_lv)
  for k, v in acc(u_mu, u_var).items():
    metrics[f'uniform_{k}'] = v
  pi0 = np.asarray(bprw.initial_weights(p_lv))
  for k, v in acc(*bprw.reweighted_classifier(p_mu, p_lv, pi0)).items():
    metrics[f'inv_trace_{k}'] = v
  em_kw = {'max_iters': int(cfg.get('max_iters', 1000)),
           'tol': float(cfg.get('tol', 1e-7))}

  zs = cfg.zero_shot
  res, index = bprw.zero_shot_bprw(
      p_mu, p_lv, img[0], img[1], alpha=zs.alpha, eps=cfg.eps, m=zs.m,
      k=zs.k, seed=ctx.seed, **em_kw)
  for k, v in acc(res.mu, res.var).items():
    metrics[f'zeroshot_{k}'] = v
  metrics['zeroshot_neighbour_precision'] = float(np.mean(
      data.labels[index] == np.arange(len(index))[:, None]))
  details['zero_shot'] = {'pi': res.pi.tolist(), **bprw.summarize(res)}
  pis['zero-shot BPRW'] = res.pi

  fs = cfg.get('few_shot')
  if fs is not None and fs.shots > 0:
    if fs.split in ('', 'same'):  # labelled images from the eval set itself
      support = data
    else:
      support_cfg = ctx.data_cfg.copy_and_resolve_references()
      with support_cfg.unlocked():
        support_cfg.split = fs.split
        support_cfg.per_class = 0
      support = load_data(support_cfg)
    idx = bprw.few_shot_indices(support.labels, len(data.class_names),
                                fs.shots, ctx.seed).ravel()
    s_img = ctx.embedder.images(support.images[idx], desc='few-shot support')
    res_f, _ = bprw.few_shot_bprw(
        p_mu, p_lv, s_img[0], s_img[1], support.labels[idx], fs.shots,
        alpha=fs.alpha, eps=cfg.eps, total_samples=fs.total_samples,
        seed=ctx.seed, **em_kw)
    for k, v in acc(res_f.mu, res_f.var).items():
      metrics[f'fewshot{fs.shots}_{k}'] = v
    details['few_shot'] = {'pi': res_f.pi.tolist(), 'split': fs.split,
                           **bprw.summarize(res_f)}
    pis[f'{fs.shots}-shot BPRW'] = res_f.pi
  fig = bprw.fig_weights(pis, data.class_names, templates)
  figs = [ctx.figure(fig, 'bprw_weights.png', 2 * len(pis))]
  return metrics, details, figs


def suite_traversal(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """Inclusion-based traversal vs the "" [ROOT] baseline (4.4, B.4)."""
  from prolip_jax import uncertainty as U  # pylint: disable=g-import-not-at-top
  from prolip_jax.applications import traversal as T  # pylint: disable=g-import-not-at-top
  data = ctx.data
  if not ctx.embedder.probabilistic:
    raise SkipSuite('the inclusion traversal needs a probabilistic model')
  levels = tuple(cfg.levels)
  n = int(cfg.get('num_images', 0)) or len(data.images)
  sel = np.arange(min(n, len(data.images)))
  db_levels = tuple(cfg.get('database_levels') or levels)
  texts, level_of = [], {}
  for caps in data.captions:
    for j in db_levels:
      if caps[j] not in level_of:
        level_of[caps[j]] = levels.index(j) if j in levels else -1
        texts.append(caps[j])
  pos = {t: i for i, t in enumerate(texts)}
  db = ctx.embedder.texts(texts, desc='traversal captions')
  empty = ctx.embedder.texts([''], desc='empty caption')
  img = ctx.image_embeddings()
  img = (img[0][sel], img[1][sel])
  gt = [[pos[data.captions[i][j]] for j in levels] for i in sel]
  gt_root = [g[0] for g in gt]
  steps = int(cfg.get('steps', T.STEPS))
  eps = float(cfg.get('inclusion_eps', 0.0))
  score = cfg.get('score', 'measure')
  runs = {
      'inclusion': T.traverse(img, db, empty, steps, 'inclusion', 'csd', eps,
                              score),
      'null': T.traverse(img, db, empty, steps, 'null', 'csd'),
  }
  metrics, details = {}, {}
  for name, tr in runs.items():
    m = T.traversal_metrics(tr, gt, gt_root)
    for k, v in m.items():
      metrics[f'{name}_{k}'] = v
  tr = runs['inclusion']
  roots, counts = np.unique(tr.root, return_counts=True)
  top = np.argsort(-counts)[:10]
  details['root_captions'] = [[texts[roots[i]], int(counts[i])] for i in top]
  details['root_is_level0'] = float(np.mean(tr.root == np.asarray(gt_root)))
  metrics['inclusion_root_is_gt_level0'] = details['root_is_level0']
  details['examples'] = [
      {'key': data.keys[sel[i]],
       'ground_truth': [texts[g] for g in gt[i]],
       'root': texts[tr.root[i]],
       'path': [texts[j] for j in tr.paths[i]],
       'null_path': [texts[j] for j in runs['null'].paths[i]]}
      for i in range(min(int(cfg.get('num_examples', 5)), len(sel)))]
  details['database_size'] = len(texts)
  db_s2 = U.sigma2(db[1])
  db_level = np.array([level_of[t] for t in texts])
  fig = T.fig_traversal(runs['inclusion'], db_s2, db_level,
                        'inclusion [ROOT]', {'"" [ROOT]': runs['null']})
  figs = [ctx.figure(fig, 'traversal.png', 2)]
  return metrics, details, figs


def _auc(pos_scores, neg_scores) -> float:
  """P(score of a positive > score of a negative), ties counting 1/2."""
  p = np.asarray(pos_scores)[:, None]
  q = np.asarray(neg_scores)[None, :]
  return float(((p > q) + 0.5 * (p == q)).mean())


def suite_filtering(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """CSD pair filtering on the data with a fraction of captions shuffled
  between images: how many of the shuffled pairs the filter removes."""
  from prolip_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from prolip_jax.applications import filtering as F  # pylint: disable=g-import-not-at-top
  data = ctx.data
  if not ctx.embedder.probabilistic:
    raise SkipSuite('CSD filtering needs a probabilistic model')
  j = int(cfg.get('caption_index', -1))
  caps = [c[j] for c in data.captions]
  rng = np.random.default_rng(ctx.seed)
  n = len(caps)
  bad = np.sort(rng.choice(n, int(round(cfg.corrupt_fraction * n)),
                           replace=False))
  shuffled = list(caps)
  for a, b in zip(bad, rng.permutation(bad)):
    shuffled[a] = caps[b]
  corrupted = np.array([shuffled[i] != caps[i] for i in range(n)])
  records = [{'image': data.images[i], 'caption': shuffled[i],
              'key': data.keys[i]} for i in range(n)]
  mesh = None
  bs = int(cfg.get('batch_size', 256))
  if cfg.get('use_mesh', True):
    mesh = sharding_lib.make_mesh({'data': -1, 'fsdp': 1})
    shards = sharding_lib.num_batch_shards(mesh)
    bs = -(-bs // shards) * shards
  keys, scores = F.score_records(
      ctx.model, records, bs, mesh, w_img=cfg.get('w_img', 0.0),
      w_txt=cfg.get('w_txt', 0.0),
      progress=Progress('filtering', ctx.embedder.progress))
  kept = F.select(keys, scores, cfg.keep_fraction)
  path = F.write_keys(os.path.join(ctx.out_dir, 'filtering_kept_keys.txt'),
                      kept)
  kept_set = set(kept)
  removed = np.array([k not in kept_set for k in keys])
  metrics = {
      'kept': len(kept), 'total': n,
      'removed_precision': float(corrupted[removed].mean()) if removed.any()
                           else float('nan'),
      'corrupted_recall': float(removed[corrupted].mean()) if corrupted.any()
                          else float('nan'),
      'auc': (_auc(scores[~corrupted], scores[corrupted])
              if corrupted.any() and (~corrupted).any() else float('nan')),
  }
  threshold = float(np.min(scores[~removed])) if (~removed).any() else 0.0
  details = {'kept_keys_file': path, 'corrupted_keys': [
      keys[i] for i in np.flatnonzero(corrupted)], 'threshold': threshold,
             'caption_index': j}
  fig = F.fig_scores(scores, threshold, corrupted)
  figs = [ctx.figure(fig, 'filtering_scores.png', 1)]
  return metrics, details, figs


SUITES = {
    'zero_shot': suite_zero_shot,
    'retrieval': suite_retrieval,
    'uncertainty': suite_uncertainty,
    'bprw': suite_bprw,
    'traversal': suite_traversal,
    'filtering': suite_filtering,
}


# ---------------------------------------------------------------------------
# Driver.


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return _jsonable(x.tolist())
  if isinstance(x, (np.floating, float)):
    x = float(x)
    return x if np.isfinite(x) else None
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.bool_,)):
    return bool(x)
  return x


def format_table(metrics: dict[str, float]) -> str:
  """``suite  metric  value`` rows for the printed summary."""
  rows = []
  for name in metrics:
    suite, _, key = name.partition('/')
    rows.append((suite, key, metrics[name]))
  w1 = max([len(r[0]) for r in rows] + [5])
  w2 = max([len(r[1]) for r in rows] + [6])
  lines = [f'{"suite":{w1}s}  {"metric":{w2}s}  value',
           '-' * (w1 + w2 + 12)]
  for suite, key, v in rows:
    val = f'{v:.4g}' if isinstance(v, float) else str(v)
    lines.append(f'{suite:{w1}s}  {key:{w2}s}  {val}')
  return '\n'.join(lines)


def run(model, config, out_dir: Optional[str] = None,
        step: Optional[int] = None, log: Callable[[str], None] = print
        ) -> dict:
  """Runs ``config.suites`` and writes ``out_dir/<suite>.json``, the figures
  and ``summary.json``.

  Args:
    model: a ``LoadedModel`` or a path for ``prolip_jax.load``.
    config: an eval config (``configs/eval/digits.py``).
    out_dir: default ``<model path>/eval`` (required for a model object).
    step: checkpoint step when loading a workdir.
    log: where progress lines and the table go.

  Returns:
    ``{'metrics': {suite/metric: value}, 'figures': [...], 'files': [...]}``.
  """
  from prolip_jax import inference  # pylint: disable=g-import-not-at-top
  if isinstance(model, (str, os.PathLike)):
    path = os.fspath(model)
    out_dir = out_dir or os.path.join(path, 'eval')
    model = inference.load(path, step=step)
  if out_dir is None:
    raise ValueError('out_dir is required when model is not a path')
  os.makedirs(out_dir, exist_ok=True)
  data = load_data(config.data)
  embedder = Embedder(model, int(config.batch_size),
                      bool(config.get('progress', True)))
  ctx = Context(model, embedder, data, out_dir, int(config.get('seed', 0)),
                config.data)
  all_metrics, figures, files = {}, [], []
  for suite in config.suites:
    if suite not in SUITES:
      raise ValueError(f'unknown suite {suite!r}; known: {sorted(SUITES)}')
    t0 = time.time()
    log(f'[{suite}] running on {data.name} ({len(data.images)} images)')
    try:
      metrics, details, figs = SUITES[suite](ctx, config[suite])
    except SkipSuite as e:
      log(f'[{suite}] skipped: {e}')
      continue
    seconds = time.time() - t0
    path = os.path.join(out_dir, f'{suite}.json')
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(_jsonable({'suite': suite, 'data': data.name,
                           'metrics': metrics, 'details': details,
                           'figures': figs, 'seconds': seconds,
                           'config': config[suite].to_dict()}), f, indent=1)
    files.append(path)
    figures += figs
    all_metrics.update({f'{suite}/{k}': v for k, v in metrics.items()})
    log(f'[{suite}] done in {seconds:.1f}s')
  summary = {'metrics': all_metrics, 'figures': figures, 'files': files,
             'data': data.name}
  path = os.path.join(out_dir, 'summary.json')
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(_jsonable(summary), f, indent=1)
  summary['files'].append(path)
  log(format_table(all_metrics))
  if figures:
    log('figures:\n' + '\n'.join(f'  {p}' for p in figures))
  return summary


def _main():
  # Flags are defined only when run as a program: train.py and inference.py
  # import this module, and main.py defines --config / --workdir too.
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  default = os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
      'eval', 'digits.py')
  config_flags.DEFINE_config_file('config', default,
                                  'Evaluation configuration file.')
  flags.DEFINE_string('workdir', None, 'Training workdir or export directory '
                      '(anything prolip_jax.load reads).', required=True)
  flags.DEFINE_string('out', None, 'Output directory (default WORKDIR/eval).')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest).')

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments {argv[1:]}')
    logging.set_verbosity(logging.ERROR)
    run(flags.FLAGS.workdir, flags.FLAGS.config, flags.FLAGS.out,
        flags.FLAGS.step, log=lambda s: print(s, flush=True))

  app.run(main)


if __name__ == '__main__':
  _main()
