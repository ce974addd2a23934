"""Orbax checkpoints of a training run.

Layout: ``WORKDIR/checkpoints/<step>/`` holds three Orbax items:
``params`` (the model parameters), ``opt_state`` (optax state) and ``meta``
(JSON: the step, the full run config and the model config), so a single
checkpoint directory is enough to rebuild the model. Runs that keep a moving
average of the parameters (``optim.ema_decay``; OTTER's teacher) add a fourth
item, ``teacher`` (parameters like ``params``; its name from when OTTER's
teacher was its only use, kept so that older checkpoints read).
The sentencepiece model a run uses is copied to ``WORKDIR/tokenizer.model``;
each checkpoint's meta records its sha256 and vocabulary size
(``tokenizer_meta``), and resuming, loading, evaluating or exporting with
another file is refused (``check_tokenizer``).

Integrity: ``meta`` carries a checksum of every array item, computed on the
device before the write and checked after every restore, so garbled bytes are
caught even where the storage layer reads them without complaint. A
checkpoint with non-finite parameters is never written. ``restore_newest``
and ``load_params`` fall back from an unreadable step to the newest one that
restores, saying so in one line.

Unreadable means unreadable on the checkpoint's own terms: before restoring,
the arrays the checkpoint's metadata lists (tree paths, shapes, dtypes) are
compared with what the current config expects. A difference is not damage
but another config (``TreeMismatchError``): nothing is restored, moved or
set aside, and the caller names the settings that differ.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from typing import Any, Callable, Optional

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import orbax.checkpoint as ocp

from prolip_jax import errors
from prolip_jax.storage import file_names
from prolip_jax.storage import paths
from prolip_jax.storage import store_faults
from prolip_jax.storage import workdir as workdir_lib
from prolip_jax.storage.workdir import Workdir

CHECKPOINT_DIR = workdir_lib.CHECKPOINT_DIR
UNREADABLE_DIR = workdir_lib.UNREADABLE_DIR
TOKENIZER_FILE = file_names.TOKENIZER_MODEL  # the workdir's tokenizer
ARRAY_ITEMS = ('params', 'opt_state', 'teacher')
# The meta key naming the parameter tree to score: 'params', or 'teacher'
# when the run's moving average (optim.ema_decay) is its evaluated model.
# ``load_params(item='scored')`` reads that one (older checkpoints: params).
SCORED = 'scored_item'


class ChecksumError(ValueError):
  """A restored item's bytes differ from what was saved."""


class TreeMismatchError(ValueError):
  """A checkpoint's arrays (as its own metadata lists them) do not fit the
  requested targets: the current config expects another parameter or
  optimizer-state tree. The checkpoint is not damaged.

  ``step``, ``path``, ``meta`` (the checkpoint's meta item) and
  ``differences`` (one line per differing array) say where and what.
  """

  def __init__(self, step: int, path: str, meta: dict[str, Any],
               differences: list[str]):
    self.step, self.path, self.meta = step, path, meta
    self.differences = differences
    shown = '; '.join(differences[:4]) + (
        f'; and {len(differences) - 4} more' if len(differences) > 4 else '')
    super().__init__(f'checkpoint step {step} at {path} does not fit the '
                     f'current config: {shown}')


def checkpoint_dir(workdir) -> str:
  """``WORKDIR/checkpoints`` as text (absolute, or a ``gs://``/``s3://``
  URL)."""
  return str(Workdir.of(workdir).checkpoints)


class _Manager(ocp.CheckpointManager):
  """Orbax's manager, minus its own look at JAX's preemption sync point.

  Orbax asks ``multihost_utils.reached_preemption_sync_point(step)`` when a
  save starts and again in its background finalize thread, passing the
  checkpoint's step. That call sets the sync manager's "current call
  counter", which the training loop's ``progress.StopFlag`` owns (it passes
  its own count after every step). A finalize thread setting it back to an
  older checkpoint's step, just as a preemption notice arrives, makes the
  hosts agree on a sync point one of them has already passed: that host
  trains on while the others stop and wait for it in the checkpoint's
  barrier. The loop decides every save itself (``force=True`` at a stop),
  so Orbax never needs the answer.
  """

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


