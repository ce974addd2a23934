"""Imports PyTorch weights (ProLIP release, open_clip) as a step-0 checkpoint.

python tools/import_pytorch.py --src model.safetensors|.bin|.pt \
    --config configs/X.py --workdir DIR [--tokenizer spm.model] \
    [--config.model.key=value ...]

Reads the state dict (safetensors; ``.bin``/``.pt``/``.pth`` through
``torch.load(weights_only=True)``, also open_clip training checkpoints with a
``state_dict`` entry and DDP's ``module.`` prefix), converts it to the
parameters of the config's model (``ModelConfig.from_config(config.model)``)
with ``prolip_jax.interop.convert.state_dict_to_params``, prints the report
(tensors created from init, dropped, reshaped, cast) and writes an Orbax
checkpoint at step 0 in ``DIR/checkpoints`` with the items ``params`` and
``meta`` = ``{'step': 0, 'config': ..., 'model': ..., 'has_opt_state': False,
'imported_from': ...}`` and NO ``opt_state`` item (Orbax cannot save an
empty one): training from this workdir must initialise a fresh optimizer when
the checkpoint has no ``opt_state`` (``'opt_state' not in
mngr.item_metadata(step)``, or ``meta['has_opt_state'] is False``).
``--tokenizer`` copies a sentencepiece model to ``DIR/tokenizer.model``.

Nothing is written when reading or converting fails (missing, unexpected or
mis-shaped tensors are all listed in one error), when ``--src`` lies in an
export whose ``prolip_jax_manifest.json`` gives it (or the ``--tokenizer``
beside it) another size or sha256, or when ``DIR`` already holds a run
(checkpoints, ``metrics.jsonl``, ...). An import never deletes or replaces
what it did not write: other files in ``DIR`` stay, and a
``DIR/tokenizer.model`` that differs from ``--tokenizer`` is refused. The
checkpoint and tokenizer are built beside ``DIR`` and moved in together
(``checkpoints/`` last), so a killed import leaves nothing a re-import
refuses; the checkpoint's meta records the tokenizer's sha256. User errors
are one line ``error: ...``, exit status 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Optional

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from prolip_jax import errors
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.interop import convert
from prolip_jax.interop import manifest
from prolip_jax.storage import atomic
from prolip_jax.storage import checkpoint
from prolip_jax.storage import paths
from prolip_jax.storage import workdir as workdir_lib
from prolip_jax.storage.workdir import Workdir
# pylint: enable=g-import-not-at-top,wrong-import-position

TORCH_SUFFIXES = ('.bin', '.pt', '.pth')
# What a run writes in its workdir: an import beside any of them would mix
# with (or replace) a run it did not write.
RUN_FILES = (workdir_lib.CHECKPOINT_DIR, workdir_lib.UNREADABLE_DIR,
             workdir_lib.METRICS_FILE, workdir_lib.LOCK_FILE,
             workdir_lib.TENSORBOARD_DIR, workdir_lib.EVALS_DIR)


class ImportFailed(errors.UserError, ValueError):
  """A user-facing import failure (bad file, wrong architecture, ...)."""


def read_state_dict(path: str) -> dict[str, Any]:
  """numpy state dict of a safetensors or torch file."""
  if not os.path.isfile(path):
    raise ImportFailed(f'no such file: {path}')
  if path.endswith('.safetensors'):
    try:
      try:
        import torch  # pylint: disable=g-import-not-at-top,unused-import
        from safetensors.torch import load_file  # pylint: disable=g-import-not-at-top
      except ImportError:  # numpy only (no bfloat16 files)
        from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
      sd = load_file(path)
    except Exception as e:  # pylint: disable=broad-except
      raise ImportFailed(f'cannot read safetensors file {path}: '
                         f'{type(e).__name__}: {e}') from e
  elif path.endswith(TORCH_SUFFIXES):
    import torch  # pylint: disable=g-import-not-at-top
    try:
      sd = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # pylint: disable=broad-except
      raise ImportFailed(f'cannot read torch file {path}: '
                         f'{type(e).__name__}: {e}') from e
    if isinstance(sd, dict) and isinstance(sd.get('state_dict'), dict):
      sd = sd['state_dict']  # open_clip training checkpoint
    if not isinstance(sd, dict) or not all(
        isinstance(v, torch.Tensor) for v in sd.values()):
      raise ImportFailed(f'{path} does not hold a state dict of tensors')
  else:
    raise ImportFailed(f'unsupported file type {path!r}: use .safetensors, '
                       f'{", ".join(TORCH_SUFFIXES)}')
  return {k: convert.to_numpy(v) for k, v in sd.items()}


def import_weights(src: str, config, workdir: str,
                   tokenizer: Optional[str] = None, rng_seed: int = 0
                   ) -> convert.ConversionReport:
  """Converts ``src`` for ``config.model`` and writes ``workdir``'s step 0.

  Raises ImportFailed (a ValueError) before writing anything when the file
  cannot be read or converted, or ``workdir`` already holds checkpoints.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from prolip_jax.models.prolip import ModelConfig  # pylint: disable=g-import-not-at-top

  try:
    model_cfg = ModelConfig.from_config(config.model)
  except (ValueError, TypeError) as e:
    raise ImportFailed(f'invalid config.model: {e}') from e
  wd = Workdir(workdir)
  wd.check_checkpoint_store()
  workdir = str(wd)
  if not wd.remote and os.path.lexists(workdir) and not os.path.isdir(
      workdir):
    raise ImportFailed(f'--workdir {workdir} is a file, not a folder')
  if checkpoint.latest_step(workdir) is not None:
    raise ImportFailed(f'{checkpoint.checkpoint_dir(workdir)} already has '
                       'checkpoints; import into an empty workdir')
  run = _run_files(wd)
  if run:
    raise ImportFailed(f'--workdir {workdir} already holds a run '
                       f'({", ".join(run)}); import into a new or empty '
                       'workdir')
  tok_meta = None
  if tokenizer:
    if not os.path.isfile(tokenizer):
      raise ImportFailed(f'no such tokenizer file: {tokenizer}')
  _verify_export(src, tokenizer)
  if tokenizer:
    _check_tokenizer_target(wd, tokenizer)
    # Explicit ids: only the file's readability and identity matter here.
    tok_meta = checkpoint.tokenizer_meta(
        Tokenizer(tokenizer, 1, pad_id=0, mask_id=0))
  state_dict = read_state_dict(src)
  try:
    params, report = convert.state_dict_to_params(
        state_dict, model_cfg, jax.random.PRNGKey(rng_seed))
  except ValueError as e:
    raise ImportFailed(f'{src}: {e}') from e

  if wd.remote:
    # No folders to move on an object store: the tokenizer first, then the
    # checkpoint, which Orbax's commit marker makes whole; a kill in between
    # leaves no checkpoint, and a re-import proceeds.
    if tokenizer:
      paths.copy_file(tokenizer, wd.tokenizer)
    checkpoint.write_imported(wd, params,
                              json.loads(config.to_json_best_effort()),
                              model_cfg.to_dict(), os.path.abspath(src),
                              tokenizer=tok_meta)
    return report
  # Built beside the workdir and moved in last, so a killed import leaves
  # nothing half written (the checkpoint's meta names its tokenizer).
  with atomic.staging_dir(workdir) as tmp:
    checkpoint.write_imported(tmp, params,
                              json.loads(config.to_json_best_effort()),
                              model_cfg.to_dict(), os.path.abspath(src),
                              tokenizer=tok_meta)
    if tokenizer:
      shutil.copyfile(tokenizer, os.path.join(tmp, checkpoint.TOKENIZER_FILE))
    _move_into(tmp, workdir)
  return report


