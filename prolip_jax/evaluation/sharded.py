"""Embedding an evaluation set on every device and host of a mesh.

An evaluation set is cut into global batches of ``batch_size`` (rounded up
to a multiple of the mesh's batch shards). Host ``p`` of ``P`` reads and
decodes only its part of each global batch, with Grain threads (and worker
processes when asked) as training does; the encoders run on the whole mesh
with the batch split over ``data`` x ``fsdp`` and the parameters as training
shards them; the embeddings come back replicated, so every host holds the
whole set's embeddings once it is done and computes the same metrics
whatever the number of devices or hosts.

``EvalModel`` is what an evaluator needs of a model: parameters, jitted
encoders that take them as an argument (so a sharded train state is used
where it lies), the tokenizer and the eval image transform. It is built from
a train state (``from_training``) or from ``prolip_jax.load``
(``from_loaded``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional, Sequence

import grain
import jax
import numpy as np

from prolip_jax import sharding as shd
from prolip_jax.data import pipeline
from prolip_jax.embedding import normalize_images
from prolip_jax.models import ProLIP


@dataclasses.dataclass
class ImageSet:
  """Images to embed, read at random: ``get(i)`` -> (image, label).

  The image is a file path, encoded bytes or an ``(h, w, 3)`` uint8 array;
  the label an int (``-1`` when the set has none). ``get`` runs on Grain's
  threads, so it must be safe to call from several threads.
  """
  name: str
  size: int
  get: Callable[[int], tuple[Any, int]]


@dataclasses.dataclass
class Embeddings:
  """``mu`` ``(n, d)``, ``logvar`` ``(n, d)`` or None, ``labels`` ``(n,)``,
  and how long embedding took."""
  mu: np.ndarray
  logvar: Optional[np.ndarray]
  labels: np.ndarray
  seconds: float

  @property
  def pair(self) -> tuple[np.ndarray, Optional[np.ndarray]]:
    return self.mu, self.logvar


class EvalModel:
  """A model's encoders on a mesh, ready to embed evaluation sets.

  Args:
    encoders: ``encoders(params) -> (enc_img(normalised images),
      enc_txt(tokens))``, each returning ``(mu, logvar or None)``: the
      objective's scoring space (``Objective.encoders``).
    params: the parameters (sharded on ``mesh`` or host arrays, which are
      then replicated onto it).
    tokenizer: the run's ``Tokenizer``.
    image_size, mean, std, image_view, image_order: the eval transform
      (``pipeline.eval_images``) and the normalisation.
    mesh: where the encoders run.
    loaded: a ``LoadedModel`` for suites that need one (``loaded_model``
      builds it on first use when None).
  """

  def __init__(self, encoders: Callable, params: Any, tokenizer, *,
               image_size: int, mean, std, image_view: str,
               image_order: str, mesh,
               probabilistic: bool, loaded=None,
               make_loaded: Optional[Callable[[], Any]] = None):
    self.tokenizer = tokenizer
    self.image_size = int(image_size)
    self.image_view = image_view
    self.image_order = image_order
    self.mesh = mesh
    self.probabilistic = bool(probabilistic)
    self._loaded, self._make_loaded = loaded, make_loaded
    leaves = jax.tree.leaves(params)
    if not all(isinstance(x, jax.Array)
               and isinstance(x.sharding, jax.sharding.NamedSharding)
               and x.sharding.mesh == mesh for x in leaves):
      params = jax.device_put(params, shd.replicated(mesh))
    self.params = params
    out = shd.replicated(mesh)

    def images(p, x, labels):
      mu, logvar = encoders(p)[0](normalize_images(x, mean, std))
      return mu, logvar, labels

    self._images = jax.jit(images, out_shardings=out)
    self._texts = jax.jit(lambda p, t: encoders(p)[1](t), out_shardings=out)

  def loaded_model(self):
    """A ``LoadedModel`` of the same parameters (host copy), for the
    bundled suites that embed through one."""
    if self._loaded is None:
      self._loaded = self._make_loaded()
    return self._loaded

  # -- embedding -------------------------------------------------------------

  def _global_batch(self, batch_size: int) -> tuple[int, int]:
    shards = shd.num_batch_shards(self.mesh)
    gb = max(1, math.ceil(batch_size / shards)) * shards
    return gb, gb // jax.process_count()

  def embed_images(self, images: ImageSet, batch_size: int, *,
                   num_threads: int = 16, num_workers: int = 0,
                   progress: Optional[Callable[[int, int], None]] = None
                   ) -> Embeddings:
    """Every image of ``images`` through the image encoder (eval view:
    shorter side to ``image_size``, centre crop), all devices, all hosts."""
    n = images.size
    if n == 0:
      raise ValueError(f'{images.name}: no images to evaluate')
    gb, local = self._global_batch(batch_size)
    num_batches = math.ceil(n / gb)
    size, view, order = self.image_size, self.image_view, self.image_order

    def load(i):
      image, label = images.get(min(int(i), n - 1))  # padding repeats the last
      if not isinstance(image, np.ndarray):
        image = _read(image)
      return {'image': pipeline.eval_images([image], size, view, order)[0],
              'label': np.int32(label)}

    ds = (grain.MapDataset.range(num_batches * gb).map(load).batch(local)
          [jax.process_index()::jax.process_count()])
    it = ds.to_iter_dataset(grain.ReadOptions(
        num_threads=max(1, num_threads), prefetch_buffer_size=4))
    if num_workers > 0:
      it = it.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=num_workers))
    t0 = time.time()
    mus, logvars, labels = [], [], []
    for k, local_batch in enumerate(it):
      batch = shd.host_to_global(self.mesh, local_batch)
      mu, logvar, lab = self._images(self.params, batch['image'],
                                     batch['label'])
      mus.append(np.asarray(mu))
      labels.append(np.asarray(lab))
      if logvar is not None:
        logvars.append(np.asarray(logvar))
      if progress is not None:
        progress(min((k + 1) * gb, n), n)
    return Embeddings(np.concatenate(mus)[:n],
                      np.concatenate(logvars)[:n] if logvars else None,
                      np.concatenate(labels)[:n], time.time() - t0)

  def embed_tokens(self, tokens: np.ndarray, batch_size: int
                   ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Token rows ``(n, L)`` through the text encoder, all devices."""
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    gb, local = self._global_batch(batch_size)
    padded = math.ceil(n / gb) * gb
    tokens = np.concatenate([tokens, np.repeat(tokens[-1:], padded - n, 0)])
    p = jax.process_index()
    mus, logvars = [], []
    for start in range(0, padded, gb):
      mine = tokens[start + p * local:start + (p + 1) * local]
      mu, logvar = self._texts(self.params,
                               shd.host_to_global(self.mesh, mine))
      mus.append(np.asarray(mu))
      if logvar is not None:
        logvars.append(np.asarray(logvar))
    return (np.concatenate(mus)[:n],
            np.concatenate(logvars)[:n] if logvars else None)

  def embed_texts(self, texts: Sequence[str], batch_size: int
                  ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Captions -> (mu ``(n, d)``, logvar or None)."""
    return self.embed_tokens(self.tokenizer(list(texts)), batch_size)


def _read(image: Any) -> bytes:
  if isinstance(image, (bytes, bytearray)):
    return bytes(image)
  with open(image, 'rb') as f:
    return f.read()


def from_training(objective, model: ProLIP, params: Any, config, tokenizer,
                  mesh, make_loaded: Optional[Callable[[], Any]] = None
                  ) -> EvalModel:
  """The model of a training run as its train state holds it (sharded)."""
  return EvalModel(
      lambda p: objective.encoders(model, p, config), params, tokenizer,
      image_size=model.config.vision.image_size, mean=config.data.mean,
      std=config.data.std, image_view=config.data.get('eval_view', 'default'),
      image_order=config.data.get('eval_image_order', 'rgb_first'), mesh=mesh, probabilistic=model.config.use_unc, make_loaded=make_loaded)


def from_loaded(loaded, mesh) -> EvalModel:
  """A ``prolip_jax.load``-ed model, its parameters replicated on ``mesh``."""
  return EvalModel(
      loaded.encoders_of, loaded.params, loaded.tokenizer,
      image_size=loaded.config.vision.image_size, mean=loaded.mean,
      std=loaded.std, image_view=loaded.image_view,
      image_order=loaded.image_order, mesh=mesh,
      probabilistic=loaded.config.use_unc, loaded=loaded)
