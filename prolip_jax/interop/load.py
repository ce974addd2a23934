"""Using a trained model: ``prolip_jax.load(path)``.

>>> model = prolip_jax.load('workdirs/prolip_tiny')
>>> mu, logvar = model.encode_image([uint8_image_hxwx3, ...])
>>> mu, logvar = model.encode_text(['a photo of a seven'])
>>> clf = model.zero_shot_classifier(['zero', 'one'], ['a photo of a {}.'])
>>> clf.predict(images)       # class indices by smallest CSD

Inputs are lists (one image is ``[image]``) or an ``(N, H, W, C)`` batch
array; a mistake in one item is an ``embedding.InputError`` (a
``errors.UserError`` and ``ValueError``) naming its index.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Sequence

import jax
import numpy as np

from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax.config import keys as config_keys
from prolip_jax.config.keys import CLIP_MEAN
from prolip_jax.config.keys import CLIP_STD
from prolip_jax.data import image_decode
from prolip_jax.data import pipeline
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import tokenizer_from_config
from prolip_jax.embedding import as_uint8_image
from prolip_jax.embedding import embed_in_batches
from prolip_jax.embedding import image_list
from prolip_jax.embedding import normalize_images
from prolip_jax.embedding import text_list
from prolip_jax.evaluation import metrics
from prolip_jax.evaluation import prompts
from prolip_jax.interop import hub
from prolip_jax.models import attention_impl_for
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.models import posemb
from prolip_jax.storage import checkpoint
from prolip_jax.storage import file_names
from prolip_jax.storage import paths
from prolip_jax.storage.workdir import Workdir


@dataclasses.dataclass
class ZeroShotClassifier:
  """Class Gaussians from a prompt ensemble (paper 4.2).

  ``mu``: ``(C, d)`` mean of the prompts' means; ``var``: ``(C, d)`` mean of
  their variances (None for deterministic models).
  """
  model: 'LoadedModel'
  class_names: list[str]
  mu: np.ndarray
  var: Optional[np.ndarray]

  def scores(self, images: Sequence[np.ndarray], metric: str = 'csd'
             ) -> np.ndarray:
    """``(n, C)``: ``-CSD`` (default) or cosine; higher is better.
    ``images`` as ``LoadedModel.encode_image`` takes them (a list, or an
    ``(n, H, W, C)`` batch)."""
    mu, logvar = self.model.encode_image(images)
    if self.var is None:
      metric = 'cosine'
    return np.asarray(metrics.zero_shot_scores(mu, logvar, self.mu, self.var,
                                                metric))

  def predict(self, images: Sequence[np.ndarray], metric: str = 'csd'
              ) -> np.ndarray:
    """``(n,)`` index of the best class of each image."""
    return np.argmax(self.scores(images, metric), axis=1)


def _attention_here(model_config: ModelConfig) -> str:
  """The attention implementation for this process's default device (where
  the encoders run); a model trained with cuDNN still loads on a CPU."""
  requested = 'xla' if model_config.attention_impl == 'xla' else 'auto'
  return attention_impl_for(jax.local_devices()[:1], requested)


class LoadedModel:
  """A model with its tokenizer and eval transform, ready to embed inputs.

  Inputs are embedded into the space the model was trained to score in: the
  towers' Gaussians for ProLIP and its family, the heads' shared space for a
  UniCLIP checkpoint (``objective`` and ``run_config`` say which, as stored
  in the checkpoint).
  """

  def __init__(self, model_config: ModelConfig, params: Any,
               tokenizer: Tokenizer, mean=CLIP_MEAN, std=CLIP_STD,
               batch_size: int = 64,
               objective: str = config_keys.default('objective'),
               run_config: Optional[dict] = None, image_view: str = 'default',
               image_order: str = 'rgb_first'):
    self.config = model_config
    self.params = params
    self.tokenizer = tokenizer
    self.mean = tuple(mean)
    self.std = tuple(std)
    self.batch_size = batch_size
    self.objective = objective
    self.image_view = image_view  # 'default' or 'release' (open_clip's)
    # 'rgb_first' or 'release' (resize in the stored mode, RGB after the
    # crop, as open_clip): pipeline.eval_images.
    self.image_order = image_decode.check_order(image_order)
    self.run_config = run_config or {}
    # What the model was loaded from ('prolip_emoji, step 1500'; set by
    # load / load_snapshot): evaluation figures carry it.
    self.source: Optional[str] = None
    self._module = ProLIP(model_config,
                          attention=_attention_here(model_config))
    enc_img, enc_txt = self.encoders_of(params)
    norm = lambda x: normalize_images(x, self.mean, self.std)
    # uint8 (n, s, s, 3) -> (mu, logvar); with patch indices (n, k); tokens.
    self.image_fn = jax.jit(lambda x: enc_img(norm(x)))
    self.image_keep_fn = jax.jit(lambda xk: enc_img(norm(xk[0]), xk[1]))
    self.text_fn = jax.jit(enc_txt)

  def encoders_of(self, params: Any) -> tuple:
    """``(enc_img(normalised images, keep=None), enc_txt(tokens))`` of the
    stored objective over ``params`` (traceable: ``params`` may be an
    argument of a jitted function)."""
    return objectives.get(self.objective).encoders(self._module, params,
                                                   self.run_config)

  def encode_image(self, images: Sequence[Any]
                   ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Images of any size -> (mu ``(n, d)``, logvar ``(n, d)`` or None).

    ``images``: a list (or other sequence) of images, or a batch array
    ``(n, h, w, c)``; one image alone, e.g. an ``(h, w, 3)`` array, is
    refused (``embedding.image_list``): pass ``[image]``. Each image is a
    uint8 ``(h, w, 3)`` or ``(h, w)`` array, a uint16 array (16-bit pixels,
    ``>> 8``), a float array with values in [0, 1], a PIL image, a file path
    or encoded bytes (``embedding.as_uint8_image``, which refuses bytes that
    do not decode, NaN, out-of-range values, channels-first and empty arrays
    with an ``InputError`` naming the image). No images give ``(0, d)``
    arrays.
    """
    batch = self.preprocess_images(images)
    if not len(batch):
      return self._empty(self.image_fn, np.zeros((1,) + batch.shape[1:],
                                                 np.uint8))
    return embed_in_batches(self.image_fn, batch, self.batch_size)

  def preprocess_images(self, images: Sequence[Any]) -> np.ndarray:
    """The model's eval transform: images as ``encode_image`` takes them
    -> ``(n, s, s, 3)`` uint8 (``image_view`` and ``image_order``)."""
    keep = self.image_order == image_decode.RELEASE
    images = image_list(images)
    size = self.config.vision.image_size
    out = np.zeros((len(images), size, size, 3), np.uint8)
    # One image at a time: only one full-size decoded image is held.
    for i, x in enumerate(images):
      out[i] = pipeline.eval_images([as_uint8_image(x, i, keep_mode=keep)],
                                    size, self.image_view,
                                    self.image_order)[0]
    return out

  def encode_text(self, texts: Sequence[str] | str
                  ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Captions -> (mu ``(n, d)``, logvar ``(n, d)`` or None); no captions
    give ``(0, d)`` arrays. One ``str`` is one caption; an item that is not
    a ``str`` (or UTF-8 ``bytes``) is an ``InputError`` naming its index
    (``embedding.text_list``)."""
    tokens = self.tokenizer(text_list(texts))
    if len(tokens) == 0:
      return self._empty(self.text_fn, np.full(
          (1, self.tokenizer.context_length), self.tokenizer.pad_id,
          np.int32))
    return embed_in_batches(self.text_fn, tokens, self.batch_size)

  @staticmethod
  def _empty(fn, example: np.ndarray
             ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(0, d)`` outputs of ``fn`` with the dtype and width it returns for
    one ``example`` row (shapes only: nothing is computed)."""
    mu, logvar = jax.eval_shape(fn, example)
    zeros = lambda s: np.zeros((0,) + tuple(s.shape[1:]), s.dtype)
    return zeros(mu), None if logvar is None else zeros(logvar)

  def zero_shot_classifier(self, class_names: Sequence[str],
                           templates: Sequence[str]) -> ZeroShotClassifier:
    """Class Gaussians from ``template.format(name)`` for every pair."""
    if not templates or not class_names:
      raise ValueError('need at least one class name and one template')
    cls_mu, cls_var = prompts.class_ensemble(self.encode_text,
                                               class_names, templates)
    return ZeroShotClassifier(self, list(class_names), np.asarray(cls_mu),
                              None if cls_var is None else np.asarray(cls_var))


def load(path: str, step: Optional[int] = None,
         tokenizer: Optional[str] = None,
         image_size: Optional[int] = None) -> LoadedModel:
  """Loads a training workdir, an export / Hugging Face snapshot directory or
  ``hf-hub:OWNER/NAME``.

  Args:
    path: a workdir written by ``prolip_jax.main`` (its latest checkpoint, or
      ``step``); a directory with ``model.safetensors`` + ``config.json``
      (written by ``tools/export_pytorch.py``, or the ProLIP release's Hub
      snapshot: see ``prolip_jax.interop.hub`` for the release preset); or
      ``hf-hub:OWNER/NAME[@REVISION]`` (through huggingface_hub's cache).
    step: checkpoint step for workdirs.
    tokenizer: snapshots only: a tokenizer file, directory or
      ``hf-hub:NAME`` to use instead of the snapshot's own.
    image_size: embed images at this size (a multiple of the patch size)
      instead of the one the model was trained at: the image position
      embeddings are resampled to its patch grid (``at_image_size``).
  """
  if hub.is_hub_id(path) or hub.is_snapshot(path):
    return load_snapshot(path, tokenizer=tokenizer, image_size=image_size)
  workdir = Workdir(path, 'model path')
  if not workdir.has_checkpoints() and (
      workdir.root / file_names.CONFIG_FILE).is_file():
    return load_snapshot(path, tokenizer=tokenizer, image_size=image_size)
  params, meta = checkpoint.load_params(workdir, step, item='scored')
  model_cfg, params = at_image_size(
      ModelConfig.from_config(meta['model']), params, image_size)
  run_cfg = meta.get('config', {})
  data = run_cfg.get('data', {})
  owner = (f'checkpoint step {meta.get("step")} under '
           f'{workdir.checkpoints}')
  checkpoint.check_tokenizer(meta, workdir.tokenizer, owner)
  tokenizer = tokenizer_from_config(paths.local_copy(workdir.tokenizer),
                                    run_cfg,
                                    model_cfg.text.context_length,
                                    pad_id=model_cfg.text.pad_id)
  require_finite(params, owner)
  model = LoadedModel(model_cfg, params, tokenizer,
                      data.get('mean', CLIP_MEAN),
                      data.get('std', CLIP_STD),
                      objective=config_keys.get(run_cfg, 'objective'),
                      run_config=run_cfg,
                      image_view=data.get('eval_view', 'default'),
                      image_order=data.get('eval_image_order', 'rgb_first'))
  require_finite_outputs(model, owner)
  model.source = f'{_last_part(path)}, step {meta.get("step")}'
  return model


def _last_part(path) -> str:
  """The last component of a local path or a gs:// / s3:// URL."""
  return str(path).rstrip('/').rsplit('/', 1)[-1]


def load_snapshot(path_or_repo: str, tokenizer: Optional[str] = None,
                  batch_size: int = 64,
                  image_size: Optional[int] = None) -> LoadedModel:
  """A model from a snapshot directory or ``hf-hub:OWNER/NAME[@REV]``.

  Args:
    path_or_repo: local snapshot directory (config.json + model.safetensors)
      or ``hf-hub:OWNER/NAME[@REV]``; a release snapshot gets the release
      preset (``prolip_jax.interop.hub``).
    tokenizer: optional tokenizer file, directory or ``hf-hub:NAME`` used
      instead of the snapshot's own / ``text_cfg.hf_tokenizer_name``.
    batch_size: embedding batch size.
    image_size: as ``load``'s: another image size, the image position
      embeddings resampled.
  Raises:
    hub.SnapshotError: (a FileNotFoundError) the snapshot, or its tokenizer,
      cannot be found; the message names the path or repo and cache.
    hub.SnapshotContentError: (also a ValueError) a truncated or damaged
      model.safetensors, a config.json that is no model config or not this
      model's (one line naming the file).
    manifest.ExportIncompleteError: an export's file differs from its
      manifest.
    errors.NonFiniteParamsError: non-finite weights, or non-finite
      embeddings of the probe inputs (``require_finite_outputs``).
  """
  path = hub.resolve(path_or_repo)
  s = hub.snapshot_settings(path, tokenizer)
  model_cfg = ModelConfig.from_config(s.model)
  if s.tokenizer_sha256 and tokenizer is None:  # the export's own file
    checkpoint.check_tokenizer(
        {checkpoint.TOKENIZER_SHA256: s.tokenizer_sha256}, s.tokenizer_path,
        f'the export {path}')
  params = hub.load_params(path, model_cfg)
  require_finite(params, f'the snapshot {path}')
  model_cfg, params = at_image_size(model_cfg, params, image_size)
  model = LoadedModel(model_cfg, params, s.tokenizer(), s.mean, s.std,
                      batch_size=batch_size, image_view=s.image_view,
                      image_order=s.image_order, run_config=s.run_config)
  require_finite_outputs(model, f'the snapshot {path}')
  model.source = (path_or_repo if hub.is_hub_id(path_or_repo)
                  else _last_part(path_or_repo))
  return model


def at_image_size(model_cfg: ModelConfig, params: Any,
                  image_size: Optional[int]) -> tuple[ModelConfig, Any]:
  """``(config, params)`` of the model at ``image_size`` pixels: the image
  position embeddings resampled to its patch grid (``models.posemb``; one
  ``note:`` line when the grid changes). ``image_size`` None or the
  model's own: both unchanged. Raises ``ValueError`` for a size that is no
  positive multiple of the patch size."""
  if not image_size or image_size == model_cfg.vision.image_size:
    return model_cfg, params
  patch = model_cfg.vision.patch_size
  if int(image_size) != image_size or image_size < patch or (
      image_size % patch):
    raise ValueError(f'image_size={image_size} is not a positive multiple '
                     f'of the model\'s patch size {patch}')
  target = dataclasses.replace(model_cfg, vision=dataclasses.replace(
      model_cfg.vision, image_size=int(image_size)))
  params, note = posemb.resample_image_posemb(params, model_cfg, target)
  if note:
    print(f'note: {note}', flush=True)
  return target, params


def require_finite(params: Any, owner: str):
  """Raises ``errors.NonFiniteParamsError`` (one line naming the first
  parameters) when a parameter holds a NaN or an infinity: such a model
  embeds everything as NaN."""
  bad = [jax.tree_util.keystr(path) for path, x in
         jax.tree_util.tree_flatten_with_path(params)[0]
         if np.issubdtype(np.asarray(x).dtype, np.inexact)
         and not np.all(np.isfinite(np.asarray(x)))]
  if bad:
    raise errors.NonFiniteParamsError(
        f'{owner} has non-finite parameters (NaN or infinity) in '
        f'{len(bad)} arrays, e.g. {", ".join(bad[:3])}: it cannot embed '
        'anything; load an earlier checkpoint or export')


# What ``require_finite_outputs`` embeds: mid-grey pixels and a short caption.
PROBE_GREY = 128
PROBE_TEXT = 'a photo'
# Compiled probes by architecture (the parameters are an argument): loading
# the same kind of model again costs no compilation. A few are kept.
_PROBES: dict[tuple, Any] = {}
_MAX_PROBES = 4


def _probe_fn(model: LoadedModel):
  """A jitted ``(params, image (1, s, s, 3) uint8, tokens (1, L)) ->
  ((mu, logvar), (mu, logvar))`` of ``model``'s encoders, shared by every
  model with its architecture, objective, run config and normalisation."""
  objective = objectives.get(model.objective)
  # The run config counts only for objectives whose encoders read it.
  reads_config = type(objective).encoders is not objectives.Objective.encoders
  key = (model.config, model._module.attention, model.objective,
         json.dumps(model.run_config, sort_keys=True, default=str)
         if reads_config else None, model.mean, model.std)
  fn = _PROBES.get(key)
  if fn is None:
    # Only what the key fixes is captured, not ``model`` (nor its params).
    module, run_config = model._module, model.run_config
    mean, std = model.mean, model.std

    def probe(params, image, tokens):
      enc_img, enc_txt = objective.encoders(module, params, run_config)
      return enc_img(normalize_images(image, mean, std)), enc_txt(tokens)

    while len(_PROBES) >= _MAX_PROBES:
      _PROBES.pop(next(iter(_PROBES)))
    fn = _PROBES[key] = jax.jit(probe)
  return fn


def require_finite_outputs(model: LoadedModel, owner: str):
  """Raises ``errors.NonFiniteParamsError`` (one line naming ``owner``) when
  the embedding (mean or log-variance) of one mid-grey image or one short
  caption holds a NaN or an infinity.

  Finite weights can still overflow (a huge scale in a layer norm, a
  log-variance head whose exponent overflows in float32); such a model
  embeds every input as NaN, which is worth one line at load, not NaN
  scores later. Costs one batch of 1 per tower, compiled once per
  architecture and process (``_probe_fn``).
  """
  size = model.config.vision.image_size
  image = np.full((1, size, size, 3), PROBE_GREY, np.uint8)
  tokens = model.tokenizer([PROBE_TEXT])
  outputs = jax.device_get(_probe_fn(model)(model.params, image, tokens))
  bad = [f'{tower} {name}'
         for tower, pair in zip(('image', 'text'), outputs)
         for name, out in zip(('mean', 'log-variance'), pair)
         if out is not None and not np.all(np.isfinite(out))]
  if bad:
    raise errors.NonFiniteParamsError(
        f'{owner} embeds a mid-grey image and the caption {PROBE_TEXT!r} '
        f'with non-finite values (NaN or infinity) in its {", ".join(bad)}, '
        'though its parameters are finite: it cannot embed anything; load '
        'an earlier checkpoint or export')
