"""What ``python -m prolip_jax.evaluate`` runs: a loaded model's evaluators
(the command, ``prolip_jax/evaluate.py``, loads it).

``run(model)`` with no config runs the evaluators the checkpoint was
trained with (its ``config.evals``) and, for a model trained on the bundled
digits or emoji, the bundled report of that set, so an emoji model is
scored on the emoji. ``config`` may instead be an eval config with ``evals`` (the
same entries as a training config: ``configs/eval/benchmarks.py``, the
bundled report ``configs/eval/digits.py``).

Writes ``OUT/<name>.json`` per evaluator, its figures beside them, and
``OUT/summary.json`` with every scalar; returns the summary and logs a
table. ``OUT`` must be missing, empty or a report of ours: the files are
written elsewhere first, then copied in after ``OUT/prolip_jax_eval_files.json``
(``owned.REPORT_RECORD``), which lists every file a report wrote there;
a folder holding anything else is refused before any work (``check_out``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from typing import Callable, Optional

import ml_collections

from prolip_jax import errors
from prolip_jax.storage import owned
from prolip_jax.storage import paths
from prolip_jax import sharding as shd
from prolip_jax.evaluation import encoders as encoders_lib
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.evaluator import jsonable
from prolip_jax.evaluation.report import format_table

SUMMARY_FILE = 'summary.json'


def checkpoint_evals(model) -> ml_collections.ConfigDict:
  """The ``evals`` a loaded model was trained with and, for a model trained
  on the bundled digits or emoji, the bundled report of that set
  (``configs/eval/<set>.py``; an entry of the same name as one of the
  run's is the run's)."""
  run_config = getattr(model, 'run_config', None) or {}
  evals = dict(run_config.get('evals') or {})
  dataset = (run_config.get('data') or {}).get('name', '')
  # A bundled set with a report of its own (a source added later may have
  # none).
  if dataset in sets.bundled() and os.path.isfile(
      bundled_config_path(dataset)):
    report = load_config_file(bundled_config_path(dataset)).evals.to_dict()
    evals = {**report, **evals}
  if not evals:
    # Say what is known: an export from before exports recorded their run
    # (or a release snapshot) records nothing of its training data.
    why = (f'its run config has no evals and names the training set '
           f'{dataset!r}, which has no bundled report' if run_config else
           'it records no training run: a release snapshot, or an export '
           'from before exports recorded one (export it again)')
    raise errors.ConfigError(
        f'the model declares no evaluators ({why}): pass --config, e.g. '
        'configs/eval/benchmarks.py')
  return ml_collections.ConfigDict(evals)


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def bundled_config_path(dataset: str) -> str:
  """``configs/eval/<dataset>.py`` of the repository: the bundled report."""
  return os.path.join(_REPO, 'configs', 'eval', f'{dataset}.py')


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """``get_config()`` of a Python config file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no eval config file {path}')
  spec = importlib.util.spec_from_file_location(
      f'_eval_config_{abs(hash(path))}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def run(model, config=None, out_dir: Optional[str] = None,
        log: Callable[[str], None] = print, only: tuple[str, ...] = (),
        tfds_data_dir: Optional[str] = None) -> dict:
  """Runs a model's evaluators and writes their results.

  Args:
    model: a ``LoadedModel`` (the command, ``prolip_jax.evaluate.run``,
      loads one from a path).
    config: None (the model's own ``evals``, ``checkpoint_evals``) or an
      eval config with ``evals`` (``configs/eval/digits.py``,
      ``configs/eval/benchmarks.py``).
    out_dir: where the results go (a local, gs:// or s3:// directory).
    log: where progress lines and the table go.
    only: names of the evaluators to run (default all).
    tfds_data_dir: the TFDS ``data_dir`` of evaluators that set none
      (default: the config's ``tfds_data_dir``, else the run's
      ``eval.tfds_data_dir``).

  Returns:
    ``{'metrics': {name/metric: value}, 'figures': [...], 'files': [...],
    'skipped': {name: reason}, 'kinds': {name: kind}}``.
  """
  if isinstance(model, (str, os.PathLike)):
    raise TypeError('runner.run takes a loaded model; '
                    'prolip_jax.evaluate.run loads one from a path')
  if out_dir is None:
    raise ValueError('out_dir is required')
  dest = check_out(out_dir)  # a folder of the user's: before any work
  # Written in a folder of its own, then copied into ``dest`` after the
  # record that lists every file (a kill mid-copy leaves only ours).
  local = tempfile.mkdtemp(prefix='prolip_jax-eval-')
  try:
    summary = _run(model, config, local, log, only, tfds_data_dir)
    with open(os.path.join(local, SUMMARY_FILE), 'w',
              encoding='utf-8') as f:
      json.dump(jsonable(summary), f, indent=1)
    summary['files'].append(os.path.join(local, SUMMARY_FILE))
    _publish(local, dest)
    where = lambda p: p.replace(local, os.fspath(dest), 1)
    summary['files'] = [where(p) for p in summary['files']]
    summary['figures'] = [where(p) for p in summary['figures']]
  finally:
    shutil.rmtree(local, ignore_errors=True)
  log(format_table(summary['metrics'], kinds=summary.get('kinds')))
  if summary['figures']:
    log('figures:\n' + '\n'.join(f'  {p}' for p in summary['figures']))
  return summary


