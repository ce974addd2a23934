"""The evaluations the training loop runs (``LoopEvaluations``): the short
one on its data set's held-out part, and the configured evaluators
(``config.evals``, ``evaluation/evaluators.py``); the run's final summary.

``data.name='digits'``: the 1,000 held-out digits; ``'emoji'``: the held-out
emoji, whose names were never trained on (``heldout_data``); other sources
have none (``python -m prolip_jax.evaluate`` on a checkpoint).

Encoders come from the objective (``Objective.encoders``), so every
objective is scored in the space it trains (UniCLIP through its heads).
``python -m prolip_jax.evaluate`` runs the fuller suites on a checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import jax
import numpy as np

from prolip_jax.storage import paths
from prolip_jax.training import progress
from prolip_jax import sharding as shd
from prolip_jax.data import digits
from prolip_jax.data import pairs
from prolip_jax.data import pipeline
from prolip_jax.embedding import embed_in_batches
from prolip_jax.embedding import normalize_images
from prolip_jax.evaluation import sharded as sharded_eval
from prolip_jax.evaluation.data import EvalData
from prolip_jax.evaluation.data import digits_data
from prolip_jax.evaluation.data import emoji_data
from prolip_jax.evaluation.metrics import retrieval_recall
from prolip_jax.evaluation.metrics import zero_shot_report
from prolip_jax.evaluation.report import number
from prolip_jax.losses import csd
from prolip_jax.losses import pcclip
from prolip_jax.storage.workdir import Workdir

Encoders = tuple[Callable, Callable]


def jit_encoders(objective, model, params, config) -> Encoders:
  """Jitted ``(enc_img(uint8 (n, s, s, 3)), enc_txt(tokens (n, L)))``, each
  returning ``(mu, logvar or None)`` in the objective's scoring space."""
  enc_img, enc_txt = objective.encoders(model, jax.device_get(params), config)
  mean, std = config.data.mean, config.data.std
  return (jax.jit(lambda x: enc_img(normalize_images(x, mean, std))),
          jax.jit(enc_txt))


def digits_eval_images(split: str, image_size: int
                       ) -> tuple[np.ndarray, np.ndarray]:
  """Eval views ``(n, s, s, 3)`` uint8 of a digits split, and its labels."""
  images, labels = digits.split(split)
  return pipeline.eval_images(np.repeat(images[..., None], 3, -1),
                              image_size), labels


# data.name -> its held-out EvalData.
HELDOUT = {
    'digits': lambda: digits_data('heldout'),
    'emoji': lambda: emoji_data('heldout'),
}


@functools.lru_cache(maxsize=None)
def _heldout(name: str) -> EvalData:
  # Built once per process: every train-time eval and the summary share it.
  return HELDOUT[name]()


def heldout_data(config) -> Optional[EvalData]:
  """The held-out set of ``config.data.name`` (None for other sources)."""
  name = config.data.name
  return _heldout(name) if name in HELDOUT else None


def heldout_header(dataset: str, count: int) -> str:
  """The summary's header line of the held-out evaluation."""
  if dataset == 'emoji':
    return (f'Held-out emoji ({count:,} images whose names were never trained '
            'on):')
  return f'Held-out {dataset} ({count:,} images never trained on):'


def heldout_info(config) -> Optional[dict[str, Any]]:
  """``{'dataset', 'images'}`` of the held-out set (for ``format_summary``),
  or None."""
  data = heldout_data(config)
  return None if data is None else {'dataset': config.data.name,
                                    'images': len(data.images)}


