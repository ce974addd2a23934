"""Hugging Face snapshots: the ProLIP release's weights, and exports of ours.

A snapshot is a directory with ``config.json`` (the release schema, see
``convert.config_json``) and ``model.safetensors`` (the release / open_clip
state dict), optionally tokenizer files: what the release publishes on the
Hub (loaded there with ``ProLIPHF.from_pretrained``, huggingface_hub's
``PyTorchModelHubMixin``) and what ``tools/export_pytorch.py`` writes.

    model = prolip_jax.load('hf-hub:OWNER/NAME')  # or a local snapshot dir
    # (load.load_snapshot, built from resolve + snapshot_settings here)
    model.encode_text(['A photo of a Dog!'])

``hf-hub:OWNER/NAME[@REVISION]`` goes through
``huggingface_hub.snapshot_download``: its cache (``HF_HUB_CACHE``,
``HF_HOME``) and ``HF_HUB_OFFLINE=1`` (cache only, nothing downloaded) are
honoured, the environment being read at each call.

Settings (``snapshot_settings``):

* a snapshot with this project's metadata (the ``prolip_jax`` key of
  config.json, or ``prolip_jax.json`` next to it as the ``--hub_compatible``
  export writes) gets exactly the model config, tokenizer file and settings,
  normalisation, eval view and eval image order it was exported with;
* a plain release-schema snapshot gets the release preset: the release's
  forward pass (``release_compat=True``, decided by the [CLS]/[UNC] tokens of
  the config), ``text_cfg.context_length`` (64; 256 for the long-context
  model), the tokenizer's pad id (``</s>`` = 1 for SigLIP's), [MASK] = the
  highest ``<extra_id_N>`` (32000 = ``<extra_id_99>`` for SigLIP's),
  ``clean='canonicalize'`` (or ``text_cfg.tokenizer_kwargs.clean``), EOS kept
  on truncation, OpenAI CLIP mean/std (or ``preprocess_cfg``) and open_clip's
  eval transform (bicubic shorter-side resize + centre crop in the image's
  stored mode, RGB after the crop: view and order ``'release'``).
  A sentencepiece tokenizer file gets the same ids as the tokenizer.json of
  its vocabulary: EOS kept on truncation, padding with ``text_cfg.pad_id``
  or else EOS.
  The tokenizer is the snapshot's own ``tokenizer.json`` / ``tokenizer.model``
  if it has one, else the Hub repo ``text_cfg.hf_tokenizer_name``
  (``timm/ViT-B-16-SigLIP``) through the same cache, or the ``tokenizer``
  argument (a file, a directory or ``hf-hub:NAME``).

``prepare_init_from(config, workdir, stored, mngr)`` turns
``config.init_from`` (a snapshot or ``hf-hub:...``) into a step-0 checkpoint
without optimizer state, so training fine-tunes it with a fresh AdamW (the
rule of ``tools/import_pytorch.py``); ``config.init_image_size`` fine-tunes
it at another image size, the image position embeddings resampled
(``models.posemb``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from typing import Any, Optional

from prolip_jax import errors
from prolip_jax.config.keys import CLIP_MEAN
from prolip_jax.config.keys import CLIP_STD
from prolip_jax.interop import convert
from prolip_jax.interop import manifest
from prolip_jax.storage import file_names
from prolip_jax.storage import paths
from prolip_jax.storage.file_names import CONFIG_FILE
from prolip_jax.storage.file_names import PROJECT_FILE
from prolip_jax.storage.file_names import TOKENIZER_FILES
from prolip_jax.storage.file_names import WEIGHTS_FILE

HF_PREFIX = 'hf-hub:'
# What to download of a Hub repo named for its tokenizer only.
TOKENIZER_PATTERNS = [file_names.TOKENIZER_JSON,
                      *file_names.TOKENIZER_SIDE_FILES,
                      file_names.TOKENIZER_MODEL, file_names.SPIECE_MODEL]
RELEASE_CLEAN = 'canonicalize'


class SnapshotError(errors.CheckpointError, FileNotFoundError):
  """A snapshot that cannot be found or read (the message names the path);
  a user error (one line from the command line), and a FileNotFoundError
  for library callers."""


class SnapshotContentError(SnapshotError, ValueError):
  """A snapshot whose files are there but make no model: ``model.safetensors``
  truncated or not safetensors, ``config.json`` not a model config, or the
  two describing different models. One line naming the file (also a
  ``ValueError``, what these were before)."""


def _first_line(e: BaseException) -> str:
  """``Type: first line`` of an error's message (at most 200 characters)."""
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  return type(e).__name__ + (f': {lines[0][:200]}' if lines else '')