def _run_files(wd: Workdir) -> list[str]:
  """The files and folders of a run (``RUN_FILES``) in ``wd``; an empty
  ``checkpoints/`` folder holds nothing to lose and does not count."""
  found = []
  for name in RUN_FILES:
    path = wd.root / name
    if not path.exists():
      continue
    if (name == workdir_lib.CHECKPOINT_DIR and not wd.remote
        and path.is_dir() and not any(True for _ in path.iterdir())):
      continue
    found.append(name + ('/' if path.is_dir() else ''))
  return found


def _verify_export(src: str, tokenizer: Optional[str]):
  """Checks ``src`` (and ``tokenizer``, when it lies beside it) against the
  manifest of the export holding them, if there is one: damaged or replaced
  bytes are refused before they become a checkpoint."""
  folder = os.path.dirname(os.path.abspath(src))
  try:
    listed = manifest.read(folder)
    if listed is None:
      return
    names = [os.path.basename(src)]
    if tokenizer and os.path.dirname(os.path.abspath(tokenizer)) == folder:
      names.append(os.path.basename(tokenizer))
    manifest.verify(folder, listed, f'the export {folder}', names)
  except manifest.ExportIncompleteError as e:
    raise ImportFailed(str(e)) from e


def _check_tokenizer_target(wd: Workdir, tokenizer: str):
  """Refuses to replace a ``tokenizer.model`` already in the workdir with
  another file (the same bytes are no loss: a re-import after a kill)."""
  if not wd.tokenizer.exists():
    return
  have, want = paths.sha256(wd.tokenizer), paths.sha256(tokenizer)
  if have != want:
    raise ImportFailed(
        f'{wd.tokenizer} already exists and is not --tokenizer {tokenizer} '
        f'(sha256 {have[:16]}... vs {want[:16]}...); an import never '
        'replaces what it did not write: move it away or import into a new '
        'or empty workdir')