def zero_shot_eval(encoders: Encoders, tokenizer, config, image_size: int,
                   data: EvalData) -> dict[str, float]:
  """Zero-shot and retrieval on ``data``.

  Zero-shot: every image against ``data.class_names``, each the prompt
  ensemble of ``data.templates``. Retrieval: each image with its most
  specific (last) caption only (one caption per image; the eval suite's
  ``retrieval`` uses every caption of an image, hence other numbers).
  """
  enc_img, enc_txt = encoders
  images = pipeline.eval_images(data.images, image_size)
  bs = config.eval.batch_size
  img = embed_in_batches(enc_img, images, bs)
  prompts = [t.format(n) for n in data.class_names for t in data.templates]
  p_mu, p_lv = embed_in_batches(enc_txt, tokenizer(prompts), bs)
  shape = (len(data.class_names), len(data.templates), -1)
  out = zero_shot_report(
      img, (p_mu.reshape(shape), None if p_lv is None else p_lv.reshape(shape)),
      data.labels)
  caps = [c[-1] for c in data.captions]
  t_mu, t_lv = embed_in_batches(enc_txt, tokenizer(caps), bs)
  if img[1] is not None:
    scores = -np.asarray(csd(img[0], img[1], t_mu, t_lv))
    out['sigma2_captions'] = float(np.mean(np.exp(t_lv)))
  else:
    scores = img[0] @ t_mu.T
  out.update(retrieval_recall(scores, np.arange(len(caps))))
  return out


def zero_shot_heldout(encoders: Encoders, tokenizer, config, image_size: int
                      ) -> dict[str, float]:
  """``zero_shot_eval`` on the held-out set of ``config.data.name``
  (``heldout_data``; {} for sources without one). Digits: 1,000 images, 10
  classes, ``digits.EVAL_TEMPLATES``; emoji: one image per held-out name,
  ``emoji.EVAL_TEMPLATES``, retrieval with the templated name (level 4)."""
  data = heldout_data(config)
  if data is None:
    return {}
  return zero_shot_eval(encoders, tokenizer, config, image_size, data)


def difference_classification_digits(encoders: Encoders, tokenizer, config,
                                     image_size: int, num_pairs: int = 500,
                                     seed: int = 0, split: str = 'heldout'
                                     ) -> dict[str, float]:
  """PC-CLIP's difference-based classification (eq. 2) on the digits.

  For each ordered attribute of ``data.pairs.DIGIT_SCHEMA`` that varies
  over ``split`` (digit value, thickness, width; the bundled digits are all
  centred, so position never differs): ``num_pairs`` random ordered pairs of
  ``split`` images that differ in it, the prompt T = the attribute's "first
  has more" phrase (e.g. "the first digit is larger than the second"), and
  the prediction 1{(g(I_i) - g(I_j)) . f(T) >= 0}. Chance is 50%.

  Returns:
    ``{'diff_acc/<attribute>': accuracy, 'diff_acc': their mean}``.
  """
  enc_img, enc_txt = encoders
  images, _ = digits_eval_images(split, image_size)
  attrs = digits.attributes(split)
  g, _ = embed_in_batches(enc_img, images, config.eval.batch_size)
  out = {}
  for attr in pairs.DIGIT_SCHEMA:
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


