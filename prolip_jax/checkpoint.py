"""Orbax checkpoints of a training run.

Layout: ``WORKDIR/checkpoints/<step>/`` holds three Orbax items:
``params`` (the model parameters), ``opt_state`` (optax state) and ``meta``
(JSON: the step, the full run config and the model config), so a single
checkpoint directory is enough to rebuild the model. Objectives with an EMA
teacher (OTTER) add a fourth item, ``teacher`` (parameters like ``params``).
The sentencepiece model a run uses is copied to ``WORKDIR/tokenizer.model``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = 'checkpoints'
TOKENIZER_FILE = 'tokenizer.model'


def checkpoint_dir(workdir: str) -> str:
  """Absolute ``WORKDIR/checkpoints``."""
  return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


def manager(workdir: str, max_to_keep: Optional[int] = 3,
            save_interval_steps: int = 1, read_only: bool = False
            ) -> ocp.CheckpointManager:
  """A CheckpointManager over ``WORKDIR/checkpoints`` with our three items."""
  if read_only:
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
  else:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                               item_names=('params', 'opt_state', 'meta',
                                           'teacher'))


def save(mngr: ocp.CheckpointManager, step: int, params: Any, opt_state: Any,
         meta: dict[str, Any], force: bool = False,
         teacher: Optional[Any] = None) -> bool:
  """Saves (asynchronously) one checkpoint; returns whether it was written.

  ``teacher``: EMA-teacher parameters (OTTER), saved as their own item.
  """
  items = dict(params=ocp.args.StandardSave(params),
               opt_state=ocp.args.StandardSave(opt_state))
  if teacher is not None:
    items['teacher'] = ocp.args.StandardSave(teacher)
  meta = dict(meta, has_teacher=teacher is not None)
  return mngr.save(step, args=ocp.args.Composite(
      meta=ocp.args.JsonSave(meta), **items), force=force)


def restore(mngr: ocp.CheckpointManager, step: int, abstract_params: Any,
            abstract_opt_state: Any, abstract_teacher: Optional[Any] = None
            ) -> tuple[Any, Optional[Any], Optional[Any], dict[str, Any]]:
  """Restores ``(params, opt_state, teacher, meta)`` onto the targets'
  shardings.

  ``abstract_*`` are pytrees of ``jax.ShapeDtypeStruct`` (with ``sharding``)
  or arrays, e.g. from ``jax.eval_shape``. Items a checkpoint lacks come back
  as None and the caller initialises them: the optimizer state of weights
  written by ``tools/import_pytorch.py``, and the EMA teacher (asked for with
  ``abstract_teacher``) of a checkpoint from an objective without one.
  """
  meta = mngr.restore(step, args=ocp.args.Composite(
      meta=ocp.args.JsonRestore()))['meta']
  items = {'params': ocp.args.StandardRestore(abstract_params)}
  if meta.get('has_opt_state', True):
    items['opt_state'] = ocp.args.StandardRestore(abstract_opt_state)
  if abstract_teacher is not None and meta.get('has_teacher', False):
    items['teacher'] = ocp.args.StandardRestore(abstract_teacher)
  out = mngr.restore(step, args=ocp.args.Composite(**items))
  return (out['params'], out.get('opt_state'), out.get('teacher'), meta)


def latest_step(workdir: str) -> Optional[int]:
  """The newest checkpointed step under ``workdir``, or None."""
  if not os.path.isdir(checkpoint_dir(workdir)):
    return None
  with manager(workdir, read_only=True) as mngr:
    return mngr.latest_step()


def load_params(workdir: str, step: Optional[int] = None,
                item: str = 'params') -> tuple[Any, dict[str, Any]]:
  """Parameters (host numpy/jax arrays) and meta of one checkpoint.

  No optimizer state is read. ``step`` defaults to the latest one; ``item``
  'teacher' reads an OTTER run's EMA teacher instead of the student. Raises
  ``FileNotFoundError`` with the path when there is no checkpoint (or no
  teacher in it).
  """
  if not os.path.isdir(checkpoint_dir(workdir)):
    raise FileNotFoundError(f'no checkpoints under {checkpoint_dir(workdir)}')
  with manager(workdir, read_only=True) as mngr:
    step = mngr.latest_step() if step is None else step
    if step is None or step not in mngr.all_steps():
      raise FileNotFoundError(
          f'no checkpoint for step {step} under {checkpoint_dir(workdir)}; '
          f'have {sorted(mngr.all_steps())}')
    meta = mngr.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))['meta']
    if item == 'teacher' and not meta.get('has_teacher', False):
      raise FileNotFoundError(f'checkpoint {step} under '
                              f'{checkpoint_dir(workdir)} has no EMA teacher')
    abstract = mngr.item_metadata(step)[item]
    # Restore onto the local default device whatever sharding it was saved
    # with, so a pod checkpoint opens on a laptop.
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
        abstract)
    params = mngr.restore(step, args=ocp.args.Composite(
        **{item: ocp.args.StandardRestore(target)}))[item]
  return params, meta
