"""Exports a training checkpoint in the ProLIP release / open_clip format.

python tools/export_pytorch.py --workdir DIR [--step N] --out OUT \
    [--hub_compatible]

Writes ``OUT/model.safetensors`` (fp32 state dict, see
``prolip_jax/interop/convert/keys.py`` for the keys), ``OUT/config.json`` (the
release's schema plus a ``prolip_jax`` key with the exact model config,
tokenizer file, normalisation constants and step) and copies
``WORKDIR/tokenizer.model`` when present.
``prolip_jax.interop.torch_reference.load(OUT)`` runs it in PyTorch,
``prolip_jax.load(OUT)`` in JAX. The export is built in a folder beside
``OUT`` and swapped in whole (a re-export replaces ``OUT`` whole; a killed
export leaves the previous one); ``prolip_jax.json``/config.json record the
tokenizer's sha256, checked on load, and ``prolip_jax_manifest.json`` the
size and sha256 of every file. ``--workdir`` and ``--out`` may be
``gs://``/``s3://`` URLs: there, with no folder to swap, the old manifest is
removed first and the new one uploaded last
(``prolip_jax/interop/manifest.py``).

An export never deletes what it did not write: ``OUT`` must be missing,
empty, or an export of ours (every file in it listed by its manifest, or
by the pending record of an upload to an object store cut short);
anything else is refused before anything is written, naming the files that
are not ours. Errors are one line ``error: ...``, exit status 2.

``--hub_compatible`` leaves the ``prolip_jax`` key out of config.json, which
the release's ``ProLIPHF.from_pretrained`` needs (it passes every top-level
key to its constructor), and writes it to ``OUT/prolip_jax.json`` instead
(huggingface_hub's ``PyTorchModelHubMixin`` reads only config.json and
model.safetensors, so the directory can be pushed to the Hub unchanged and
``prolip_jax.load`` still finds the exact settings). A tokenizer.json
tokenizer (a fine-tuned release model) is copied as ``OUT/tokenizer.json``.
The release code computes the ``release_compat``
forward pass, so this is meant for models trained with
``model.release_compat=True``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any, Optional

from absl import app
from absl import flags
from absl import logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax.data.tokenizer import file_kind
from prolip_jax.data.tokenizer import file_sha256
from prolip_jax.data.tokenizer import HF_JSON
from prolip_jax.interop import convert
from prolip_jax.interop import manifest
from prolip_jax.storage import atomic
from prolip_jax.storage import checkpoint
from prolip_jax.storage import file_names
from prolip_jax.storage import owned
from prolip_jax.storage import paths
from prolip_jax.storage import store_faults
from prolip_jax.storage.file_names import CONFIG_FILE
from prolip_jax.storage.file_names import PROJECT_FILE
from prolip_jax.storage.file_names import WEIGHTS_FILE
from prolip_jax.storage.workdir import Workdir
# pylint: enable=g-import-not-at-top,wrong-import-position


def export(workdir: str, out: str, step: Optional[int] = None,
           hub_compatible: bool = False) -> dict[str, Any]:
  """Writes the export of ``workdir``'s checkpoint ``step`` (default latest)
  to ``out``; returns the config.json dict. An ``out`` holding anything that
  is not an export of ours is refused (``UserError``) before anything is
  written."""
  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file
  from prolip_jax.models.prolip import ModelConfig
  # pylint: enable=g-import-not-at-top

  params, meta = checkpoint.load_params(workdir, step, item='scored')
  run_cfg = meta.get('config') or {}
  objective = run_cfg.get('objective', 'prolip')
  if not objectives.get(objective).exportable:
    not_towers = sorted(
        set(params) - {'visual', 'text', 'logit_scale', 'logit_bias'})
    raise errors.ConfigError(
        f'a {objective!r} checkpoint scores through parameters the PyTorch '
        f'/ open_clip layout has no place for '
        f'({not_towers}'
        '); exporting the towers alone would give a model that scores '
        'differently. Use prolip_jax.load(workdir) in JAX instead.')
  model_cfg = ModelConfig.from_config(meta['model'])
  state_dict = convert.params_to_state_dict(params, model_cfg)
  extra = _run_settings(meta, run_cfg)
  wd = Workdir(workdir)
  tok_name = checkpoint.TOKENIZER_FILE
  checkpoint.check_tokenizer(
      meta, wd.tokenizer, f'checkpoint step {meta.get("step")} under '
      f'{wd.checkpoints}')
  tokenizer = paths.local_copy(wd.tokenizer) if wd.tokenizer.exists() \
      else None
  if tokenizer is not None:
    if file_kind(tokenizer) == HF_JSON:  # a tokenizer.json (fine-tuned release)
      tok_name = file_names.TOKENIZER_JSON
    extra['tokenizer_file'] = tok_name
    # The export's tokenizer is checked against this on load.
    extra[checkpoint.TOKENIZER_SHA256] = file_sha256(tokenizer)
    if meta.get(checkpoint.TOKENIZER_VOCAB):
      extra[checkpoint.TOKENIZER_VOCAB] = meta[checkpoint.TOKENIZER_VOCAB]
  cfg_json = convert.config_json(model_cfg, extra)
  project = None
  if hub_compatible:
    if not model_cfg.release_compat:
      print('warning: the model uses the paper forward pass '
            '(release_compat=False); the release code will compute the '
            'release forward pass with these weights', file=sys.stderr)
    project = cfg_json[convert.PROJECT_KEY]
    cfg_json = convert.hub_config(cfg_json)

  dest = paths.parse(out, '--out')
  _check_out(dest)

  def write_files(tmp):
    save_file(state_dict, os.path.join(tmp, WEIGHTS_FILE),
              metadata={'format': 'pt'})
    with open(os.path.join(tmp, CONFIG_FILE), 'w') as f:
      json.dump(cfg_json, f, indent=2)
    if project is not None:  # beside config.json: the mixin ignores it
      with open(os.path.join(tmp, PROJECT_FILE), 'w') as f:
        json.dump(project, f, indent=2)
    if tokenizer is not None:
      shutil.copyfile(tokenizer, os.path.join(tmp, tok_name))
    manifest.write(tmp)  # sizes and sha256 of every file, checked on load

  if paths.is_remote(dest):
    # No folder to swap on an object store: the old manifest goes first and
    # the new one is uploaded last, so load sees a whole export or refuses.
    with tempfile.TemporaryDirectory(prefix='prolip_jax-export-') as tmp, (
        store_faults.operation(
            f'writing the export to {dest}',
            'the checkpoint is not affected, and load refuses an export '
            'cut short (no manifest); run the export again')):
      write_files(tmp)
      old = _check_out(dest)  # again: the files may have changed meanwhile
      new = os.listdir(tmp)
      # Recorded first, removed last: an upload cut short stays ours.
      manifest.write_pending(dest, old + new)
      if (dest / manifest.MANIFEST_FILE).exists():
        (dest / manifest.MANIFEST_FILE).unlink()
      for name in old:  # the previous export's files the new one lacks
        if name not in new and name != manifest.PENDING_FILE:
          (dest / name).unlink()
      paths.upload_tree(tmp, dest, last=(manifest.MANIFEST_FILE,))
      (dest / manifest.PENDING_FILE).unlink()
    return cfg_json
  # Built beside ``out`` and swapped in whole: a killed export leaves the
  # previous export (or nothing), never new weights with an old config.
  with atomic.staging_dir(os.fspath(dest)) as tmp:
    write_files(tmp)
    _check_out(dest)  # again, just before the swap deletes the old files
    atomic.replace_dir(tmp, os.fspath(dest))
  return cfg_json


def _run_settings(meta: dict[str, Any], run_cfg: dict[str, Any]
                  ) -> dict[str, Any]:
  """What config.json's ``prolip_jax`` key records of the run beside the
  model: the step, the eval image transform (normalisation, view and
  channel order where not the default), the tokenizer's settings
  (``mask_id``, ``clean``, ``keep_eos`` where set) and, as ``run_config``,
  what evaluation reads of the run (its ``data.name``, ``evals`` and
  ``eval.tfds_data_dir``: ``evaluate --workdir EXPORT`` runs the run's
  evaluators)."""
  extra: dict[str, Any] = {'step': meta.get('step')}
  data = run_cfg.get('data') or {}
  for k in ('mean', 'std'):
    if k in data:
      extra[k] = list(data[k])
  if data.get('eval_view', 'default') != 'default':
    extra['image_view'] = data['eval_view']
  if data.get('eval_image_order', 'rgb_first') != 'rgb_first':
    extra['image_order'] = data['eval_image_order']
  tok_cfg = run_cfg.get('tokenizer') or {}
  mask_id = tok_cfg.get('mask_id', -1)
  if mask_id is not None and mask_id >= 0:
    extra['mask_id'] = mask_id
  if tok_cfg.get('clean', 'none') != 'none':
    extra['clean'] = tok_cfg['clean']
  if tok_cfg.get('keep_eos', False):
    extra['keep_eos'] = True
  # What evaluation reads of the run: its training set (the bundled
  # report of the digits or emoji) and its evaluators.
  extra['run_config'] = {
      'data': {'name': data.get('name', '')},
      'evals': dict(run_cfg.get('evals') or {}),
      'eval': {'tfds_data_dir':
               (run_cfg.get('eval') or {}).get('tfds_data_dir', '')}}
  return extra


def _check_out(out: paths.Path) -> list[str]:
  """What ``out`` holds ([] when missing or empty), all of it an export of
  ours; refuses a file, or a folder holding anything an export did not
  write (``manifest.foreign``), which replacing it would delete."""
  if out.is_file() or (not paths.is_remote(out)
                       and os.path.lexists(out) and not out.is_dir()):
    raise errors.UserError(f'--out {out} is a file, not a folder')
  foreign, why = manifest.foreign(out)
  if foreign:
    raise owned.refusal('--out', out, foreign, 'an export of ours', why)
  return manifest.entries(out)


def main(argv):
  """Command line entry; flags are defined in ``_define_flags``."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  logging.set_verbosity(logging.ERROR)
  f = flags.FLAGS

  def body():
    with store_faults.operation(f'exporting {f.workdir} to {f.out}'):
      export(f.workdir, f.out, f.step, f.hub_compatible)
    print(f'exported {f.workdir} to {f.out}: '
          f'{", ".join(sorted(p.name for p in paths.parse(f.out).iterdir()))}')

  return errors.cli_main(body)


def _define_flags():
  # Defined only when run as a script (no clashes when tests import this).
  flags.DEFINE_string('workdir', None, 'Training workdir.')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default latest).')
  flags.DEFINE_string('out', None, 'Output directory.')
  flags.DEFINE_bool('hub_compatible', False,
                    'Leave the prolip_jax key out of config.json.')
  flags.mark_flags_as_required(['workdir', 'out'])


if __name__ == '__main__':
  _define_flags()
  app.run(main)
