"""The evaluations the training loop runs (``LoopEvaluations``): the short
one on its data set's held-out part, and the configured evaluators
(``config.evals``, ``evaluation/evaluators.py``). The run's final summary
and the progress lines are formatted by ``report.py``.

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
from prolip_jax import sharding as shd
from prolip_jax.data import pipeline
from prolip_jax.embedding import embed_in_batches
from prolip_jax.embedding import normalize_images
from prolip_jax.evaluation import sharded as sharded_eval
from prolip_jax.evaluation.data import EvalData
from prolip_jax.evaluation.data import digits_data
from prolip_jax.evaluation.data import emoji_data
from prolip_jax.evaluation.metrics import retrieval_recall
from prolip_jax.evaluation.metrics import zero_shot_report
from prolip_jax.evaluation.report import evaluator_line
from prolip_jax.evaluation.report import heldout_line
from prolip_jax.evaluation.zero_shot import prompt_ensemble
from prolip_jax.losses import csd
from prolip_jax.storage.workdir import Workdir

Encoders = tuple[Callable, Callable]


def jit_encoders(objective, model, params, config) -> Encoders:
  """Jitted ``(enc_img(uint8 (n, s, s, 3)), enc_txt(tokens (n, L)))``, each
  returning ``(mu, logvar or None)`` in the objective's scoring space."""
  enc_img, enc_txt = objective.encoders(model, jax.device_get(params), config)
  mean, std = config.data.mean, config.data.std
  return (jax.jit(lambda x: enc_img(normalize_images(x, mean, std))),
          jax.jit(enc_txt))


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


def heldout_info(config) -> Optional[dict[str, Any]]:
  """``{'dataset', 'images'}`` of the held-out set (for
  ``report.format_summary``), or None."""
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
  prompts = prompt_ensemble(
      lambda p: embed_in_batches(enc_txt, tokenizer(p), bs),
      data.class_names, data.templates)
  out = zero_shot_report(img, prompts, data.labels)
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


class LoopEvaluations:
  """The loop's evaluations: the held-out set of the bundled data
  (``config.eval``: digits, emoji) and the configured evaluators
  (``config.evals``), each writing its metrics at the step."""

  def __init__(self, objective, model, config, tokenizer, mesh,
               evals: list, writer, workdir: str, is_chief: bool, *,
               status: Callable[[str], None]):
    self.objective, self.model, self.config = objective, model, config
    self.tokenizer, self.mesh, self.evals = tokenizer, mesh, evals
    self.writer, self.workdir, self.is_chief = writer, workdir, is_chief
    # Where its progress lines go (training passes ``progress.status`` on
    # the chief): evaluation does not import the training loop's modules.
    self.status = status
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
    self.status(f'Evaluating on the held-out {config.data.name} set '
                f'(step {step})')
    # Every host evaluates the same replicated parameters on the held-out set.
    encoders = jit_encoders(self.objective, self.model,
                            self._gather(state.params), config)
    size = self.model.config.vision.image_size
    results = zero_shot_heldout(encoders, self.tokenizer, config, size)
    results.update(self.objective.train_eval_metrics(
        encoders, self.tokenizer, config, size))
    if write:
      self.writer.write(step, {f'eval/{k}': v for k, v in results.items()})
    if announce:
      self.status(heldout_line(config.data.name, step, results))
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
    log = self.status
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