class LoopEvaluations:
  """The loop's evaluations: the held-out set of the bundled data
  (``config.eval``: digits, emoji) and the configured evaluators
  (``config.evals``), each writing its metrics at the step."""

  def __init__(self, objective, model, config, tokenizer, mesh,
               evals: list, writer, workdir: str, is_chief: bool):
    self.objective, self.model, self.config = objective, model, config
    self.tokenizer, self.mesh, self.evals = tokenizer, mesh, evals
    self.writer, self.workdir, self.is_chief = writer, workdir, is_chief
    self._gather = jax.jit(lambda p: p, out_shardings=shd.replicated(mesh))
    self._on_mesh = None

  def heldout(self, state, step: int, write: bool = True,
              announce: bool = True) -> dict[str, float]:
    """``train_time``'s held-out evaluation (bundled data sets only; other
    data sets have ``config.evals``), written as ``eval/<metric>``; with
    ``announce`` its main figures are printed in one line (the final one
    is in the run's summary instead)."""
    config = self.config
    if config.data.name not in HELDOUT:
      return {}
    progress.status(f'Evaluating on the held-out {config.data.name} set '
                    f'(step {step})', self.is_chief)
    # Every host evaluates the same replicated parameters on the held-out set.
    encoders = jit_encoders(self.objective, self.model,
                                       self._gather(state.params), config)
    size = self.model.config.vision.image_size
    results = zero_shot_heldout(encoders, self.tokenizer, config,
                                           size)
    results.update(self.objective.train_eval_metrics(
        encoders, self.tokenizer, config, size))
    if write:
      self.writer.write(step, {f'eval/{k}': v for k, v in results.items()})
    if announce:
      progress.status(heldout_line(config.data.name, step, results),
                      self.is_chief)
    return results

  def heldout_due(self, step: int, final: bool) -> bool:
    """Whether the held-out evaluation runs at ``step`` (``final``: the
    last): on the bundled data sets, every ``eval.every_steps`` steps and
    at the end."""
    every = self.config.eval.every_steps
    return self.config.data.name in HELDOUT and (
        final or bool(every and step % every == 0))

  def due(self, step: int, final: bool) -> list[str]:
    """The names of the ``config.evals`` due at ``step``."""
    return [e.name for e in self.evals if e.due(step, final)]

  def configured(self, state, step: int, final: bool,
                 only: Optional[list[str]] = None,
                 stop: Callable[[], bool] = lambda: False
                 ) -> dict[str, float]:
    """The ``config.evals`` due at ``step`` (all of them when ``final``; of
    those, the names in ``only`` when given), embedded on the mesh where the
    train state lies, written as ``<name>/<metric>``; their JSON files go to
    ``WORKDIR/evals/step_N``. When ``stop()`` turns true the rest are left
    (a resumed run finds them missing at the step and runs them)."""
    due = [e for e in self.evals if e.due(step, final)
           and (only is None or e.name in only)]
    if not due:
      return {}
    if self._on_mesh is None:  # built (and its encoders jitted) once
      self._on_mesh = sharded_eval.from_training(
          self.objective, self.model, state.params, self.config,
          self.tokenizer, self.mesh)
    on_mesh = self._on_mesh
    on_mesh.params = state.params  # where the train state holds them
    log = lambda line: progress.status(line, self.is_chief)
    results = {}
    # The chief writes the reports (uploaded whole to a gs:// workdir).
    with (paths.local_dir_for(Workdir.of(self.workdir).evals(step))
          if self.is_chief else contextlib.nullcontext('')) as out_dir:
      for e in due:
        if stop():
          break
        log(f'Evaluator {e.name} at step {step}')
        found = e.run(on_mesh, out_dir, log)
        log(evaluator_line(e.name, found))
        results.update({f'{e.name}/{k}': v for k, v in found.items()})
    if results:
      self.writer.write(step, results)
    return results


def _pct(x: float) -> str:
  return f'{100 * x:.1f}%'


# The figures of the one-line held-out report, in its order.
_HELDOUT_LINE = (('zeroshot_csd_top1', 'top-1 CSD'),
                 ('zeroshot_cosine_top1', 'cosine'),
                 ('i2t_R@1', 'image->text R@1'),
                 ('sigma2_img', 'sigma^2 images'),
                 ('sigma2_captions', 'captions'))


def heldout_line(dataset: str, step: int, results: dict[str, float]) -> str:
  """``Held-out digits at step 300: top-1 CSD 93.1%, ...``: the figures of
  a periodic held-out evaluation, accuracies in percent, sigma^2 in the
  summary's format."""
  parts = []
  for key, label in _HELDOUT_LINE:
    if key in results:
      value = results[key]
      parts.append(f'{label} {number(value)}' if key.startswith('sigma2')
                   else f'{label} {_pct(value)}')
  return f'Held-out {dataset} at step {step}: ' + ', '.join(parts)