def manager(workdir, max_to_keep: Optional[int] = 3,
            save_interval_steps: int = 1, read_only: bool = False,
            create: bool = True) -> ocp.CheckpointManager:
  """A CheckpointManager over ``WORKDIR/checkpoints`` with our three items
  (``UserError`` for a store Orbax cannot write: ``s3://``). Opening it
  lists the checkpointed steps. ``create=False``: the folder is not made
  here (``create_directory`` makes it before the first save)."""
  Workdir.of(workdir).check_checkpoint_store()
  store_faults.configure_retries()  # TensorStore's, bounded (docs)
  if read_only:  # opens without creating or deleting anything
    options = ocp.CheckpointManagerOptions(create=False)
  else:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
        create=create)
  # Handlers for every item, so that restoring some of them does not warn
  # about the others.
  handlers = {name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS}
  handlers['meta'] = ocp.JsonCheckpointHandler()
  return _Manager(Workdir.of(workdir).checkpoints, options=options,
                  item_handlers=handlers)


def create_directory(mngr: ocp.CheckpointManager):
  """Makes ``mngr``'s folder as Orbax does when it opens a manager with
  ``create=True``: process 0 makes it, the others wait. A run opens its
  manager with ``create=False`` before its checks and calls this once they
  passed: a refused run leaves no folder."""
  directory = paths.as_path(mngr.directory)
  if jax.process_index() == 0 and not directory.exists():
    directory.mkdir(parents=True, exist_ok=True)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('prolip_jax checkpoints folder')


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """uint32 position-weighted sum of the bits of ``x``; exact and the same
  however ``x`` is sharded (modular sums do not depend on order)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[
        x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
  bits = bits.reshape(-1)
  # Odd weights: changing any one element always changes the sum.
  weights = jnp.arange(bits.size, dtype=jnp.uint32) * 2 + 1
  return jnp.sum(bits * weights * jnp.uint32(2654435761), dtype=jnp.uint32)


@jax.jit
def _tree_checksums_and_finite(tree: Any) -> tuple[Any, jax.Array]:
  sums = jax.tree.map(_leaf_checksum, tree)
  finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return sums, jnp.all(jnp.stack(finite)) if finite else jnp.asarray(True)


def checksum(tree: Any) -> tuple[str, bool]:
  """``(hex digest, all floating leaves finite)`` of a pytree of arrays."""
  sums, finite = jax.device_get(_tree_checksums_and_finite(tree))
  digest = hashlib.sha256()
  for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]:
    digest.update(f'{jax.tree_util.keystr(path)}={int(value)};'.encode())
  return digest.hexdigest()[:32], bool(finite)


def verify(items: dict[str, Any], meta: dict[str, Any]):
  """Raises ``ChecksumError`` if a restored item differs from the saved one
  (checkpoints written before checksums existed are not checked)."""
  saved = meta.get('checksums') or {}
  for name, tree in items.items():
    if tree is None or name not in saved:
      continue
    if checksum(tree)[0] != saved[name]:
      raise ChecksumError(f'{name} checksum differs from the one saved '
                          '(corrupted bytes)')


def save(mngr: ocp.CheckpointManager, step: int, params: Any, opt_state: Any,
         meta: dict[str, Any], force: bool = False,
         teacher: Optional[Any] = None) -> bool:
  """Saves (asynchronously) one checkpoint; returns whether it was written.

  ``teacher``: the moving average of the parameters (``optim.ema_decay``;
  OTTER's teacher), saved as its own item.
  Parameters with a NaN or infinity are not written (a warning says so):
  a checkpoint is a model worth resuming from.
  """
  trees = dict(params=params, opt_state=opt_state)
  if teacher is not None:
    trees['teacher'] = teacher
  sums = {}
  for name, tree in trees.items():
    sums[name], finite = checksum(tree)
    if not finite and name != 'opt_state':
      print(f'warning: step {step}: {name} are not finite; checkpoint not '
            'written', file=sys.stderr, flush=True)
      return False
  items = {k: ocp.args.StandardSave(v) for k, v in trees.items()}
  meta = dict(meta, has_teacher=teacher is not None, checksums=sums)
  return mngr.save(step, args=ocp.args.Composite(
      meta=ocp.args.JsonSave(meta), **items), force=force)


TOKENIZER_SHA256 = 'tokenizer_sha256'
TOKENIZER_VOCAB = 'tokenizer_vocab_size'


def tokenizer_meta(tokenizer: Any) -> dict[str, Any]:
  """The meta (and export config) entries that tie a model to its tokenizer
  (a ``data.tokenizer.Tokenizer``): the file's sha256 and vocabulary size."""
  return {TOKENIZER_SHA256: tokenizer.sha256,
          TOKENIZER_VOCAB: int(tokenizer.vocab_size)}


def check_tokenizer(meta: dict[str, Any], tokenizer_path: str, owner: str,
                    sha256: Optional[str] = None):
  """Raises ``errors.TokenizerError`` (one line) when the tokenizer file at
  ``tokenizer_path`` is not the one ``meta`` (of ``owner``: a checkpoint or
  export, named in the message) was trained with; a missing file when meta
  names one is refused too. Meta written before tokenizer hashes existed is
  not checked. ``sha256``: the file's hash when already computed."""
  want = meta.get(TOKENIZER_SHA256)
  if not want:
    return
  if not paths.as_path(tokenizer_path).is_file():
    raise errors.TokenizerError(
        f'{owner} was trained with the tokenizer of sha256 {want[:16]}... '
        f'({meta.get(TOKENIZER_VOCAB)} pieces) but {tokenizer_path} is '
        'missing: put that tokenizer file back there')
  if sha256 is None:
    sha256 = paths.sha256(tokenizer_path)
  if sha256 != want:
    raise errors.TokenizerError(
        f'tokenizer {tokenizer_path} (sha256 {sha256[:16]}...) is not the one '
        f'{owner} was trained with (sha256 {want[:16]}..., '
        f'{meta.get(TOKENIZER_VOCAB)} pieces): put that tokenizer file back '
        '(token ids would differ), or use a new workdir for a new tokenizer')


def write_imported(workdir, params: Any, config: dict[str, Any],
                   model: dict[str, Any], source: str,
                   tokenizer: Optional[dict[str, Any]] = None,
                   mngr: Optional[ocp.CheckpointManager] = None):
  """Writes imported weights as step 0 of ``workdir``, without optimizer
  state (training starts AdamW afresh from them; Orbax refuses an empty
  item, so the checkpoint holds only ``params`` and ``meta``).

  ``config``/``model``: the run and model configs as dicts; ``source``: where
  the weights came from (a file, a snapshot, ``hf-hub:...``); ``tokenizer``:
  ``tokenizer_meta`` of the tokenizer imported with them, if any; ``mngr``:
  the manager to write with (a run's, left open), one of its own when None.
  """
  meta = {'step': 0, 'config': config, 'model': model,
          'has_opt_state': False, 'imported_from': source,
          'checksums': {'params': checksum(params)[0]}, **(tokenizer or {})}
  Workdir.of(workdir).create()
  with (contextlib.nullcontext(mngr) if mngr is not None
        else manager(workdir)) as writer:
    # A run's manager opens with create=False (create_directory).
    paths.as_path(writer.directory).mkdir(parents=True, exist_ok=True)
    writer.save(0, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        meta=ocp.args.JsonSave(meta)), force=True)
    writer.wait_until_finished()


