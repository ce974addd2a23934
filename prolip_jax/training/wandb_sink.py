"""Optional Weights & Biases logging beside TensorBoard.

``--config.wandb.project=NAME`` sends every row the run writes to
``metrics.jsonl`` (training rows, held-out and evaluator rows) to a W&B run
as well, at the same step. ``wandb`` is imported only then; without the
package the run stops before training with one line naming
``pip install wandb``. Only the chief process logs. Each launch (a resume
too) is its own W&B run, named ``wandb.name`` (default: the workdir's last
folder name) and starting at the resumed step, so its rows equal the
workdir's ``metrics.jsonl`` rows of those steps.

A W&B run that cannot start (no network, no login in online mode) costs the
run its W&B rows, not its training: one ``warning:`` line and training
goes on.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from prolip_jax import errors
from prolip_jax.config import keys as config_keys

# wandb.init's modes; '' leaves it to W&B (WANDB_MODE, else online).
MODES = ('', 'online', 'offline', 'disabled')


def _import_wandb():
  try:
    import wandb  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise errors.UserError(
        'wandb.project is set but the wandb package is not installed: pip '
        'install wandb (or leave --config.wandb.project empty)') from e
  return wandb


class WandbSink:
  """Logs rows to one W&B run: ``write(step, row)`` as ``run.log``."""

  def __init__(self, run):
    self.run = run

  def write(self, step: int, scalars: dict[str, float]):
    self.run.log({k: float(v) for k, v in scalars.items()}, step=int(step))

  def close(self):
    if self.run is not None:
      self.run.finish()
      self.run = None


def check(config):
  """The ``wandb`` module when ``config.wandb.project`` is set, else None;
  raises a ``UserError`` for a ``wandb.mode`` W&B does not know or a
  missing package (checked before the run builds anything)."""
  if not config_keys.get(config, 'wandb.project'):
    return None
  mode = config_keys.get(config, 'wandb.mode')
  if mode not in MODES:
    raise errors.ConfigError(f'wandb.mode {mode!r}: one of '
                             f'{", ".join(repr(m) for m in MODES)}')
  return _import_wandb()


def open_sink(config, workdir, is_chief: bool,
              start: int = 0) -> Optional[WandbSink]:
  """A ``WandbSink`` for ``config.wandb`` (None when ``wandb.project`` is
  empty, or on a process other than the chief). Every process checks that
  ``wandb`` imports, so a missing package stops all hosts alike."""
  wandb = check(config)
  if wandb is None or not is_chief:
    return None
  project = config_keys.get(config, 'wandb.project')
  name = (config_keys.get(config, 'wandb.name')
          or os.path.basename(os.fspath(workdir).rstrip('/')))
  try:
    run = wandb.init(
        project=project, entity=config_keys.get(config, 'wandb.entity')
        or None, name=name, mode=config_keys.get(config, 'wandb.mode')
        or None, config=json.loads(config.to_json_best_effort()),
        notes=f'workdir {workdir}, from step {start}')
  except Exception as e:  # pylint: disable=broad-except
    print(f'warning: W&B logging is off: wandb.init failed: '
          f'{str(e).splitlines()[0] if str(e) else type(e).__name__}',
          flush=True)
    return None
  return WandbSink(run)


class Tee:
  """A metrics writer whose rows also go to a ``WandbSink``; anything else
  is the wrapped writer's."""

  def __init__(self, writer, sink: WandbSink):
    self.writer = writer
    self.sink = sink

  def write(self, step: int, scalars: dict[str, float]):
    self.writer.write(step, scalars)
    self.sink.write(step, scalars)

  def close(self):
    try:
      self.writer.close()
    finally:
      self.sink.close()

  def __getattr__(self, name: str) -> Any:
    return getattr(self.writer, name)


def tee(writer, config, workdir, is_chief: bool, start: int = 0):
  """``writer`` itself, or a ``Tee`` sending its rows to W&B too (when
  ``config.wandb.project`` is set)."""
  sink = open_sink(config, workdir, is_chief, start)
  return writer if sink is None else Tee(writer, sink)