def _move_into(staged: str, workdir: str):
  """Moves a staged import (``checkpoints/``, ``tokenizer.model``) into
  ``workdir``: the whole folder in one rename when ``workdir`` is new or
  empty; else the tokenizer first and ``checkpoints/`` last (one rename), so
  a workdir with checkpoints always has their tokenizer, and a re-import
  after a kill in between finds no checkpoints and proceeds. All it
  replaces in ``workdir`` is an empty ``checkpoints/`` folder; a
  ``tokenizer.model`` already there (the same bytes: checked before) is
  left as it is."""
  if not os.path.isdir(workdir) or not os.listdir(workdir):
    atomic.replace_dir(staged, workdir)
    return
  atomic.fix_modes(staged)
  tok = os.path.join(staged, checkpoint.TOKENIZER_FILE)
  target = os.path.join(workdir, checkpoint.TOKENIZER_FILE)
  if os.path.exists(tok) and not os.path.exists(target):
    os.rename(tok, target)
  os.replace(os.path.join(staged, checkpoint.CHECKPOINT_DIR),
             checkpoint.checkpoint_dir(workdir))


def main(argv):
  """Command line entry; flags are defined in ``_define_flags``."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  logging.set_verbosity(logging.ERROR)
  f = flags.FLAGS
  config = f.config

  def body():
    try:
      report = import_weights(f.src, config, f.workdir, f.tokenizer,
                              config.get('seed', 0))
    except ImportFailed as e:
      raise ImportFailed(f'{e}; nothing was written') from e
    print(report.format())
    print(f'wrote step 0 to {checkpoint.checkpoint_dir(f.workdir)} '
          '(params and meta; no optimizer state)')

  return errors.cli_main(body)


def _define_flags():
  # Defined only when run as a script, so importing this module (tests)
  # does not clash with other modules' absl flags.
  config_flags.DEFINE_config_file(
      'config', None, 'Config file whose `model` the weights are converted to.')
  flags.DEFINE_string('src', None, 'model.safetensors, .bin or .pt file.')
  flags.DEFINE_string('workdir', None, 'Workdir to create.')
  flags.DEFINE_string('tokenizer', None, 'Optional sentencepiece model to '
                      'copy to WORKDIR/tokenizer.model.')
  flags.mark_flags_as_required(['config', 'src', 'workdir'])


if __name__ == '__main__':
  _define_flags()
  app.run(main)