def _path_text(path) -> str:
  # Orbax stores namedtuples (optax states) as dicts/lists: compare paths by
  # their names and indices whatever the node types.
  parts = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '.'.join(parts)


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_path_text(p): (tuple(x.shape), str(jnp.dtype(x.dtype)))
          for p, x in leaves}


def tree_differences(saved: Any, target: Any, item: str) -> list[str]:
  """Lines naming every array of ``item`` whose path, shape or dtype differs
  between the checkpoint's metadata ``saved`` and the abstract ``target``."""
  a, b = _shapes(saved), _shapes(target)
  out = []
  for path in sorted(set(a) | set(b)):
    name = f'{item}.{path}' if path else item
    if path not in b:
      out.append(f'{name} {a[path][0]} is only in the checkpoint')
    elif path not in a:
      out.append(f'{name} {b[path][0]} is only in the current config')
    elif a[path] != b[path]:
      out.append(f'{name}: saved {a[path][0]} {a[path][1]}, the current '
                 f'config has {b[path][0]} {b[path][1]}')
  return out


def restore(mngr: ocp.CheckpointManager, step: int, abstract_params: Any,
            abstract_opt_state: Any, abstract_teacher: Optional[Any] = None,
            meta: Optional[dict[str, Any]] = None
            ) -> tuple[Any, Optional[Any], Optional[Any], dict[str, Any]]:
  """Restores ``(params, opt_state, teacher, meta)`` onto the targets'
  shardings.

  ``abstract_*`` are pytrees of ``jax.ShapeDtypeStruct`` (with ``sharding``)
  or arrays, e.g. from ``jax.eval_shape``. Items a checkpoint lacks come back
  as None and the caller initialises them: the optimizer state of weights
  written by ``tools/import_pytorch.py``, and the EMA teacher (asked for with
  ``abstract_teacher``) of a checkpoint from an objective without one.

  Raises ``TreeMismatchError`` (before reading any array) when the
  checkpoint's metadata lists other arrays than the targets; any other
  failure means the checkpoint itself is damaged. ``meta``: the step's
  meta item when the caller has read it (read here when None).
  """
  if meta is None:
    meta = read_meta(mngr, step)
  targets = {'params': abstract_params}
  if meta.get('has_opt_state', True):
    targets['opt_state'] = abstract_opt_state
  if abstract_teacher is not None and meta.get('has_teacher', False):
    targets['teacher'] = abstract_teacher
  saved = mngr.item_metadata(step)
  for name in targets:
    if saved[name] is None or not jax.tree.leaves(saved[name]):
      # No array listed at all is a damaged checkpoint, not another config.
      raise ValueError(f'the metadata of item {name!r} lists no arrays')
  differences = [line for name, target in targets.items()
                 for line in tree_differences(saved[name], target, name)]
  if differences:
    raise TreeMismatchError(step, paths.join(mngr.directory, str(step)),
                            meta, differences)
  items = {k: ocp.args.StandardRestore(v) for k, v in targets.items()}
  out = mngr.restore(step, args=ocp.args.Composite(**items))
  verify({k: out.get(k) for k in ARRAY_ITEMS}, meta)
  return (out['params'], out.get('opt_state'), out.get('teacher'), meta)


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict[str, Any]:
  """The ``meta`` item (step, run config, model config) of one step."""
  return mngr.restore(step, args=ocp.args.Composite(
      meta=ocp.args.JsonRestore()))['meta']


