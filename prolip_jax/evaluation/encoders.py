"""Embedding evaluation sets on every device and host of a mesh: the one
way evaluation embeds.

An evaluation set is cut into global batches of ``batch_size`` (rounded up
to a multiple of the mesh's batch shards). Host ``p`` of ``P`` reads and
decodes only its part of each global batch, with Grain threads (and worker
processes when asked) as training does; the encoders run on the whole mesh
with the batch split over ``data`` x ``fsdp`` and the parameters as training
shards them; the embeddings come back replicated, so every host holds the
whole set's embeddings once it is done and computes the same metrics
whatever the number of devices or hosts.

``Encoders`` is what every evaluator embeds with: jitted encoders that take
the parameters as an argument (so a sharded train state is used where it
lies), the tokenizer and the eval image transform. It is built for a
training run (``from_training``) or from ``prolip_jax.load``
(``from_loaded``). It embeds an ``ImageSet`` (``data/sources/views.py``:
the images of a source's evaluation view); images held in memory are one
too (``in_memory``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable, Optional, Sequence

import grain
import jax
import numpy as np

from prolip_jax import sharding as shd
from prolip_jax.data import pipeline
from prolip_jax.data.sources.views import ImageSet
from prolip_jax.embedding import normalize_images
from prolip_jax.evaluation.uncertainty import keep_indices_for
from prolip_jax.models import ProLIP


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


class Progress:
  """``progress(done, total)`` callback: an in-place line on a terminal,
  otherwise a line every ``interval`` seconds and at the end."""

  def __init__(self, desc: str, enabled: bool = True, stream=None,
               interval: float = 5.0):
    self.desc, self.enabled = desc, enabled
    self.stream = stream or sys.stderr
    self.interval = interval
    self.start = self.last = time.time()
    self.tty = hasattr(self.stream, 'isatty') and self.stream.isatty()

  def __call__(self, done: int, total: int):
    if not self.enabled:
      return
    now = time.time()
    finished = done >= total
    if not (self.tty or finished or now - self.last >= self.interval):
      return
    self.last = now
    rate = done / max(now - self.start, 1e-9)
    msg = f'{self.desc}: {done}/{total} ({rate:.0f}/s)'
    if self.tty:
      self.stream.write('\r' + msg + ('\n' if finished else ''))
    else:
      self.stream.write(msg + '\n')
    self.stream.flush()


def in_memory(name: str, images: np.ndarray,
              labels: Optional[np.ndarray] = None) -> ImageSet:
  """An ``ImageSet`` over uint8 images held in memory ``(n, h, w, 3)``."""
  return ImageSet(name, len(images), lambda i: (
      images[i], -1 if labels is None else int(labels[i])))


class Encoders:
  """A model's encoders on a mesh: what every evaluator embeds with.

  The parameters are an argument of every call (``embed_*(params, ...)``),
  so a training run's sharded train state is used where it lies and one
  ``Encoders`` serves every step; host arrays are replicated onto the mesh.

  Args:
    encoders: ``encoders(params) -> (enc_img(normalised images, keep=None),
      enc_txt(tokens))``, each returning ``(mu, logvar or None)``: the
      objective's scoring space (``Objective.encoders``).
    tokenizer: the run's ``Tokenizer``.
    image_size, mean, std, image_view, image_order: the eval transform
      (``pipeline.eval_images``) and the normalisation.
    mesh: where the encoders run.
    probabilistic: whether the model has [UNC] (sigma^2).
    num_patches: patch tokens per image (``embed_images``' ``keep_ratio``).
    train_data: the data set the model was trained on (``data.name``), for
      the ``heldout`` kind.
    extra_metrics: ``fn(embed_images, embed_texts) -> {name: value}``, the
      objective's own held-out figures (``Objective.heldout_metrics``).
    source: what the model was loaded from (figures carry it).
  """

  def __init__(self, encoders: Callable, tokenizer, *, image_size: int,
               mean, std, image_view: str, image_order: str, mesh,
               probabilistic: bool, num_patches: int, train_data: str = '',
               extra_metrics: Optional[Callable] = None,
               source: Optional[str] = None):
    self.tokenizer = tokenizer
    self.image_size = int(image_size)
    self.image_view = image_view
    self.image_order = image_order
    self.mesh = mesh
    self.probabilistic = bool(probabilistic)
    self.num_patches = int(num_patches)
    self.train_data = train_data
    self.extra_metrics = extra_metrics
    self.source = source
    out = shd.replicated(mesh)

    def images(p, x, keep, labels):
      mu, logvar = encoders(p)[0](normalize_images(x, mean, std), keep)
      return mu, logvar, labels

    self._images = jax.jit(images, out_shardings=out)
    self._texts = jax.jit(lambda p, t: encoders(p)[1](t), out_shardings=out)

  def on_mesh(self, params: Any) -> Any:
    """``params`` as the encoders take them: kept where they lie when
    already on the mesh, else replicated onto it."""
    leaves = jax.tree.leaves(params)
    if all(isinstance(x, jax.Array)
           and isinstance(x.sharding, jax.sharding.NamedSharding)
           and x.sharding.mesh == self.mesh for x in leaves):
      return params
    return jax.device_put(params, shd.replicated(self.mesh))

  def _global_batch(self, batch_size: int) -> tuple[int, int]:
    shards = shd.num_batch_shards(self.mesh)
    gb = max(1, math.ceil(batch_size / shards)) * shards
    return gb, gb // jax.process_count()

  def embed_images(self, params: Any, images: ImageSet, batch_size: int, *,
                   num_threads: int = 16, num_workers: int = 0,
                   keep_ratio: Optional[float] = None, seed: int = 0,
                   progress: Optional[Callable[[int, int], None]] = None
                   ) -> Embeddings:
    """Every image of ``images`` through the image encoder (eval view:
    shorter side to ``image_size``, centre crop), all devices, all hosts.
    ``keep_ratio`` < 1 keeps that fraction of each image's patch tokens
    (``uncertainty.keep_indices_for``: random, fixed by ``seed``)."""
    n = images.size
    if n == 0:
      raise ValueError(f'{images.name}: no images to evaluate')
    params = self.on_mesh(params)
    gb, local = self._global_batch(batch_size)
    num_batches = math.ceil(n / gb)
    size, view, order = self.image_size, self.image_view, self.image_order
    keep = None
    if keep_ratio is not None and keep_ratio < 1:
      keep = keep_indices_for(n, self.num_patches, keep_ratio, seed)

    def load(i):
      i = min(int(i), n - 1)  # padding repeats the last
      image, label = images.get(i)
      if not isinstance(image, np.ndarray):
        image = _read(image)
      out = {'image': pipeline.eval_images([image], size, view, order)[0],
             'label': np.int32(label)}
      if keep is not None:
        out['keep'] = keep[i]
      return out

    ds = (grain.MapDataset.range(num_batches * gb).map(load).batch(local)
          [jax.process_index()::jax.process_count()])
    it = ds.to_iter_dataset(grain.ReadOptions(
        num_threads=max(1, num_threads),
        prefetch_buffer_size=max(4, num_threads)))
    if num_workers > 0:
      it = it.mp_prefetch(grain.MultiprocessingOptions(
          num_workers=num_workers))
    t0 = time.time()
    mus, logvars, labels = [], [], []
    for k, local_batch in enumerate(it):
      batch = shd.host_to_global(self.mesh, local_batch)
      mu, logvar, lab = self._images(params, batch['image'],
                                     batch.get('keep'), batch['label'])
      mus.append(np.asarray(mu))
      labels.append(np.asarray(lab))
      if logvar is not None:
        logvars.append(np.asarray(logvar))
      if progress is not None:
        progress(min((k + 1) * gb, n), n)
    return Embeddings(np.concatenate(mus)[:n],
                      np.concatenate(logvars)[:n] if logvars else None,
                      np.concatenate(labels)[:n], time.time() - t0)

  def embed_tokens(self, params: Any, tokens: np.ndarray, batch_size: int,
                   progress: Optional[Callable[[int, int], None]] = None
                   ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Token rows ``(n, L)`` through the text encoder, all devices."""
    params = self.on_mesh(params)
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    gb, local = self._global_batch(batch_size)
    padded = math.ceil(n / gb) * gb
    tokens = np.concatenate([tokens, np.repeat(tokens[-1:], padded - n, 0)])
    p = jax.process_index()
    mus, logvars = [], []
    for start in range(0, padded, gb):
      mine = tokens[start + p * local:start + (p + 1) * local]
      mu, logvar = self._texts(params, shd.host_to_global(self.mesh, mine))
      mus.append(np.asarray(mu))
      if logvar is not None:
        logvars.append(np.asarray(logvar))
      if progress is not None:
        progress(min(start + gb, n), n)
    return (np.concatenate(mus)[:n],
            np.concatenate(logvars)[:n] if logvars else None)

  def embed_texts(self, params: Any, texts: Sequence[str], batch_size: int,
                  progress: Optional[Callable[[int, int], None]] = None
                  ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """Captions -> (mu ``(n, d)``, logvar or None)."""
    return self.embed_tokens(params, self.tokenizer(list(texts)), batch_size,
                             progress)


def _read(image: Any) -> bytes:
  if isinstance(image, (bytes, bytearray)):
    return bytes(image)
  with open(image, 'rb') as f:
    return f.read()


def from_training(objective, model: ProLIP, config, tokenizer, mesh
                  ) -> Encoders:
  """The encoders of a training run (its parameters are the train
  state's, passed at each call)."""
  return Encoders(
      lambda p: objective.encoders(model, p, config), tokenizer,
      image_size=model.config.vision.image_size, mean=config.data.mean,
      std=config.data.std, image_view=config.data.get('eval_view', 'default'),
      image_order=config.data.get('eval_image_order', 'rgb_first'),
      mesh=mesh, probabilistic=model.config.use_unc,
      num_patches=model.config.num_patches, train_data=config.data.name,
      extra_metrics=lambda embed_images, embed_texts:
      objective.heldout_metrics(embed_images, embed_texts,
                                model.config.vision.image_size))


def from_loaded(loaded, mesh) -> Encoders:
  """The encoders of a ``prolip_jax.load``-ed model; its parameters are
  ``loaded.params`` (replicated onto ``mesh`` when passed)."""
  run_data = (loaded.run_config.get('data') or {}).get('name', '')
  return Encoders(
      loaded.encoders_of, loaded.tokenizer,
      image_size=loaded.config.vision.image_size, mean=loaded.mean,
      std=loaded.std, image_view=loaded.image_view,
      image_order=loaded.image_order, mesh=mesh,
      probabilistic=loaded.config.use_unc,
      num_patches=loaded.config.num_patches, train_data=run_data,
      source=loaded.source)
