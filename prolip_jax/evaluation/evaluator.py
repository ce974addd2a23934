"""The evaluator protocol: ``config.evals``, run during training and by
``python -m prolip_jax.evaluate``.

``config.evals`` maps a name to an entry (the name prefixes the metrics:
``imagenet/csd_top1`` in ``metrics.jsonl``, TensorBoard and the table)::

  c.evals.imagenet = dict(kind='zero_shot', data='tfds:imagenet2012:validation',
                          templates='imagenet', every_steps=5000)
  c.evals.coco = dict(kind='retrieval', data='tfds:coco_captions:test')

Each kind is one module of ``prolip_jax/evaluation/kinds/`` named after it,
holding one class ``Evaluator`` (a subclass of ``Evaluator`` here) whose
``OPTIONS`` declares the keys it accepts beyond ``COMMON``, with their
defaults::

  evaluator = kind_class('zero_shot')(encoders, name='imagenet', **cfg)
  result = evaluator.run(params, out_dir)   # Result(metrics, details, ...)

Adding a kind is adding its module; ``kind_names()`` lists the modules
found (a folder appended to ``kinds.__path__`` adds its modules too).
``encoders`` (``evaluation/encoders.py``) is the one way to embed: every
device and host, the batch split over the mesh, the parameters passed at
each call (a training run's sharded train state where it lies).

Common keys (``COMMON``): ``data`` (``evaluation/sets.py``:
``tfds:NAME:SPLIT``, ``folder:PATH``, ``jsonl:PATH``, ``array_record:GLOB``,
``digits[:SPLIT]``, ``emoji[:SPLIT]``), ``data_dir`` (TFDS), ``every_steps``
(> 0: every that many steps and at the end of training; 0: at the end only;
-1: only in ``evaluate``), ``batch_size`` (global), ``num_threads`` /
``num_workers`` (Grain decoding), ``seed``, ``progress`` (a progress line
while embedding); for the bundled sets
``per_class`` (digits), ``render_size`` (emoji) and ``phrasings``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import time
from typing import Any, Callable, Optional

import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from prolip_jax import errors
from prolip_jax import plotting
from prolip_jax.evaluation import kinds as kinds_package
from prolip_jax.evaluation import prompts
from prolip_jax.evaluation import sets
from prolip_jax.evaluation.encoders import Encoders
from prolip_jax.evaluation.encoders import Progress
from prolip_jax.evaluation.metrics import scoring_metrics

COMMON = {'kind': '', 'data': '', 'data_dir': '', 'every_steps': -1,
          'batch_size': 256, 'num_threads': 16, 'num_workers': 0, 'seed': 0,
          'per_class': 0, 'render_size': 64, 'phrasings': 'templates',
          'progress': False}
# Keys of COMMON that only the bundled sets read.
_BUNDLED_ONLY = ('per_class', 'render_size', 'phrasings')



def kind_names() -> tuple[str, ...]:
  """The kinds: the modules of ``prolip_jax/evaluation/kinds/``."""
  return tuple(sorted(m.name for m in pkgutil.iter_modules(
      kinds_package.__path__)))



class SkipEvaluator(Exception):
  """An evaluator that does not apply to the model (e.g. it needs sigma^2
  from a deterministic model): the reason is logged and the rest go on."""


@dataclasses.dataclass
class Result:
  """What ``Evaluator.run`` returns: scalar ``metrics`` (fractions, not
  percentages), JSON-able ``details``, and the ``figures`` and ``files``
  it wrote."""
  metrics: dict[str, float]
  details: dict[str, Any]
  figures: list[str] = dataclasses.field(default_factory=list)
  files: list[str] = dataclasses.field(default_factory=list)
  skipped: Optional[str] = None


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


class Evaluator:
  """The base of every kind: ``Evaluator(encoders, name, **cfg)``, then
  ``run(params, out_dir, log) -> Result``.

  A kind overrides ``evaluate`` (the scores) and declares ``OPTIONS`` (its
  keys beyond ``COMMON``, with their defaults; ``DEFAULTS`` may change a
  common key's default) and ``LABELS`` (how ``report.py`` shows its
  metrics). ``run`` times it, writes ``out_dir/<name>.json``
  and turns ``SkipEvaluator`` into a skipped result.
  """

  OPTIONS: dict[str, Any] = {}
  DEFAULTS: dict[str, Any] = {}
  # How the printed reports show its metric keys (``report.Label``s, the
  # first that matches a key applies); a key without one is shown as it is.
  LABELS: tuple = ()
  # Whether ``data`` is required (a kind with a default set says False).
  NEEDS_DATA = True

  def __init__(self, encoders: Encoders, name: str = '', **cfg):
    self.encoders = encoders
    self.name = name or self.kind
    self.cfg = complete(self.name, {'kind': self.kind, **cfg})
    self.batch_size = int(self.cfg.batch_size)
    self.seed = int(self.cfg.seed)
    self.out_dir = ''
    self.log: Callable[[str], None] = print
    self._opened = None  # the data set, kept for the next run

  @property
  def kind(self) -> str:
    return type(self).__module__.rsplit('.', 1)[-1]

  def available(self) -> Optional[str]:
    """None when its data can be read; else the reason (one line)."""
    return sets.available(self.cfg) if self.cfg.data else None

  def run(self, params: Any, out_dir: str = '',
          log: Callable[[str], None] = print) -> Result:
    """Scores the model of ``params``; writes ``out_dir/<name>.json``
    (none when ``out_dir`` is '': a host that writes nothing)."""
    self.out_dir, self.log = out_dir, log
    if out_dir:
      os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    try:
      result = self.evaluate(params)
    except SkipEvaluator as e:
      log(f'[{self.name}] skipped: {e}')
      result = Result({}, {'skipped': str(e)}, skipped=str(e))
    seconds = time.time() - t0
    if out_dir:
      path = os.path.join(out_dir, f'{self.name}.json')
      with open(path, 'w', encoding='utf-8') as f:
        json.dump(jsonable({
            'evaluator': self.name, 'kind': self.kind,
            'config': self.cfg.to_dict(), 'metrics': result.metrics,
            'details': result.details, 'figures': result.figures,
            'seconds': seconds}), f, indent=1)
      result.files.append(path)
    return result

  def evaluate(self, params: Any) -> Result:
    """The kind's scores of the model of ``params``."""
    raise NotImplementedError

  # -- helpers every kind may use ----------------------------------------

  def opened(self, open_set: Callable[[Any], Any]):
    """``open_set(cfg)``, opened once: a training run evaluates every few
    thousand steps, and a captioned set reads its captions when opened."""
    if self._opened is None:
      self._opened = open_set(self.cfg)
    return self._opened

  def metric_names(self) -> list[str]:
    """The scores to report: ``cfg.metrics`` less CSD for a deterministic
    model."""
    return scoring_metrics(self.cfg.metrics, self.encoders.probabilistic)

  def progress(self, desc: str) -> Progress:
    return Progress(f'[{self.name}] {desc}', bool(self.cfg.progress))

  def embed_images(self, params, images, desc: str = 'images', **kw):
    """``encoders.embed_images`` with the entry's batch and Grain settings,
    and one line on the rate."""
    emb = self.encoders.embed_images(
        params, images, self.batch_size, num_threads=int(self.cfg.num_threads),
        num_workers=int(self.cfg.num_workers),
        progress=self.progress(desc), **kw)
    self.log(f'[{self.name}] {images.size:,} {desc} of {images.name} in '
             f'{emb.seconds:.1f}s ({images.size / max(emb.seconds, 1e-9):,.0f}'
             f' images/s on {self.encoders.mesh.size} device(s))')
    return emb

  def embed_texts(self, params, texts, desc: str = 'texts'):
    return self.encoders.embed_texts(params, texts, self.batch_size,
                                     self.progress(desc))

  def figure(self, fig, file_name: str, expected_axes: Optional[int] = None
             ) -> str:
    """Saves ``fig`` as ``out_dir/file_name`` (nothing on a host that
    writes nothing: returns '')."""
    if expected_axes is not None and len(fig.axes) != expected_axes:
      raise AssertionError(f'{file_name}: {len(fig.axes)} axes, expected '
                           f'{expected_axes}')
    if not self.out_dir:
      plotting.pyplot().close(fig)
      return ''
    return plotting.save(fig, os.path.join(self.out_dir, file_name),
                         source=self.encoders.source)