def _reason(e: BaseException) -> str:
  while e.__cause__ is not None:  # the storage layer's own words
    e = e.__cause__
  text = ' '.join(str(e).split()) or type(e).__name__
  return f'{type(e).__name__}: {text[:200]}'


def _is_failed_read_echo(exc: Optional[BaseException]) -> bool:
  return (isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed'
          ) or str(exc).startswith('Encountered error while reading array')


class _FailedReadEchoFilter(logging.Filter):

  def filter(self, record):
    exc = record.exc_info[1] if record.exc_info else None
    return not _is_failed_read_echo(exc)


def _quiet_failed_read_echoes():
  """When one array of a checkpoint fails to read, TensorStore's other
  pending reads fail after Orbax has given up, and Python prints a traceback
  for each (thousands of lines repeating the one reason we report); drop
  exactly those."""
  previous = sys.unraisablehook
  if getattr(previous, 'prolip_quiet', False):
    return

  def hook(unraisable):
    if not _is_failed_read_echo(unraisable.exc_value):
      previous(unraisable)

  hook.prolip_quiet = True
  sys.unraisablehook = hook
  logging.getLogger('asyncio').addFilter(_FailedReadEchoFilter())


def _removed_error(mngr: ocp.CheckpointManager, step: int
                   ) -> errors.CheckpointError:
  return errors.CheckpointError(
      f'checkpoint step {step} under {mngr.directory} was removed while it '
      'was being read (by a run still training there, which keeps fewer '
      'checkpoints); it is not damaged: try again')