def check_out(out_dir) -> paths.Path:
  """``out_dir`` parsed, once it is known to be missing, empty or an
  evaluation report of ours: every entry listed by its
  ``owned.REPORT_RECORD`` (or, for a report written before the record, by
  its ``summary.json``'s files). Anything else is refused in one line
  (``errors.UserError``): a report never replaces a file it did not
  write."""
  dest = paths.parse(out_dir, '--out')
  if dest.is_file():
    raise errors.UserError(f'--out {dest} is a file, not a folder')
  _ours(dest)
  return dest


def _ours(dest) -> list[str]:
  """The report files ``dest`` holds (``check_out``'s refusal when it
  holds others)."""
  present = owned.entries(dest)
  ours = set(owned.listed(dest, owned.REPORT_RECORD) or ())
  if owned.REPORT_RECORD not in present:
    ours |= _summary_files(dest)
  foreign = [n for n in present if n not in ours | {owned.REPORT_RECORD}
             and not owned.partial_write(n)]
  if foreign:
    raise owned.refusal('--out', dest, foreign,
                        'an evaluation report of ours',
                        f'no {owned.REPORT_RECORD} lists them')
  return [n for n in present
          if n != owned.REPORT_RECORD and not owned.partial_write(n)]


def _summary_files(dest) -> set[str]:
  """The files a report from before ``owned.REPORT_RECORD`` wrote, as its
  ``summary.json`` lists them (its ``files`` and ``figures``, with
  ``metrics``); empty for any other file of that name."""
  try:
    summary = json.loads(paths.read_text(paths.as_path(dest) / SUMMARY_FILE))
    written = list(summary['files']) + list(summary['figures'])
    assert isinstance(summary['metrics'], dict)
  except (OSError, ValueError, KeyError, TypeError, AssertionError):
    return set()
  return {os.path.basename(str(p)) for p in written} | {SUMMARY_FILE}


def _publish(local: str, dest):
  """Copies the report files of ``local`` into ``dest``, after the record
  that lists them with the report files already there."""
  names = sorted(os.listdir(local))
  kept = _ours(dest)  # again: the folder may have changed meanwhile
  if not paths.is_remote(dest):
    dest.mkdir(parents=True, exist_ok=True)
  owned.write_record(dest, owned.REPORT_RECORD, kept + names)
  for name in names:
    paths.copy_file(os.path.join(local, name), dest / name)


def _run(model, config, out_dir: str, log, only, tfds_data_dir) -> dict:
  """The summary of ``run``, its files written under the local
  ``out_dir``."""
  if config is None:
    evals = checkpoint_evals(model)
    stored = ((getattr(model, 'run_config', None) or {}).get('eval') or {})
    default_dir = stored.get('tfds_data_dir', '')
  else:
    if 'evals' not in config:
      raise errors.ConfigError('an eval config declares evals (a mapping '
                               'name -> entry, as configs/eval/digits.py)')
    evals, default_dir = config.evals, config.get('tfds_data_dir', '')
  if tfds_data_dir is not None:
    default_dir = tfds_data_dir
  names = evaluator.entries(evals)
  if only:
    unknown = sorted(set(only) - set(names))
    if unknown:
      raise errors.ConfigError(
          f'no evaluator {", ".join(unknown)} (have {", ".join(names)})')
    evals = {k: v for k, v in names.items() if k in only}
  # Every device of every host; the batch split over all of them.
  encoders = encoders_lib.from_loaded(
      model, shd.make_mesh({'data': -1, 'fsdp': 1}))
  todo = evaluator.build(evals, encoders, default_dir)
  metrics, skipped, figures, files = {}, {}, [], []
  for e in todo:
    reason = e.available()
    if reason:
      log(f'[{e.name}] skipped: {reason}')
      skipped[e.name] = reason
      continue
    log(f'[{e.name}] running ({e.kind})')
    result = e.run(model.params, out_dir, log)
    if result.skipped:
      skipped[e.name] = result.skipped
    metrics.update({f'{e.name}/{k}': v for k, v in result.metrics.items()})
    figures += result.figures
    files += result.files
  if skipped and not metrics:
    raise errors.DatasetUnavailableError(
        '; '.join(f'{k}: {v}' for k, v in skipped.items()))
  return {'metrics': metrics, 'figures': figures, 'files': files,
          'skipped': skipped, 'kinds': {e.name: e.kind for e in todo}}
