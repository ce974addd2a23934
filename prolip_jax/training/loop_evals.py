"""The evaluations of the training loop: the entries of ``config.evals``
(``evaluation/evaluator.py``), each run when due on the train state where
it lies, written to ``metrics.jsonl`` as ``<name>/<metric>`` and reported in
one progress line.

The demos' held-out evaluation is one of them (``kind='heldout'``, named
``eval``: ``eval/zeroshot_csd_top1``, ...); its figures also go into the
run's final summary (``report.format_summary``). Encoders come from the
objective (``Objective.encoders``), so every objective is scored in the
space it trains (UniCLIP through its heads).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

from prolip_jax.config import keys as config_keys
from prolip_jax.evaluation import encoders as encoders_lib
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.report import evaluator_line
from prolip_jax.evaluation.report import heldout_line
from prolip_jax.storage import paths
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import optimizer


class LoopEvaluations:
  """The loop's evaluators (``config.evals``), each writing its metrics at
  the step.

  Args:
    objective, model, config, tokenizer, mesh: the run's.
    writer: the run's metrics writer (``write(step, {name: value})``).
    workdir: the run's workdir (reports go to ``WORKDIR/evals/step_N``).
    is_chief: whether this process writes the reports.
    status: where progress lines go (training passes ``progress.status``
      on the chief): evaluation does not import the training loop's
      modules.
  """

  def __init__(self, objective, model, config, tokenizer, mesh, writer,
               workdir: str, is_chief: bool, *,
               status: Callable[[str], None]):
    self.encoders = encoders_lib.from_training(objective, model, config,
                                               tokenizer, mesh)
    self.evals = evaluator.build(
        config.get('evals'), self.encoders,
        config_keys.get(config, 'eval.tfds_data_dir'))
    self.writer, self.workdir, self.is_chief = writer, workdir, is_chief
    # The model scored: the moving average when the run keeps one for it.
    self.scored = ((lambda state: state.ema)
                   if optimizer.evaluates_ema(config, objective)
                   else (lambda state: state.params))
    self.status = status
    self.unavailable: dict[str, str] = {}

  def check_available(self) -> dict[str, str]:
    """``{name: reason}`` of the evaluators whose data cannot be read; they
    are left out of the run (training goes on)."""
    self.unavailable = evaluator.check_available(self.evals)
    return self.unavailable

  def due(self, step: int, final: bool) -> list[str]:
    """The names of the evaluators due at ``step`` (``final``: the last)."""
    return [e.name for e in self.evals
            if e.name not in self.unavailable
            and evaluator.due(e.cfg, step, final)]

  def heldout_names(self) -> list[str]:
    """The names of the ``heldout`` evaluators that run (the summary's)."""
    return [e.name for e in self.evals if e.kind == 'heldout'
            and e.name not in self.unavailable
            and int(e.cfg.every_steps) >= 0]

  def heldout_info(self, results: dict[str, float]) -> Optional[dict]:
    """``{'dataset', 'images', 'metrics'}`` of the first ``heldout``
    evaluator in ``results`` (for ``report.format_summary``), or None."""
    for e in self.evals:
      if e.kind == 'heldout' and any(k.startswith(e.name + '/')
                                     for k in results):
        data = e.opened(sets.bundled_data)
        prefix = e.name + '/'
        return {'dataset': sets.parse(e.cfg.data)[0],
                'images': len(data.images),
                'metrics': {k[len(prefix):]: v for k, v in results.items()
                            if k.startswith(prefix)}}
    return None

  def run(self, state, step: int, final: bool,
          only: Optional[list[str]] = None,
          stop: Callable[[], bool] = lambda: False,
          write: Optional[set[str]] = None) -> dict[str, float]:
    """The evaluators due at ``step`` (all due ones when ``only`` is None;
    else the names in ``only``), on the train state's parameters (its
    moving average with ``optim.ema_decay``, OTTER's teacher aside) where
    they lie; writes the metrics of those in ``write`` (default all run) as
    ``<name>/<metric>`` and their JSON files to ``WORKDIR/evals/step_N``.
    When ``stop()`` turns true the rest are left (a resumed run finds them
    missing at the step and runs them)."""
    names = self.due(step, final) if only is None else only
    todo = [e for e in self.evals if e.name in names]
    if not todo:
      return {}
    results, written = {}, {}
    # The chief writes the reports (uploaded whole to a gs:// workdir).
    with (paths.local_dir_for(Workdir.of(self.workdir).evals(step))
          if self.is_chief else contextlib.nullcontext('')) as out_dir:
      for e in todo:
        if stop():
          break
        keep = write is None or e.name in write
        self.status(f'Evaluator {e.name} at step {step}')
        found = e.run(self.scored(state), out_dir if keep else '',
                      self.status).metrics
        if e.kind == 'heldout':
          if not final:  # the final figures are in the run's summary
            self.status(heldout_line(sets.parse(e.cfg.data)[0], step, found))
        else:
          self.status(evaluator_line(e.name, found))
        named = {f'{e.name}/{k}': v for k, v in found.items()}
        results.update(named)
        if keep:
          written.update(named)
    if written:
      self.writer.write(step, written)
    return results