def _was_removed(mngr: ocp.CheckpointManager, step: int) -> bool:
  """A step whose folder is gone since it was listed: rotated away by a
  run still training there (``keep_checkpoints``), not damaged."""
  return not paths.as_path(mngr.directory).joinpath(str(step)).exists()


def _newest_readable(mngr: ocp.CheckpointManager, read: Callable[[int], Any],
                     what: str, on_unreadable: Optional[Callable] = None):
  """``(step, read(step))`` for the newest step ``read`` succeeds on.

  Each unreadable step is reported in one line on stderr (step, path,
  reason) and handed to ``on_unreadable(step)``; raises ``CheckpointError``
  when no step reads. A step that disappears while it is read (a run still
  training there rotated it away) is no damage: the steps are listed again
  and the newest read, once; a second such removal is a ``CheckpointError``
  saying to try again. A ``TreeMismatchError`` (the step is healthy but
  does not fit the caller's targets) stops the search untouched.
  """
  _quiet_failed_read_echoes()
  tried: set[int] = set()
  removed = 0
  first_failure = None
  while True:
    steps = [s for s in sorted(mngr.all_steps(), reverse=True)
             if s not in tried]
    if not steps:
      break
    step = steps[0]
    tried.add(step)
    try:
      return step, read(step)
    except TreeMismatchError:
      raise  # a healthy checkpoint of another config: not ours to set aside
    except Exception as e:  # pylint: disable=broad-except
      if _was_removed(mngr, step):
        removed += 1
        if removed > 1:
          raise _removed_error(mngr, step) from e
        mngr.reload()
        newest = max(set(mngr.all_steps()) - tried, default=None)
        print(f'note: checkpoint step {step} under {mngr.directory} was '
              'removed while it was being read (by the run still training '
              'there); ' + (f'reading the newest, step {newest}'
                            if newest is not None else 'no other step'),
              file=sys.stderr, flush=True)
        if newest is None:
          raise _removed_error(mngr, step) from e
        continue
      # Any failure to read one step (truncated file, bad checksum, missing
      # item) sends us to the previous step; the message says why.
      path = paths.join(mngr.directory, str(step))
      first_failure = first_failure or f'step {step} ({path}): {_reason(e)}'
      older = (f'trying step {steps[1]}' if len(steps) > 1
               else 'no older step')
      if on_unreadable is not None:
        note = on_unreadable(step)
        older = f'{note}; {older}' if note else older
      print(f'warning: checkpoint step {step} at {path} cannot be read '
            f'({_reason(e)}); {older}', file=sys.stderr, flush=True)
  raise errors.CheckpointError(
      f'no readable {what} under {mngr.directory}; newest failure: '
      f'{first_failure}')


def restore_newest(mngr: ocp.CheckpointManager, abstract_params: Any,
                   abstract_opt_state: Any,
                   abstract_teacher: Optional[Any] = None,
                   set_aside: bool = False,
                   known_meta: Optional[tuple[int, dict[str, Any]]] = None):
  """``(step, (params, opt_state, teacher, meta))`` of the newest step that
  restores and matches its checksums, or None without checkpoints.

  ``set_aside``: move each unreadable step to ``WORKDIR/checkpoints_
  unreadable/<step>`` (nothing is deleted), so that training can write that
  step again. A step that reads but does not fit the targets raises
  ``TreeMismatchError`` and nothing is moved. ``known_meta``: ``(step,
  meta)`` already read (``StoredState.newest``): that step's meta is not
  read again.
  """
  if not mngr.all_steps():
    return None

  def move(step):
    if not set_aside or jax.process_index() != 0:
      return ''
    return f'moved to {set_step_aside(mngr.directory, step)}'

  known_step, meta = known_meta or (None, None)
  found = _newest_readable(
      mngr, lambda step: restore(mngr, step, abstract_params,
                                 abstract_opt_state, abstract_teacher,
                                 meta if step == known_step else None),
      'checkpoint', move)
  if set_aside:
    mngr.reload()
  return found