def evaluator_line(name: str, metrics: dict[str, float]) -> str:
  """A one-line report for the progress output: accuracies and recalls as
  percentages, e.g. ``imagenet: csd_top1 61.2%, cosine_top1 60.8%``."""
  keys = [k for k in metrics if k.endswith(('top1', 'R@1'))] or list(metrics)
  parts = []
  for k in keys[:6]:
    v = metrics[k]
    shown = _pct(v) if ('top' in k or 'R@' in k or 'more_uncertain' in k) \
        else number(v)
    parts.append(f'{k} {shown}')
  return f'{name}: ' + ', '.join(parts)


def format_summary(summary: dict[str, Any]) -> str:
  """The lines printed at the end of a training run: what was reached, the
  held-out evaluation labelled with its protocol, where the checkpoint is
  and the next commands."""
  step = summary['step']
  lines = []
  if summary.get('interrupted'):
    lines.append(f'Interrupted (Ctrl-C) at step {step}, checkpoint saved; '
                 'resume with the same command.')
  elif summary.get('preempted'):
    lines.append(f'Stopped by SIGTERM at step {step}; resume with the same '
                 'command.')
  else:
    lines.append(f'Finished at step {step} of {summary.get("total_steps", step)}'
                 + (f' ({step * summary["batch_size"]:,} pairs).'
                    if summary.get('batch_size') else '.'))
  ev = dict(summary.get('eval') or {})
  if ev:
    heldout = summary.get('heldout') or {'dataset': 'digits', 'images': 1000}
    lines.append(heldout_header(heldout['dataset'], heldout['images']))
    rows = [
        ('zero-shot top-1, CSD', 'zeroshot_csd_top1'),
        ('zero-shot top-1, cosine', 'zeroshot_cosine_top1'),
        ('zero-shot top-5, CSD', 'zeroshot_csd_top5'),
        ('zero-shot top-5, cosine', 'zeroshot_cosine_top5'),
    ]
    for label, key in rows:
      if key in ev:
        lines.append(f'  {label:36s} {_pct(ev.pop(key))}')
    for direction, name in (('i2t', 'image -> text'), ('t2i', 'text -> image')):
      keys = [f'{direction}_R@{k}' for k in (1, 5, 10)]
      if all(k in ev for k in keys):
        values = ' / '.join(_pct(ev.pop(k)) for k in keys)
        lines.append(f'  {"retrieval " + name + " R@1/5/10":36s} {values}')
    if any(k.startswith(('i2t', 't2i')) for k in summary.get('eval', {})):
      lines.append('    (one caption per image, its most specific; '
                   '`prolip_jax.evaluate` ranks every caption of an image, '
                   'so its recalls differ)')
    sig = [(label, ev.pop(key)) for label, key in (
        ('images', 'sigma2_img'), ('captions', 'sigma2_captions'),
        ('prompts', 'sigma2_prompts')) if key in ev]
    if sig:
      lines.append('  mean sigma^2 per dimension: ' + ', '.join(
          f'{label} {number(value)}' for label, value in sig))
    for key in sorted(ev):
      value = ev[key]
      shown = _pct(value) if key.startswith(('diff_acc', 'zeroshot')) else (
          number(value, 4))
      lines.append(f'  {key:36s} {shown}')
  evals = summary.get('evals') or {}
  if evals:
    lines.append('Evaluators (config.evals):')
    by_name: dict[str, dict[str, float]] = {}
    for key, value in evals.items():
      name, _, metric = key.partition('/')
      by_name.setdefault(name, {})[metric] = value
    for name, found in by_name.items():
      lines.append('  ' + evaluator_line(name, found))
  workdir = summary.get('workdir')
  lines.append(f"Checkpoint: {summary['checkpoint']}")
  if workdir and not summary.get('preempted'):
    lines.append(f'Next: python -m prolip_jax.evaluate --workdir {workdir}')
    lines.append(f'      python tools/export_pytorch.py --workdir {workdir} '
                 f'--out {workdir}/export')
  return '\n'.join(lines)