def kind_class(kind: str) -> type[Evaluator]:
  """The ``Evaluator`` class of a kind (``kinds/<kind>.py``); an unknown
  kind is a ``ConfigError`` naming the known ones."""
  known = kind_names()
  if kind not in known:
    raise errors.ConfigError(
        f'evaluator kind {kind!r}: expected one of {", ".join(known)}'
        f'{errors.nearest(str(kind), known)}')
  module = importlib.import_module(f'{kinds_package.__name__}.{kind}')
  return module.Evaluator


def complete(name: str, raw: Any) -> ml_collections.ConfigDict:
  """One ``config.evals`` entry, checked and completed with the defaults of
  its kind; a wrong kind or key is a ``ConfigError`` naming it."""
  raw = dict(raw.to_dict() if hasattr(raw, 'to_dict') else raw)
  kind = raw.get('kind', '')
  try:
    cls = kind_class(kind)
  except errors.ConfigError as e:
    raise errors.ConfigError(f'evals.{name}.kind: {e}') from None
  allowed = {**COMMON, **cls.DEFAULTS, **cls.OPTIONS}
  for key in raw:
    if key not in allowed:
      raise errors.ConfigError(
          f'evals.{name}.{key}: not a setting of a {kind} evaluator '
          f'(settings: {", ".join(sorted(allowed))})'
          f'{errors.nearest(key, allowed)}')
  if cls.NEEDS_DATA and not raw.get('data'):
    raise errors.ConfigError(f'evals.{name}.data is required (e.g. '
                             "'tfds:imagenet2012:validation')")
  if raw.get('data'):
    scheme, _ = sets.parse(raw['data'])
    if scheme not in sets.bundled():
      for key in _BUNDLED_ONLY:
        # Its default is what a completed entry holds (complete(name,
        # complete(name, raw)) is complete(name, raw): build does it).
        if key in raw and raw[key] != COMMON[key]:
          raise errors.ConfigError(
              f'evals.{name}.{key}: a setting of the bundled sets '
              f'({", ".join(sets.bundled())}), not of {raw["data"]!r}')
  if isinstance(raw.get('templates'), (list, tuple)):  # not an asset name
    try:
      prompts.check_templates(raw['templates'])
    except errors.ConfigError as e:
      raise errors.ConfigError(f'evals.{name}.templates: {e}') from None
  if int(raw.get('batch_size', 1)) < 1:
    raise errors.ConfigError(f'evals.{name}.batch_size must be >= 1 '
                             f'(got {raw["batch_size"]!r})')
  if int(raw.get('every_steps', -1)) < -1:
    raise errors.ConfigError(
        f'evals.{name}.every_steps must be >= -1, -1 being evaluate only '
        f'(got {raw["every_steps"]!r})')
  return ml_collections.ConfigDict({**allowed, **raw})


