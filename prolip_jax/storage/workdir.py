"""Every file of a run, named once: ``Workdir(path)``.

A workdir is a local folder or a ``gs://`` / ``s3://`` prefix
(``paths.parse``); this object is built once from the ``--workdir`` text
and passed down, so no module joins file names onto a string of its own.

Layout::

  WORKDIR/.lock                       the holder of a writing run (workdir_lock)
  WORKDIR/prolip_jax_run.json         the mark of a run of ours (``claim``)
  WORKDIR/tokenizer.model             the run's tokenizer (any kind)
  WORKDIR/metrics.jsonl               one JSON row per logged step
  WORKDIR/tensorboard/                TensorBoard events (and profiles)
  WORKDIR/checkpoints/<step>/         Orbax checkpoints
  WORKDIR/checkpoints_unreadable/     steps set aside as unreadable
  WORKDIR/evals/step_<N>/             evaluator reports and figures

A run writes into a folder only when it is a run of ours (``claim``): one
holding ``RUN_MARKER``, which a run writes right after it takes the lock and
before anything else, or checkpoints (a run from before the marker, an
import); or a fresh one, missing or holding nothing but a lock and a
tokenizer (which a run only reads). Any other
folder (another tool's ``metrics.jsonl``, a user's files) is refused in one
line before anything in it changes.
"""

from __future__ import annotations

import json
import os
import time
from typing import Union

from prolip_jax import errors
from prolip_jax.storage import file_names
from prolip_jax.storage import owned
from prolip_jax.storage import paths

LOCK_FILE = '.lock'
METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'
CHECKPOINT_DIR = 'checkpoints'
UNREADABLE_DIR = 'checkpoints_unreadable'
EVALS_DIR = 'evals'
RUN_MARKER = 'prolip_jax_run.json'
# What a fresh workdir may hold: a lock (a run killed before its marker) and
# a tokenizer, which a run reads and never writes over (setup_tokenizer).
_FRESH = (LOCK_FILE, file_names.TOKENIZER_MODEL)


class Workdir:
  """The paths of one run's files (``epath.Path``; local or remote).

  ``Workdir.of(x)`` accepts a ``Workdir`` (returned as is), a path string
  or URL, or a path object; an unsupported URL is one ``UserError`` line.
  """

  def __init__(self, path: Union[str, os.PathLike], what: str = '--workdir'):
    self.root = paths.parse(path, what)

  @classmethod
  def of(cls, workdir: Union['Workdir', str, os.PathLike]) -> 'Workdir':
    return workdir if isinstance(workdir, Workdir) else cls(workdir)

  @property
  def remote(self) -> bool:
    """True on an object store (no renames, no appends, no local locks)."""
    return paths.is_remote(self.root)

  def __str__(self) -> str:
    return os.fspath(self.root)

  def __fspath__(self) -> str:
    return os.fspath(self.root)

  def __repr__(self) -> str:
    return f'Workdir({str(self)!r})'

  def __eq__(self, other) -> bool:
    return isinstance(other, Workdir) and str(other) == str(self)

  def __hash__(self) -> int:
    return hash(str(self))

  def create(self):
    """Makes the folder (object stores have none to make)."""
    if not self.remote:
      self.root.mkdir(parents=True, exist_ok=True)

  @property
  def lock(self) -> paths.Path:
    return self.root / LOCK_FILE

  @property
  def tokenizer(self) -> paths.Path:
    return self.root / file_names.TOKENIZER_MODEL

  @property
  def metrics(self) -> paths.Path:
    return self.root / METRICS_FILE

  @property
  def tensorboard(self) -> paths.Path:
    return self.root / TENSORBOARD_DIR

  @property
  def checkpoints(self) -> paths.Path:
    return self.root / CHECKPOINT_DIR

  @property
  def unreadable(self) -> paths.Path:
    return self.root / UNREADABLE_DIR

  def checkpoint(self, step: int) -> paths.Path:
    return self.checkpoints / str(int(step))

  def evals(self, step: int) -> paths.Path:
    """Where the evaluators' reports and figures of ``step`` go."""
    return self.root / EVALS_DIR / f'step_{int(step)}'

  def has_checkpoints(self) -> bool:
    return self.checkpoints.is_dir()

  @property
  def marker(self) -> paths.Path:
    return self.root / RUN_MARKER

  def claim(self):
    """Marks the workdir as a run of ours (``RUN_MARKER``), once it is known
    to be one or to be fresh (see the module docstring); raises
    ``errors.UserError`` (one line naming what it holds) for a folder that
    holds files no run of ours wrote. Called by the lock's holder before
    the run writes anything else."""
    if self.marker.exists():
      return
    if not (self.has_checkpoints() or self.unreadable.is_dir()):
      foreign = [n for n in owned.entries(self.root)
                 if n not in _FRESH and not owned.partial_write(n)]
      if foreign:
        raise owned.refusal(
            '--workdir', self, foreign, 'a training run of ours',
            f'no {RUN_MARKER} and no {CHECKPOINT_DIR}/: a run writes its '
            f'{RUN_MARKER} first')
    self.create()
    paths.write_text(self.marker, json.dumps(
        {'format': 1, 'created': time.strftime('%Y-%m-%d %H:%M:%S')}))

  def check_checkpoint_store(self):
    """Raises ``errors.UserError`` (one line) where Orbax cannot keep
    checkpoints: ``s3://``. Orbax 0.12.8 hands TensorStore only local paths
    and ``gs://`` (an ``s3://`` path becomes a local ``s3:/`` path); exports,
    evaluation reports and ``load`` of an export work on ``s3://``."""
    if paths.scheme(self.root) == 's3':
      raise errors.UserError(
          f'workdir {self}: checkpoints cannot be kept on s3:// (Orbax '
          'writes checkpoint arrays to local paths and gs:// only); train '
          'into gs:// or a local disk, then export to s3:// with '
          'tools/export_pytorch.py --out s3://...')
