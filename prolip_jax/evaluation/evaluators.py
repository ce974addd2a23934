"""Evaluators declared in the config: ``config.evals``, run during training
and by ``python -m prolip_jax.evaluate``.

``config.evals`` maps a name to an entry (the name prefixes the metrics:
``imagenet/csd_top1`` in ``metrics.jsonl``, TensorBoard and the table)::

  c.evals.imagenet = dict(kind='zero_shot', data='tfds:imagenet2012:validation',
                          templates='imagenet', every_steps=5000)
  c.evals.coco = dict(kind='retrieval', data='tfds:coco_captions:test')

Kinds (``KINDS``; the keys each accepts are in ``OPTIONS``):

- ``zero_shot``: top-k accuracy by CSD and cosine against class Gaussians
  from a prompt ensemble (paper 4.2); names ``{metric}_top{k}``.
- ``retrieval``: image->text and text->image recall@k over every caption of
  an image (COCO 5k: 25k captions); ``{metric}_i2t_R@k``, ``{metric}_t2i_R@k``.
- ``uncertainty``: sigma^2 per dimension of images and captions, the
  fraction of captions more uncertain than their image, Spearman(caption
  length, sigma^2), on a captioned set.
- ``suites``: the bundled digits / emoji report (``configs/eval/<dataset>.py``:
  zero-shot, retrieval, uncertainty figures, BPRW, traversal, filtering).

Common keys: ``data`` (``evaluation/datasets.py``: ``tfds:NAME:SPLIT``,
``folder:PATH``, ``jsonl:PATH``, ``array_record:GLOB``, ``digits``,
``emoji``), ``data_dir`` (TFDS), ``every_steps`` (> 0: every that many
steps and at the end of training; 0: at the end only; -1: only in
``evaluate``), ``batch_size`` (global), ``num_threads``/``num_workers`` (Grain
decoding). Images and texts are embedded on every device and host
(``evaluation/sharded.py``); metrics are computed from the gathered
embeddings, identical whatever the device count.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from prolip_jax import errors
from prolip_jax import uncertainty as U
from prolip_jax.evaluation import datasets
from prolip_jax.evaluation import metrics as M
from prolip_jax.evaluation import suites
from prolip_jax.evaluation.sharded import EvalModel
from prolip_jax.evaluation.zero_shot import class_ensemble

COMMON = {'kind': '', 'data': '', 'data_dir': '', 'every_steps': -1,
          'batch_size': 256, 'num_threads': 16, 'num_workers': 0}
OPTIONS = {
    'zero_shot': {'metrics': ('csd', 'cosine'), 'ks': (1, 5),
                  'templates': (), 'class_names': ()},
    'retrieval': {'metrics': ('csd', 'cosine'), 'ks': (1, 5, 10),
                  'images_dir': '', 'caption_key': ''},
    'uncertainty': {'images_dir': '', 'caption_key': ''},
    'suites': {'dataset': 'digits', 'suites': (), 'config': ''},
}
KINDS = tuple(OPTIONS)


class Evaluator:
  """One entry of ``config.evals``: ``run(model, out_dir)`` -> metrics."""

  def __init__(self, name: str, cfg: ml_collections.ConfigDict):
    self.name = name
    self.cfg = cfg
    self.every_steps = int(cfg.every_steps)
    self.batch_size = int(cfg.batch_size)
    self.unavailable: Optional[str] = None
    self._data = None  # the opened set, kept for the next run
    self.figures: list[str] = []  # written by the last run
    self.files: list[str] = []

  @property
  def kind(self) -> str:
    return self.cfg.kind

  def due(self, step: int, final: bool) -> bool:
    """Whether training runs it at ``step`` (``final``: the last step)."""
    if self.every_steps < 0 or self.unavailable:
      return False
    return final or (self.every_steps > 0 and step % self.every_steps == 0)

  def check_available(self) -> Optional[str]:
    """None when its data can be read; else the reason (kept, one line)."""
    if self.kind != 'suites':
      self.unavailable = datasets.available(self.cfg)
    return self.unavailable

  def run(self, model: EvalModel, out_dir: str,
          log: Callable[[str], None] = print) -> dict[str, float]:
    """Runs it on ``model``; writes ``out_dir/<name>.json``; returns the
    scalar metrics (fractions, not percentages)."""
    t0 = time.time()
    fn = {'zero_shot': self._zero_shot, 'retrieval': self._retrieval,
          'uncertainty': self._uncertainty, 'suites': self._suites}[self.kind]
    metrics, details = fn(model, out_dir, log)
    seconds = time.time() - t0
    if out_dir and self.kind != 'suites':
      os.makedirs(out_dir, exist_ok=True)
      path = os.path.join(out_dir, f'{self.name}.json')
      self.files = [path]
      with open(path, 'w', encoding='utf-8') as f:
        json.dump(suites.jsonable({
            'evaluator': self.name, 'config': self.cfg.to_dict(),
            'metrics': metrics, 'details': details, 'seconds': seconds}),
                  f, indent=1)
    return metrics

  def _opened(self, open_set: Callable):
    # Opened once: a training run evaluates every few thousand steps, and
    # a captioned set reads all of its captions when opened.
    if self._data is None:
      self._data = open_set(self.cfg)
    return self._data

  # -- kinds -----------------------------------------------------------------

  def _metric_names(self, model: EvalModel) -> list[str]:
    return M.scoring_metrics(self.cfg.metrics, model.probabilistic)

  def _embed_images(self, model: EvalModel, images, log):
    emb = model.embed_images(images, self.batch_size,
                             num_threads=int(self.cfg.num_threads),
                             num_workers=int(self.cfg.num_workers))
    log(f'[{self.name}] {images.size:,} images of {images.name} in '
        f'{emb.seconds:.1f}s ({images.size / max(emb.seconds, 1e-9):,.0f} '
        f'images/s on {model.mesh.size} device(s))')
    return emb

  def _zero_shot(self, model: EvalModel, out_dir: str, log):
    del out_dir
    zs = self._opened(datasets.zero_shot_set)
    emb = self._embed_images(model, zs.images, log)
    cls_mu, cls_var = class_ensemble(
        lambda p: model.embed_texts(p, self.batch_size), zs.class_names,
        zs.templates)
    out = {}
    for metric in self._metric_names(model):
      scores = np.asarray(M.zero_shot_scores(emb.mu, emb.logvar, cls_mu,
                                             cls_var, metric))
      for k, v in M.topk_accuracy(scores, emb.labels,
                                  tuple(self.cfg.ks)).items():
        out[f'{metric}_{k}'] = v
    details = {'images': zs.images.size, 'classes': len(zs.class_names),
               'templates': len(zs.templates),
               'images_per_sec': zs.images.size / max(emb.seconds, 1e-9)}
    return out, details

  def _retrieval(self, model: EvalModel, out_dir: str, log):
    del out_dir
    rs = self._opened(datasets.retrieval_set)
    emb = self._embed_images(model, rs.images, log)
    txt = model.embed_texts(rs.captions, self.batch_size)
    out = {}
    for metric in self._metric_names(model):
      scores = M.similarity(emb.pair, txt, metric)
      for k, v in M.retrieval_recall(scores, rs.image_of_text,
                                     tuple(self.cfg.ks)).items():
        out[f'{metric}_{k}'] = v
    details = {'images': rs.images.size, 'captions': len(rs.captions),
               'images_per_sec': rs.images.size / max(emb.seconds, 1e-9)}
    return out, details

  def _uncertainty(self, model: EvalModel, out_dir: str, log):
    del out_dir
    if not model.probabilistic:
      log(f'[{self.name}] skipped: the model has no [UNC] (sigma^2)')
      return {}, {'skipped': 'deterministic model'}
    rs = self._opened(datasets.retrieval_set)
    emb = self._embed_images(model, rs.images, log)
    tokens = model.tokenizer(rs.captions)
    _, t_lv = model.embed_tokens(tokens, self.batch_size)
    s_img, s_txt = U.sigma2(emb.logvar), U.sigma2(t_lv)
    dim = emb.logvar.shape[-1]
    lengths = U.num_tokens(tokens, model.tokenizer.pad_id)
    out = {'sigma2_img': float(s_img.mean() / dim),
           'sigma2_captions': float(s_txt.mean() / dim),
           'txt_more_uncertain_than_img': float(
               (s_txt > s_img[rs.image_of_text]).mean()),
           'spearman_length_sigma2': U.spearman(lengths, s_txt)}
    details = {'sigma2_img_trace': U.summary_stats(s_img),
               'sigma2_captions_trace': U.summary_stats(s_txt)}
    return out, details

  def _suites(self, model: EvalModel, out_dir: str, log):
    cfg = suite_config(self.cfg)
    summary = suites.run_suites(model.loaded_model(), cfg, out_dir, log)
    self.figures, self.files = summary['figures'], summary['files']
    return summary['metrics'], {}


def suite_config(cfg) -> ml_collections.ConfigDict:
  """The bundled report's config for a ``suites`` entry: the dataset's
  ``configs/eval/<dataset>.py`` (or ``config``), with ``suites`` and
  ``batch_size`` applied."""
  path = cfg.get('config', '') or suites.bundled_config_path(cfg.dataset)
  out = suites.load_config_file(path)
  if cfg.get('suites'):
    out.suites = tuple(cfg.suites)
  out.progress = False
  return out


def entry(name: str, raw: Any) -> ml_collections.ConfigDict:
  """One ``config.evals`` entry, checked and completed with the defaults of
  its kind; a wrong kind or key is a ``ConfigError`` naming it."""
  raw = dict(raw.to_dict() if hasattr(raw, 'to_dict') else raw)
  kind = raw.get('kind', '')
  if kind not in OPTIONS:
    raise errors.ConfigError(
        f'evals.{name}.kind={kind!r}: expected one of {", ".join(KINDS)}'
        f'{errors.nearest(str(kind), KINDS)}')
  allowed = {**COMMON, **OPTIONS[kind]}
  for key in raw:
    if key not in allowed:
      raise errors.ConfigError(
          f'evals.{name}.{key}: not a setting of a {kind} evaluator '
          f'(settings: {", ".join(sorted(allowed))})'
          f'{errors.nearest(key, allowed)}')
  if kind != 'suites' and not raw.get('data'):
    raise errors.ConfigError(f'evals.{name}.data is required (e.g. '
                             "'tfds:imagenet2012:validation')")
  if kind == 'suites':
    if raw.get('dataset', 'digits') not in ('digits', 'emoji'):
      raise errors.ConfigError(f'evals.{name}.dataset must be digits or emoji')
  else:
    datasets.parse(raw['data'])
  if int(raw.get('batch_size', 1)) < 1:
    raise errors.ConfigError(f'evals.{name}.batch_size must be >= 1')
  return ml_collections.ConfigDict({**allowed, **raw})


def build(evals: Any, tfds_data_dir: str = '') -> list[Evaluator]:
  """The evaluators of ``config.evals`` (a mapping name -> entry), in
  name order; ``tfds_data_dir`` is the ``data_dir`` of those that set
  none (``config.eval.tfds_data_dir``)."""
  if not evals:
    return []
  if not hasattr(evals, 'items'):
    raise errors.ConfigError('evals must map names to evaluator entries, '
                             f'got {type(evals).__name__}')
  out = []
  for name, raw in sorted(evals.items()):
    cfg = entry(name, raw)
    if not cfg.data_dir:
      cfg.data_dir = tfds_data_dir or ''
    out.append(Evaluator(name, cfg))
  return out


def check_for_training(evals: list[Evaluator]):
  """Raises ``ConfigError`` for an evaluator training cannot run: the
  bundled report (``suites``) runs in ``evaluate`` only."""
  for e in evals:
    if e.kind == 'suites' and e.every_steps >= 0:
      raise errors.ConfigError(
          f'evals.{e.name}: a suites evaluator runs in `python -m '
          'prolip_jax.evaluate` only: set its every_steps to -1')


def check_available(evals: list[Evaluator]) -> dict[str, str]:
  """``{name: reason}`` of the training evaluators whose data cannot be
  read; they are skipped for the run (training goes on). With several
  hosts, process 0's finding holds for all (they run the evaluators
  together)."""
  reasons = {}
  for e in evals:
    if e.every_steps >= 0 and e.check_available():
      reasons[e.name] = e.unavailable
  if jax.process_count() > 1:
    mask = np.asarray([e.name in reasons for e in evals], np.int32)
    mask = multihost_utils.broadcast_one_to_all(mask)
    for e, bad in zip(evals, mask):
      if bad and not e.unavailable:
        e.unavailable = reasons[e.name] = 'unavailable on process 0'
      elif not bad:
        e.unavailable = None
        reasons.pop(e.name, None)
  return reasons