def _truthy(value: Optional[str]) -> bool:
  return (value or '').strip().lower() in ('1', 'true', 'yes', 'on')


def is_hub_id(path_or_repo: str) -> bool:
  """Whether ``path_or_repo`` is ``hf-hub:OWNER/NAME[@REVISION]``."""
  return isinstance(path_or_repo, str) and path_or_repo.startswith(HF_PREFIX)


def is_snapshot(path: str) -> bool:
  """Whether ``path`` (a local folder, ``gs://`` or ``s3://``) holds
  ``model.safetensors`` (or, remote, an export's manifest)."""
  if paths.is_remote(path):
    folder = paths.parse(path)
    return ((folder / WEIGHTS_FILE).exists()
            or (folder / manifest.MANIFEST_FILE).exists())
  return os.path.isfile(os.path.join(path, WEIGHTS_FILE))


_DOWNLOADED: dict[str, str] = {}


def _download_export(url: str) -> str:
  """A local copy of the object-store export ``url`` (its manifest's
  files, checked), made once per process."""
  if url not in _DOWNLOADED:
    local = tempfile.mkdtemp(prefix='prolip_jax-export-')
    atexit.register(shutil.rmtree, local, True)
    manifest.download(url, local)
    _DOWNLOADED[url] = local
  return _DOWNLOADED[url]


def download(repo: str, allow_patterns: Optional[list[str]] = None) -> str:
  """Local directory of Hub repo ``OWNER/NAME[@REVISION]`` (with or without
  ``hf-hub:``) through ``huggingface_hub.snapshot_download``.

  ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` are read from the environment at
  the call. Raises ``SnapshotError`` (bad repo id, not cached while offline,
  not found) with the repo and cache directory in the message.
  """
  # pylint: disable=g-import-not-at-top
  import huggingface_hub
  from huggingface_hub import constants
  from huggingface_hub import errors
  # pylint: enable=g-import-not-at-top
  name = repo[len(HF_PREFIX):] if is_hub_id(repo) else repo
  repo_id, _, revision = name.partition('@')
  cache_dir = os.environ.get('HF_HUB_CACHE') or constants.HF_HUB_CACHE
  offline = _truthy(os.environ.get('HF_HUB_OFFLINE')) or bool(
      constants.HF_HUB_OFFLINE)
  where = f'{HF_PREFIX}{name} (Hugging Face cache {cache_dir})'
  try:
    return huggingface_hub.snapshot_download(
        repo_id=repo_id, revision=revision or None, cache_dir=cache_dir,
        local_files_only=offline, allow_patterns=allow_patterns)
  except errors.HFValidationError as e:
    raise SnapshotError(f'{where}: {repo_id!r} is not a valid Hugging Face '
                        f'repo id (want OWNER/NAME): {e}') from e
  except errors.LocalEntryNotFoundError as e:
    raise SnapshotError(
        f'{where}: not in the cache' + (
            ' and HF_HUB_OFFLINE is set, so nothing is downloaded; download '
            'it once online or unset HF_HUB_OFFLINE' if offline else
            ' and the Hub cannot be reached') + f' ({type(e).__name__})'
    ) from e
  except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as e:
    raise SnapshotError(f'{where}: no such repo or revision on the Hub '
                        f'({type(e).__name__}: {e})') from e
  except (OSError, errors.HfHubHTTPError) as e:
    raise SnapshotError(f'{where}: cannot get it: {type(e).__name__}: '
                        f'{e}') from e


