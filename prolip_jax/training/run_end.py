"""The end of a run, after its loop: the last checkpoint (waited for), the
final evaluations a previous run did not write, and the summary that
``train_and_evaluate`` returns and process 0 prints."""

from __future__ import annotations

from typing import Optional

import jax

from prolip_jax.evaluation import report as eval_report
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import progress
from prolip_jax.training.loop import Loop
from prolip_jax.training.loop import missing_evaluations


def finish(loop: Loop, stopper: progress.StopFlag) -> dict:
  """Ends the run whose ``loop`` has ended (at its end or a stop): saves its
  last step, runs the final evaluations (none after a stop), closes the
  writer; returns the summary."""
  _last_save(loop, stopper)
  evals_results, heldout = _final_evaluations(
      loop.workdir, loop.evaluations, loop.state, loop.step, stopper.stop)
  loop.writer.close()
  return _summary(loop.config, loop.workdir, loop.step, stopper,
                  loop.last_metrics, heldout, evals_results)


def _last_save(loop: Loop, stopper: progress.StopFlag):
  """The checkpoint of the step the loop ended after (its end or a stop),
  waited for. A stop before the first step has nothing new to save and
  ends here (``StopFlag.check``)."""
  start, step, end = loop.start, loop.step, loop.end
  if step > start:
    loop.save(step, force=True)
  loop.watch.finish()
  loop.mngr.close()
  if step == start < end:
    stopper.check('compiling', resumed=lambda: start > 0)


def _final_evaluations(workdir: Workdir, evaluations, state, step: int,
                       stopped: bool) -> tuple[dict, Optional[dict]]:
  """The final evaluations a previous run did not write (a re-run of a
  finished command writes none again; the held-out figures are computed
  for the summary all the same). Returns the other evaluators' results
  and the held-out evaluation's (``LoopEvaluations.heldout_info``); none
  after a stop (``stopped``: they are left to the resumed run; a signal
  from here on changes nothing, and a stop cut short in them leaves them
  missing for the next run)."""
  if stopped:
    return {}, None
  missing = missing_evaluations(workdir, evaluations, step, final=True)
  heldout = evaluations.heldout_names()
  names = [n for n in evaluations.due(step, True)
           if n in missing or n in heldout]
  results = evaluations.run(state, step, True, only=names,
                            write=set(missing))
  return ({k: v for k, v in results.items()
           if k.partition('/')[0] not in heldout},
          evaluations.heldout_info(results))


def _summary(config, workdir: Workdir, step: int, stopper, last_metrics,
             heldout: Optional[dict], evals_results: dict) -> dict:
  """What ``train_and_evaluate`` returns, printed by process 0
  (``report.format_summary``)."""
  stopped_at = stopper.stop
  summary = {'step': step, 'checkpoint': str(workdir.checkpoint(step)),
             'eval': heldout['metrics'] if heldout else {},
             'train': last_metrics, 'preempted': stopped_at,
             'interrupted': stopped_at and stopper.interrupted,
             'workdir': str(workdir), 'batch_size': config.batch_size,
             'total_steps': config.total_steps, 'heldout': heldout,
             'evals': evals_results}
  if jax.process_index() == 0:
    print(eval_report.format_summary(summary), flush=True)
  return summary
