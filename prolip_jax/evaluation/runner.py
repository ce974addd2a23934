"""What ``python -m prolip_jax.evaluate`` runs: a loaded model's evaluators
(the command, ``prolip_jax/evaluate.py``, loads it).

``run(model)`` with no config runs the evaluators the checkpoint
was trained with (its ``config.evals``; a checkpoint without them, such as
one written before evaluators were configurable, gets the bundled report of
the data it was trained on, digits or emoji), so an emoji model is scored on
the emoji. ``config`` may instead be an eval config with ``evals`` (the
same entries as a training config: ``configs/eval/imagenet.py``) or an eval
config of the bundled report (``suites`` + ``data``: ``configs/eval/digits.py``).

Writes ``OUT/<name>.json`` per evaluator (the bundled report:
``OUT/<suite>.json`` and its figures) and ``OUT/summary.json`` with every
scalar; returns the summary and logs a table.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import ml_collections

from prolip_jax import errors
from prolip_jax.storage import paths
from prolip_jax import sharding as shd
from prolip_jax.evaluation import evaluators
from prolip_jax.evaluation import sharded
from prolip_jax.evaluation import suites
from prolip_jax.evaluation.report import format_table
from prolip_jax.evaluation.suites import jsonable

def checkpoint_evals(model) -> ml_collections.ConfigDict:
  """The ``evals`` a loaded model was trained with, or the bundled report
  of its training data (digits / emoji) when it declares none."""
  run_config = getattr(model, 'run_config', None) or {}
  evals = run_config.get('evals') or {}
  if evals:
    return ml_collections.ConfigDict(evals)
  dataset = (run_config.get('data') or {}).get('name', '')
  if dataset in ('digits', 'emoji'):
    return ml_collections.ConfigDict({dataset: {
        'kind': 'suites', 'dataset': dataset}})
  raise errors.ConfigError(
      'the model declares no evaluators (its config has no evals and was not '
      'trained on the bundled digits or emoji): pass --config, e.g. '
      'configs/eval/imagenet.py')


def run(model, config=None, out_dir: Optional[str] = None,
        log: Callable[[str], None] = print, only: tuple[str, ...] = (),
        tfds_data_dir: Optional[str] = None) -> dict:
  """Runs a model's evaluators and writes their results.

  Args:
    model: a ``LoadedModel`` (the command, ``prolip_jax.evaluate.run``,
      loads one from a path).
    config: None (the model's own ``evals``), an eval config with ``evals``,
      or a bundled-report config (``suites`` + ``data``).
    out_dir: where the results go (a local, gs:// or s3:// directory).
    log: where progress lines and the table go.
    only: names of the evaluators to run (default all).
    tfds_data_dir: the TFDS ``data_dir`` of evaluators that set none
      (default: the config's ``tfds_data_dir``, else the run's
      ``eval.tfds_data_dir``).

  Returns:
    ``{'metrics': {name/metric: value}, 'figures': [...], 'files': [...],
    'skipped': {name: reason}}``; the bundled-report config keeps its
    ``suite/metric`` names.
  """
  if isinstance(model, (str, os.PathLike)):
    raise TypeError('runner.run takes a loaded model; '
                    'prolip_jax.evaluate.run loads one from a path')
  if out_dir is None:
    raise ValueError('out_dir is required')
  dest = paths.parse(out_dir, 'out_dir')
  # A gs:// or s3:// destination gets its files uploaded at the end.
  with paths.local_dir_for(dest) as local:
    summary = _run(model, config, local, log, only, tfds_data_dir)
    with open(os.path.join(local, 'summary.json'), 'w',
              encoding='utf-8') as f:
      json.dump(jsonable(summary), f, indent=1)
    summary['files'].append(os.path.join(local, 'summary.json'))
    if local != os.fspath(dest):  # name the files where they end up
      where = lambda p: p.replace(local, os.fspath(dest), 1)
      summary['files'] = [where(p) for p in summary['files']]
      summary['figures'] = [where(p) for p in summary['figures']]
  log(format_table(summary['metrics'], kinds=summary.get('kinds')))
  if summary['figures']:
    log('figures:\n' + '\n'.join(f'  {p}' for p in summary['figures']))
  return summary


def _run(model, config, out_dir: str, log, only, tfds_data_dir) -> dict:
  """The summary of ``run``, its files written under the local
  ``out_dir``."""
  if config is not None and 'suites' in config and 'evals' not in config:
    summary = suites.run_suites(model, config, out_dir, log)
    summary['skipped'], summary['kinds'] = {}, None
    return summary
  if config is None:
    evals = checkpoint_evals(model)
    stored = ((getattr(model, 'run_config', None) or {}).get('eval') or {})
    default_dir = stored.get('tfds_data_dir', '')
  else:
    evals, default_dir = config.evals, config.get('tfds_data_dir', '')
  if tfds_data_dir is not None:
    default_dir = tfds_data_dir
  return _run_evaluators(model, evaluators.build(evals, default_dir),
                         out_dir, log, only)


def _run_evaluators(model, todo, out_dir: str, log, only) -> dict:
  if only:
    unknown = sorted(set(only) - {e.name for e in todo})
    if unknown:
      raise errors.ConfigError(
          f'no evaluator {", ".join(unknown)} (have '
          f'{", ".join(e.name for e in todo)})')
    todo = [e for e in todo if e.name in only]
  # Every device of every host; the batch split over all of them.
  model_on_mesh = sharded.from_loaded(
      model, shd.make_mesh({'data': -1, 'fsdp': 1}))
  metrics, skipped, figures, files = {}, {}, [], []
  for e in todo:
    reason = e.check_available()
    if reason:
      log(f'[{e.name}] skipped: {reason}')
      skipped[e.name] = reason
      continue
    result = e.run(model_on_mesh, out_dir, log)
    metrics.update({f'{e.name}/{k}': v for k, v in result.items()})
    figures += e.figures
    files += e.files
  if skipped and not metrics:
    raise errors.DatasetUnavailableError(
        '; '.join(f'{k}: {v}' for k, v in skipped.items()))
  return {'metrics': metrics, 'figures': figures, 'files': files,
          'skipped': skipped, 'kinds': {e.name: e.kind for e in todo}}