def resolve(path_or_repo: str) -> str:
  """The local snapshot directory of ``path_or_repo`` (a directory or
  ``hf-hub:OWNER/NAME[@REVISION]``); checks config.json and the weights."""
  shown = None  # what messages call the snapshot: the URL the user gave
  if is_hub_id(path_or_repo):
    path = download(path_or_repo)
  elif paths.is_remote(path_or_repo):
    shown = str(paths.parse(path_or_repo))
    path = _download_export(shown)  # a temporary folder, never named
  else:
    path = os.path.abspath(path_or_repo)
    if not os.path.isdir(path):
      raise SnapshotError(f'no such snapshot directory: {path}')
  for name in (CONFIG_FILE, WEIGHTS_FILE):
    if not os.path.isfile(os.path.join(path, name)):
      raise SnapshotError(
          f'{shown or path} is not a model snapshot: it has no {name} (has '
          f'{sorted(os.listdir(path))}' + (
              ', the files its manifest lists)' if shown else ')'))
  listed = manifest.read(path)
  if listed is not None:  # an export of ours: the model's bytes are checked
    # (the tokenizer has its own check, which an explicit tokenizer= skips)
    manifest.verify(path, listed, path,
                    names=(CONFIG_FILE, WEIGHTS_FILE, PROJECT_FILE))
  return path


@dataclasses.dataclass
class SnapshotSettings:
  """Everything needed to rebuild a snapshot's model and its inputs."""
  path: str
  model: dict[str, Any]  # ModelConfig.to_dict() form
  tokenizer_path: str
  context_length: int
  pad_id: Optional[int]
  mask_id: Optional[int]
  clean: str
  keep_eos: bool
  mean: tuple[float, ...]
  std: tuple[float, ...]
  image_view: str
  release: bool  # the release preset (no project metadata) was applied
  # sha256 of the snapshot's own tokenizer file, as the export recorded it.
  tokenizer_sha256: Optional[str] = None
  image_order: str = 'rgb_first'  # pipeline.eval_images's order
  # What an export records of its training run (``data.name``, ``evals``,
  # ``eval.tfds_data_dir``): the evaluators ``evaluate`` runs by default.
  run_config: dict[str, Any] = dataclasses.field(default_factory=dict)

  def tokenizer(self):
    """The ``Tokenizer`` these settings describe."""
    from prolip_jax.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
    return Tokenizer(self.tokenizer_path, self.context_length,
                     pad_id=self.pad_id, mask_id=self.mask_id,
                     clean=self.clean, keep_eos=self.keep_eos)


def read_config(path: str) -> dict[str, Any]:
  """config.json of a snapshot, with ``prolip_jax.json``'s metadata merged
  under the ``prolip_jax`` key when config.json has none."""
  cfg_path = os.path.join(path, CONFIG_FILE)
  cfg = _read_json_object(cfg_path)
  project_path = os.path.join(path, PROJECT_FILE)
  if not cfg.get(convert.PROJECT_KEY) and os.path.isfile(project_path):
    cfg[convert.PROJECT_KEY] = _read_json_object(project_path)
  if not isinstance(cfg.get(convert.PROJECT_KEY) or {}, dict):
    raise SnapshotContentError(
        f'{cfg_path}: its {convert.PROJECT_KEY!r} entry is a '
        f'{type(cfg[convert.PROJECT_KEY]).__name__}, not an object: the file '
        'is damaged or not an export\'s; export or download it again')
  return cfg


def _read_json_object(file: str) -> dict[str, Any]:
  """The JSON object in ``file``; ``SnapshotError`` (one line) when it cannot
  be read, is not JSON or holds something else (a list, a number)."""
  try:
    with open(file) as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise SnapshotError(f'cannot read {file}: {e}') from e
  if not isinstance(value, dict):
    kind = {list: 'array', str: 'string', bool: 'boolean', int: 'number',
            float: 'number', type(None): 'null'}.get(type(value), 'value')
    raise SnapshotContentError(
        f'{file} holds a JSON {kind}, not the object of a model config: the '
        'file is damaged or not a snapshot\'s; export or download it again')
  return value


def _tokenizer_in(directory: str) -> Optional[str]:
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(directory, name)):
      return os.path.join(directory, name)
  return None