def entries(evals: Any) -> dict[str, ml_collections.ConfigDict]:
  """``{name: completed entry}`` of ``config.evals`` in name order; checks
  every entry (``complete``) without building anything."""
  if not evals:
    return {}
  if not hasattr(evals, 'items'):
    raise errors.ConfigError('evals must map names to evaluator entries, '
                             f'got {type(evals).__name__}')
  return {name: complete(name, raw) for name, raw in sorted(evals.items())}


def build(evals: Any, encoders: Encoders, tfds_data_dir: str = '',
          **overrides) -> list[Evaluator]:
  """The evaluators of ``config.evals`` (a mapping name -> entry) on
  ``encoders``, in name order; ``tfds_data_dir`` is the ``data_dir`` of
  those that set none (``config.eval.tfds_data_dir``); ``overrides`` are
  keys set on every entry that declares them (e.g. ``progress``)."""
  out = []
  for name, cfg in entries(evals).items():
    if not cfg.data_dir:
      cfg.data_dir = tfds_data_dir or ''
    for key, value in overrides.items():
      if key in cfg:
        cfg[key] = value
    out.append(kind_class(cfg.kind)(encoders, name, **cfg.to_dict()))
  return out


def due(cfg, step: int, final: bool) -> bool:
  """Whether training runs the entry ``cfg`` at ``step`` (``final``: the
  last step)."""
  every = int(cfg.every_steps)
  if every < 0:
    return False
  return final or (every > 0 and step % every == 0)


def check_available(evals: list[Evaluator]) -> dict[str, str]:
  """``{name: reason}`` of the training evaluators whose data cannot be
  read; they are skipped for the run (training goes on). With several
  hosts, process 0's finding holds for all (they run the evaluators
  together)."""
  reasons = {}
  for e in evals:
    if int(e.cfg.every_steps) >= 0:
      reason = e.available()
      if reason:
        reasons[e.name] = reason
  if jax.process_count() > 1:
    mask = np.asarray([e.name in reasons for e in evals], np.int32)
    mask = multihost_utils.broadcast_one_to_all(mask)
    for e, bad in zip(evals, mask):
      if bad and e.name not in reasons:
        reasons[e.name] = 'unavailable on process 0'
      elif not bad:
        reasons.pop(e.name, None)
  return reasons
