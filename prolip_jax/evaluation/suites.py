"""The bundled report: the suites of an eval config on a loaded model.

``run_suites(model, config, out_dir)`` runs ``config.suites`` on
``config.data`` (the bundled digits or emoji) in order and writes
``OUT/<suite>.json`` and PNG figures beside them; ``configs/eval/digits.py``
and ``configs/eval/emoji.py`` are the configs. A ``suites`` entry of
``config.evals`` (``evaluation/evaluators.py``) runs it; so does
``python -m prolip_jax.evaluate --config configs/eval/digits.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from typing import Callable

import numpy as np

from prolip_jax.evaluation import applications
from prolip_jax.evaluation import retrieval
from prolip_jax.evaluation import uncertainty_report
from prolip_jax.evaluation import zero_shot
from prolip_jax.evaluation.context import Context
from prolip_jax.evaluation.context import SkipSuite
from prolip_jax.evaluation.data import load_data
from prolip_jax.evaluation.embedder import Embedder

SUITES = {
    'zero_shot': zero_shot.suite_zero_shot,
    'retrieval': retrieval.suite_retrieval,
    'uncertainty': uncertainty_report.suite_uncertainty,
    'bprw': applications.suite_bprw,
    'traversal': applications.suite_traversal,
    'filtering': applications.suite_filtering,
}


def jsonable(x):
  """``x`` with numpy scalars/arrays as JSON values (non-finite floats: null)."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return jsonable(x.tolist())
  if isinstance(x, (np.floating, float)):
    x = float(x)
    return x if np.isfinite(x) else None
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.bool_,)):
    return bool(x)
  return x


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def bundled_config_path(dataset: str) -> str:
  """``configs/eval/<dataset>.py`` of the repository."""
  return os.path.join(_REPO, 'configs', 'eval', f'{dataset}.py')


def load_config_file(path: str):
  """``get_config()`` of a Python config file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no eval config file {path}')
  spec = importlib.util.spec_from_file_location(
      f'_eval_config_{abs(hash(path))}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def run_suites(model, config, out_dir: str,
               log: Callable[[str], None] = print) -> dict:
  """Runs ``config.suites`` on ``model`` and writes ``out_dir/<suite>.json``
  and the figures.

  Args:
    model: a ``LoadedModel``.
    config: an eval config (``configs/eval/digits.py``).
    out_dir: where the JSON files and figures go.
    log: where progress lines go.

  Returns:
    ``{'metrics': {suite/metric: value}, 'figures': [...], 'files': [...],
    'data': name}``.
  """
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
      json.dump(jsonable({'suite': suite, 'data': data.name,
                           'metrics': metrics, 'details': details,
                           'figures': figs, 'seconds': seconds,
                           'config': config[suite].to_dict()}), f, indent=1)
    files.append(path)
    figures += figs
    all_metrics.update({f'{suite}/{k}': v for k, v in metrics.items()})
    log(f'[{suite}] done in {seconds:.1f}s')
  return {'metrics': all_metrics, 'figures': figures, 'files': files,
          'data': data.name}