def find_tokenizer(path: str, cfg_json: dict[str, Any],
                   tokenizer: Optional[str] = None) -> str:
  """The tokenizer file of a snapshot (see the module docstring)."""
  if tokenizer:
    if is_hub_id(tokenizer):
      found = _tokenizer_in(download(tokenizer, TOKENIZER_PATTERNS))
    elif os.path.isdir(tokenizer):
      found = _tokenizer_in(tokenizer)
    else:
      found = tokenizer if os.path.isfile(tokenizer) else None
    if found is None:
      raise SnapshotError(f'no tokenizer file ({", ".join(TOKENIZER_FILES)}) '
                          f'at {tokenizer}')
    return found
  project = cfg_json.get(convert.PROJECT_KEY) or {}
  if project.get('tokenizer_file'):
    file = os.path.join(path, project['tokenizer_file'])
    # Lexically inside (no '..', not absolute); symlinks are fine: the
    # Hugging Face cache links snapshot files to its blobs.
    if not os.path.normpath(file).startswith(os.path.normpath(path) + os.sep):
      raise SnapshotError(f'{path}: tokenizer file '
                          f'{project["tokenizer_file"]!r} is outside the '
                          'snapshot directory')
    if not os.path.isfile(file):
      raise SnapshotError(f'{path}: config names tokenizer file '
                          f'{project["tokenizer_file"]!r}, which is missing')
    return file
  found = _tokenizer_in(path)
  if found:
    return found
  name = (cfg_json.get('text_cfg') or {}).get('hf_tokenizer_name')
  if name:
    found = _tokenizer_in(download(name, TOKENIZER_PATTERNS))
    if found:
      return found
    raise SnapshotError(f'{HF_PREFIX}{name} (text_cfg.hf_tokenizer_name of '
                        f'{path}) has no tokenizer file')
  raise SnapshotError(f'{path} has no tokenizer file ({", ".join(TOKENIZER_FILES)}'
                      ') and config.json names no text_cfg.hf_tokenizer_name; '
                      'pass tokenizer=')


_EXTRA_ID = re.compile(r'<extra_id_(\d+)>')


def release_mask_id(tokenizer_path: str, model_vocab: int = 0
                    ) -> Optional[int]:
  """The release's [MASK]: ``<extra_id_99>`` = 32000 for SigLIP's.

  A tokenizer.json: its highest ``<extra_id_N>`` (T5 conversions append
  them after the sentencepiece pieces, highest first), else a ``[MASK]``
  token. A sentencepiece file: the first id after its pieces (where that
  ``<extra_id_N>`` sits) when the model's vocabulary ``model_vocab`` has
  room for it, else a ``[MASK]`` piece. None when there is neither.
  """
  from prolip_jax.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  if tok_lib.file_kind(tokenizer_path) == tok_lib.HF_JSON:
    import tokenizers  # pylint: disable=g-import-not-at-top
    vocab = tokenizers.Tokenizer.from_file(tokenizer_path).get_vocab(
        with_added_tokens=True)
    extra = [(int(m.group(1)), i) for t, i in vocab.items()
             if (m := _EXTRA_ID.fullmatch(t))]
    if extra:
      return max(extra)[1]
    return vocab.get(tok_lib.MASK_PIECE)
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
  if model_vocab > sp.get_piece_size():
    return sp.get_piece_size()
  mask = sp.piece_to_id(tok_lib.MASK_PIECE)
  return None if mask == sp.unk_id() else mask


