"""What a run finds in its workdir before it trains: the stored run's
settings against this one (``config_drift``), checkpoints an earlier run
set aside, and the newest checkpoint restored (or a fresh state). Each
reads the workdir's ``StoredState``, read once per start
(``storage/stored_state.py``).

Every refusal here is one line and changes nothing on disk
(docs/config_and_resume.md).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp

from prolip_jax import errors
from prolip_jax.config import drift as config_drift
from prolip_jax.storage import checkpoint
from prolip_jax.storage import stored_state
from prolip_jax.storage.stored_state import StoredState
from prolip_jax.storage.workdir import Workdir
from prolip_jax.training import optimizer

# ``(step, meta)`` of a manager's newest checkpoint whose meta reads.
stored_config = stored_state.newest_meta


def check_drift(config, stored: StoredState, is_chief: bool):
  """Stops on settings that would change the model or the data of the run
  stored in the workdir (``stored.newest``); prints the other changes
  (they apply), and a note when the moving average a checkpoint holds is
  dropped (``optim.ema_decay`` turned off)."""
  if stored.newest is None:
    return
  step, meta = stored.newest
  old = meta.get('config') or {}
  new = json.loads(config.to_json_best_effort())
  if not meta.get('has_opt_state', True):
    # Imported weights (step 0): only the model has to match.
    old, new = {'model': old.get('model', {})}, {'model': new['model']}
  applied = config_drift.check(old, new, step)
  if applied and is_chief:
    print(f'Resuming step {step} with changed settings (applied): '
          + '; '.join(applied), flush=True)
  decay = (old.get('optim') or {}).get('ema_decay')
  if meta.get('has_teacher') and is_chief and not optimizer.keeps_ema(config):
    # Turned on, restore_or_init says it starts the average afresh; turned
    # off, the average is lost with the next checkpoints: say so too.
    keep = f'optim.ema_decay={decay}' if decay else 'optim.ema_decay > 0'
    print(f'note: the moving average of the parameters that checkpoint step '
          f'{step} holds (optim.ema_decay) is dropped: from now on the '
          'evaluators score, and exports hold, the parameters themselves, '
          f'and new checkpoints keep no average; resume with {keep} to keep '
          'it', flush=True)


def check_nothing_set_aside(workdir: Workdir, stored: StoredState,
                            allow_fresh_start: bool):
  """Refuses to train from step 0 over checkpoints that an earlier run set
  aside as unreadable (``checkpoints/`` empty or missing,
  ``checkpoints_unreadable/`` not): a week of training is not restarted
  without being asked to."""
  if allow_fresh_start or not stored.set_aside or stored.steps:
    return
  raise errors.CheckpointError(
      f'{workdir.checkpoints} has no checkpoint but {workdir.unreadable} '
      f'holds {list(stored.set_aside)}, set aside as unreadable; nothing '
      'was changed: restore a readable copy into checkpoints/, or pass '
      '--allow_fresh_start (train_and_evaluate(..., allow_fresh_start=True)) '
      'to train from step 0 anyway')


def mismatch_error(e: checkpoint.TreeMismatchError, config
                    ) -> errors.ConfigDriftError:
  """One line for a healthy checkpoint that does not fit the current
  config: the settings that differ from its stored config (or, when none
  do, the arrays), and what to do."""
  stored = (e.meta or {}).get('config') or {}
  requested = json.loads(config.to_json_best_effort())
  if not e.meta.get('has_opt_state', True):
    stored = {'model': stored.get('model', {})}
    requested = {'model': requested['model']}
  changes = config_drift.diff(stored, requested)
  fixed = {k: v for k, v in changes.items() if config_drift.is_fixed(k)}
  arrays = '; '.join(e.differences[:3]) + (
      f'; and {len(e.differences) - 3} more' if len(e.differences) > 3
      else '')
  if changes:
    why = ('settings that differ from the stored run: '
           + config_drift.describe_changes(fixed or changes)
           + f' (arrays: {arrays})')
  else:  # same settings: the code that builds the trees changed
    why = (f'its arrays differ ({arrays}) although the settings are the '
           'same (was it written by another prolip_jax version?)')
  return errors.ConfigDriftError(
      f'checkpoint step {e.step} at {e.path} is readable but does not fit the '
      f'current config: {why}; nothing was changed: resume with the stored '
      'settings or start a new --workdir')


def restore_or_init(mngr, stored: StoredState, config, init_state: Callable,
                    init_rng: jax.Array, abstract: Any, tx,
                    state_shardings: Any, with_ema: bool
                    ) -> tuple[int, Any, dict]:
  """``(start step, train state, its checkpoint's meta)``: the newest
  readable checkpoint of ``mngr`` restored into ``abstract``'s tree and
  shardings (``stored.newest``'s meta not read again), or
  ``init_state(init_rng)`` at step 0 (meta ``{}``). Imported weights (no
  optimizer state) get a fresh AdamW state; a checkpoint without the
  parameters' moving average that ``with_ema`` asks for (imported weights,
  or ``optim.ema_decay`` turned on at this resume) starts it from the
  restored parameters. A healthy checkpoint that does not fit the config
  raises ``ConfigDriftError`` (``mismatch_error``)."""
  try:
    restored = checkpoint.restore_newest(
        mngr, abstract.params, abstract.opt_state, abstract.ema,
        set_aside=True, known_meta=stored.newest)
  except checkpoint.TreeMismatchError as e:
    raise mismatch_error(e, config) from e
  if restored is None:
    return 0, init_state(init_rng), {}
  start, (params, opt_state, ema, meta) = restored
  if opt_state is None:  # imported weights: fine-tune with a fresh AdamW
    opt_state = jax.jit(tx.init, out_shardings=state_shardings.opt_state)(
        params)
    logging.warning('Checkpoint %d has no optimizer state (imported '
                    'weights): starting AdamW afresh', start)
  if with_ema and ema is None:  # imported weights, or EMA turned on
    ema = jax.jit(lambda p: p, out_shardings=state_shardings.params)(params)
    logging.warning('Checkpoint %d has no moving average of the parameters '
                    '(optim.ema_decay): starting it from the restored '
                    'parameters', start)
  logging.info('Resumed from step %d', start)
  # The counter on the sharding the train step outputs it with: a
  # ``jnp.asarray`` scalar is uncommitted, its aval without the mesh, and the
  # step would be traced and compiled once more at its second call.
  step = jax.device_put(jnp.asarray(start, jnp.int32), state_shardings.step)
  return start, abstract.replace(step=step, params=params,
                                 opt_state=opt_state, ema=ema), meta