def set_step_aside(directory, step: int) -> str:
  """Moves ``directory/<step>`` to ``checkpoints_unreadable/<step>`` beside
  ``directory`` (``_`` appended while taken); returns the new path. On an
  object store the move is a copy of every object, then a delete: a kill in
  between leaves both copies, never neither."""
  src = paths.as_path(paths.join(directory, str(step)))
  dst_dir = src.parent.parent / UNREADABLE_DIR
  if not paths.is_remote(dst_dir):
    dst_dir.mkdir(parents=True, exist_ok=True)
  dst = dst_dir / str(step)
  while dst.exists():
    dst = dst_dir / (dst.name + '_')
  if paths.is_remote(src):
    paths.copy_tree(src, dst)
    src.rmtree()
  else:
    src.rename(dst)
  return str(dst)


def latest_step(workdir) -> Optional[int]:
  """The newest checkpointed step under ``workdir``, or None."""
  if not Workdir.of(workdir).has_checkpoints():
    return None
  with manager(workdir, read_only=True) as mngr:
    return mngr.latest_step()


def load_params(workdir, step: Optional[int] = None,
                item: str = 'params') -> tuple[Any, dict[str, Any]]:
  """Parameters (host numpy/jax arrays) and meta of one checkpoint.

  No optimizer state is read. ``step`` defaults to the newest step that
  reads (an unreadable newer one is reported and skipped); ``item``
  'teacher' reads the run's moving average of the parameters
  (``optim.ema_decay``; OTTER's teacher) instead of the parameters,
  'scored' whichever of the two the run evaluated (``SCORED``). Raises
  ``FileNotFoundError`` with the path when there is no checkpoint (or no
  moving average in it).
  """
  if not Workdir.of(workdir).has_checkpoints():
    raise FileNotFoundError(f'no checkpoints under {checkpoint_dir(workdir)}')
  with manager(workdir, read_only=True) as mngr:
    if step is not None and step not in mngr.all_steps():
      raise FileNotFoundError(
          f'no checkpoint for step {step} under {checkpoint_dir(workdir)}; '
          f'have {sorted(mngr.all_steps())}')
    if not mngr.all_steps():
      raise FileNotFoundError(f'no checkpoints under '
                              f'{checkpoint_dir(workdir)}')

    def read(step):
      meta = read_meta(mngr, step)
      name = meta.get(SCORED, 'params') if item == 'scored' else item
      if name == 'teacher' and not meta.get('has_teacher', False):
        raise FileNotFoundError(f'checkpoint {step} under '
                                f'{checkpoint_dir(workdir)} has no moving '
                                'average of the parameters (optim.ema_decay)')
      abstract = mngr.item_metadata(step)[name]
      # Restore onto the local default device whatever sharding it was saved
      # with, so a pod checkpoint opens on a laptop.
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      target = jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
          abstract)
      params = mngr.restore(step, args=ocp.args.Composite(
          **{name: ocp.args.StandardRestore(target)}))[name]
      verify({name: params}, meta)
      return params, meta

    if step is not None:
      try:
        return read(step)
      except Exception as e:  # pylint: disable=broad-except
        if _was_removed(mngr, step):
          raise _removed_error(mngr, step) from e
        raise
    if item == 'teacher':  # a missing teacher is not a damaged checkpoint
      return read(mngr.latest_step())
    return _newest_readable(mngr, read, 'checkpoint')[1]