def snapshot_settings(path: str, tokenizer: Optional[str] = None
                      ) -> SnapshotSettings:
  """Model config, tokenizer and preprocessing of a local snapshot ``path``
  (see the module docstring for the release preset)."""
  from prolip_jax.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg_json = read_config(path)
  try:
    model = convert.model_dict_from_json(cfg_json)
    ModelConfig.from_config(model)  # its checks, before any weight is read
  except (ValueError, TypeError, AttributeError, KeyError) as e:
    # The user's file (a wrong type, an unknown field), not our bug.
    raise SnapshotContentError(
        f'{os.path.join(path, CONFIG_FILE)} is not a model config this '
        f'project can build: {_first_line(e)}') from e
  project = cfg_json.get(convert.PROJECT_KEY) or {}
  tok_path = find_tokenizer(path, cfg_json, tokenizer)
  ctx = model['text']['context_length']
  if project:  # exported by this project: its own settings, old defaults
    pad = model['text']['pad_id']
    return SnapshotSettings(
        path=path, model=model, tokenizer_path=tok_path, context_length=ctx,
        pad_id=pad, mask_id=project.get('mask_id'),
        clean=project.get('clean', 'none'),
        keep_eos=bool(project.get('keep_eos', False)),
        mean=tuple(project.get('mean', CLIP_MEAN)),
        std=tuple(project.get('std', CLIP_STD)),
        image_view=project.get('image_view', 'default'), release=False,
        tokenizer_sha256=project.get('tokenizer_sha256'),
        image_order=project.get('image_order', 'rgb_first'),
        run_config=dict(project.get('run_config') or {}))
  tc = cfg_json.get('text_cfg') or {}
  pre = cfg_json.get('preprocess_cfg') or {}
  clean = (tc.get('tokenizer_kwargs') or {}).get('clean', RELEASE_CLEAN)
  # A tokenizer.json pads with its own pad token, as the release's
  # HFTokenizer does whatever text_cfg says; a sentencepiece file with
  # text_cfg.pad_id, else with EOS (the SigLIP tokenizer's pad token </s>).
  if tok_lib.file_kind(tok_path) == tok_lib.HF_JSON:
    pad = None
  else:
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    pad = tc.get('pad_id', spm.SentencePieceProcessor(
        model_file=tok_path).eos_id())
  mask = release_mask_id(tok_path, model['text']['vocab_size'])
  settings = SnapshotSettings(
      path=path, model=model, tokenizer_path=tok_path, context_length=ctx,
      pad_id=pad, mask_id=mask, clean=clean, keep_eos=True,
      mean=tuple(pre.get('mean', CLIP_MEAN)),
      std=tuple(pre.get('std', CLIP_STD)), image_view='release',
      release=True, image_order='release')
  tok = settings.tokenizer()
  settings.pad_id = tok.pad_id
  settings.mask_id = tok.mask_id
  model['text']['pad_id'] = tok.pad_id
  return settings


def load_params(path: str, model: dict[str, Any]) -> Any:
  """Parameters (nested numpy) of snapshot ``path``'s weights for the model
  config ``model`` (a ModelConfig or its dict form).

  Raises ``SnapshotContentError`` (one line) for weights that are not a
  whole safetensors file (truncated, damaged) or that do not fit ``model``
  (a ``config.json`` of another model, or one with defaults only, ``{}``).
  """
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  weights = os.path.join(path, WEIGHTS_FILE)
  try:
    state_dict = load_file(weights)
  except FileNotFoundError:
    raise
  except (SafetensorError, OSError, ValueError) as e:
    raise SnapshotContentError(
        f'{weights} ({os.path.getsize(weights)} bytes) is not a whole '
        f'safetensors file ({_first_line(e)}): it is truncated or damaged; '
        'export or download it again') from e
  try:
    params, _ = convert.state_dict_to_params(state_dict, model)
  except (ValueError, TypeError) as e:
    # The first lines name the count and the first offending key; the rest
    # are behind --debug (the chained cause).
    lines = [l.strip().rstrip(':') for l in str(e).splitlines() if l.strip()]
    shown = ': '.join(lines[:2])[:400]
    raise SnapshotContentError(
        f'{weights} does not fit {os.path.join(path, CONFIG_FILE)} '
        f'({type(e).__name__}: {shown}): the config describes another model '
        'or is incomplete; export or download the snapshot again') from e
  return params


# model.* keys that say how to compute, not what: a run keeps its own when it
# starts from a snapshot (the converter stacks layers for a scanned model).
RUN_MODEL_KEYS = ('compute_dtype', 'remat', 'remat_policy', 'scan',
                  'attention_impl', 'attention_logits_dtype')


