"""Runs the configured suites on a model and writes their results.

``run(model_or_path, config)`` runs ``config.suites`` in order and writes
``OUT/<suite>.json``, PNG figures beside them and ``summary.json`` with every
scalar; it returns the summary and logs a table.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional

import numpy as np

from prolip_jax import inference
from prolip_jax.evaluation import applications
from prolip_jax.evaluation import retrieval
from prolip_jax.evaluation import uncertainty_report
from prolip_jax.evaluation import zero_shot
from prolip_jax.evaluation.context import Context
from prolip_jax.evaluation.context import SkipSuite
from prolip_jax.evaluation.data import load_data
from prolip_jax.evaluation.embedder import Embedder
from prolip_jax.evaluation.report import format_table

SUITES = {
    'zero_shot': zero_shot.suite_zero_shot,
    'retrieval': retrieval.suite_retrieval,
    'uncertainty': uncertainty_report.suite_uncertainty,
    'bprw': applications.suite_bprw,
    'traversal': applications.suite_traversal,
    'filtering': applications.suite_filtering,
}


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