def init_models(snapshot_model: dict[str, Any], config
                ) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(stored, target)`` model dicts of a run started from a snapshot.

  ``stored``: the snapshot's model with the run's ``RUN_MODEL_KEYS``, what
  its weights are read into. ``target``: the same with
  ``vision.image_size = config.init_image_size`` when that is set (not 0),
  the model the run trains; equal to ``stored`` otherwise. Raises
  ``ValueError`` when ``init_image_size`` is not a multiple of the
  snapshot's patch size.
  """
  run_model = config.model.to_dict() if hasattr(config.model, 'to_dict') else {}
  stored = dict(snapshot_model, **{k: run_model[k] for k in RUN_MODEL_KEYS
                                   if k in run_model})
  size = int(config.get('init_image_size') or 0)
  if not size or size == stored['vision']['image_size']:
    return stored, stored
  patch = stored['vision']['patch_size']
  if size % patch:
    below = size // patch * patch
    near = f'{below} or {below + patch}' if below else f'{patch}'
    raise ValueError(f'init_image_size={size} is not a multiple of the '
                     f'snapshot\'s patch size {patch} (e.g. {near})')
  return stored, dict(stored, vision=dict(stored['vision'], image_size=size))


def prepare_init_from(config, workdir, stored, mngr):
  """Applies ``config.init_from`` (snapshot dir or ``hf-hub:...``) to a run;
  returns the config and the workdir's stored state.

  ``stored``: the workdir's ``stored_state.StoredState``, read by the
  run's checkpoint manager ``mngr`` (which writes the step-0 checkpoint).
  Without ``init_from`` both come back unchanged. Otherwise the
  snapshot decides ``config.model`` (its architecture; ``RUN_MODEL_KEYS``
  (dtype, remat, scan, attention) stay the run's), the tokenizer (``tokenizer.model_path``,
  ``pad_id``, ``mask_id``, ``clean``, ``keep_eos``) and ``data.mean``/
  ``std``/``eval_view``/``eval_image_order``, and, when ``workdir`` has no
  checkpoint yet, its weights become a step-0 checkpoint with no optimizer
  state, which training resumes from with a fresh AdamW (as after
  ``tools/import_pytorch.py``).
  A workdir with checkpoints resumes from them as usual; one without gets
  its stored state read again after that write.

  ``config.init_image_size`` (0: the snapshot's) is the one architecture
  setting the run keeps over the snapshot's: the run trains at that
  ``model.vision.image_size`` and the step-0 checkpoint holds the image
  position embeddings resampled to its patch grid (``models.posemb``,
  printed once as a ``note:`` line).
  """
  src = config.get('init_from', '') if hasattr(config, 'get') else ''
  if not src:
    if hasattr(config, 'get') and config.get('init_image_size'):
      raise ValueError('init_image_size applies to init_from only; set '
                       'model.vision.image_size for a run from scratch')
    return config, stored
  # pylint: disable=g-import-not-at-top
  import jax
  import ml_collections
  from jax.experimental import multihost_utils
  from prolip_jax.storage import checkpoint
  from prolip_jax.storage.stored_state import StoredState
  from prolip_jax.models import ModelConfig
  from prolip_jax.models import posemb
  # pylint: enable=g-import-not-at-top
  path = resolve(src)
  s = snapshot_settings(path, config.get('init_tokenizer') or None)
  snapshot_model, model = init_models(s.model, config)
  with config.unlocked() if hasattr(config, 'unlocked') else contextlib.nullcontext():
    config.model = ml_collections.ConfigDict(model)
    tok = config.tokenizer
    tok.model_path = s.tokenizer_path
    tok.pad_id = int(s.pad_id) if s.pad_id is not None else -1
    tok.mask_id = int(s.mask_id) if s.mask_id is not None else -1
    tok.clean = s.clean
    tok.keep_eos = s.keep_eos
    config.data.mean = tuple(s.mean)
    config.data.std = tuple(s.std)
    config.data.eval_view = s.image_view
    config.data.eval_image_order = s.image_order
  if not stored.steps:
    if jax.process_index() == 0:
      stored_cfg = ModelConfig.from_config(snapshot_model)
      model_cfg = ModelConfig.from_config(model)
      params, note = posemb.resample_image_posemb(
          load_params(path, stored_cfg), stored_cfg, model_cfg)
      if note:
        print(f'note: {note}', flush=True)
      checkpoint.write_imported(
          workdir, params, json.loads(config.to_json_best_effort()),
          model_cfg.to_dict(), src, mngr=mngr)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('prolip_jax init_from')
    mngr.reload()  # the step 0 that process 0 wrote
    stored = StoredState.read(mngr, workdir)
  return config, stored
