"""Uncertainty-aware image-text pair filtering (paper C.8, "ProLIP distance").

Each record (an image and its caption) is scored by how well the two match
under the probabilistic embedding:

  score = -CSD(Z_v, Z_t) - w_v sigma_v^2 - w_t sigma_t^2
        = -(||mu_v - mu_t||^2 + sigma_v^2 + sigma_t^2) - w_v sigma_v^2
          - w_t sigma_t^2,

higher is better; ``w_v = w_t = 0`` is the plain CSD of the paper, positive
weights additionally penalise uncertain images or captions (e.g. captions
that fit anything). The top ``keep_fraction`` of the records by score are
kept and their keys written one per line.

Scale-out. ``make_scorer`` returns a function jitted over a batch sharded on
the mesh's batch axes (``sharding.batch_sharding``), with the parameters
replicated. ``score_records`` is a per-host loop: host p scores records
``p, p + P, p + 2P, ...`` in fixed-size local batches (the last one padded
and masked), every host runs the same number of steps (the collective needs
it), and each host reads back only its own rows. For several hosts, each
writes ``write_scores(.../scores-{p:05d}-of-{P:05d}.jsonl)`` and one process
then runs ``select_from_score_files`` on all of them (the threshold is a
global quantile, so selection needs every score).
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax import plotting

from prolip_jax import sharding as sharding_lib


def pair_scores(img_mu, img_logvar, txt_mu, txt_logvar, w_img: float = 0.0,
                w_txt: float = 0.0) -> jax.Array:
  """Row-aligned pair scores ``(n,)`` (see module docstring), float32."""
  img_mu, img_logvar, txt_mu, txt_logvar = (
      jnp.asarray(a, jnp.float32) for a in (img_mu, img_logvar, txt_mu,
                                            txt_logvar))
  s_v = jnp.sum(jnp.exp(img_logvar), -1)
  s_t = jnp.sum(jnp.exp(txt_logvar), -1)
  d = jnp.sum((img_mu - txt_mu)**2, -1) + s_v + s_t
  return -d - w_img * s_v - w_txt * s_t


def num_kept(n: int, keep_fraction: float) -> int:
  """``round(keep_fraction * n)`` records, at least 0 and at most n."""
  if not 0 <= keep_fraction <= 1:
    raise ValueError(f'keep_fraction must be in [0, 1], got {keep_fraction}')
  return min(n, max(0, int(math.floor(keep_fraction * n + 0.5))))


def select(keys: Sequence[str], scores, keep_fraction: float) -> list[str]:
  """Keys of the ``num_kept`` best-scoring records, best first (ties: input
  order)."""
  scores = np.asarray(scores, np.float64)
  if len(keys) != len(scores):
    raise ValueError(f'{len(keys)} keys but {len(scores)} scores')
  order = np.argsort(-scores, kind='stable')
  return [keys[i] for i in order[:num_kept(len(keys), keep_fraction)]]


def write_keys(path: str, keys: Iterable[str]) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for k in keys:
      f.write(f'{k}\n')
  return path


def write_scores(path: str, keys: Sequence[str], scores) -> str:
  """One JSON line ``{"key", "score"}`` per record."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for k, s in zip(keys, np.asarray(scores, np.float64)):
      f.write(json.dumps({'key': k, 'score': float(s)}) + '\n')
  return path


def select_from_score_files(paths: Sequence[str], keep_fraction: float,
                            out_path: Optional[str] = None) -> list[str]:
  """Global selection over every host's ``write_scores`` file."""
  keys, scores = [], []
  for p in sorted(paths):
    with open(p, encoding='utf-8') as f:
      for line in f:
        if line.strip():
          obj = json.loads(line)
          keys.append(obj['key'])
          scores.append(obj['score'])
  kept = select(keys, scores, keep_fraction)
  if out_path:
    write_keys(out_path, kept)
  return kept


@functools.lru_cache(maxsize=32)
def _jitted_scorer(config_json: str, mean: tuple, std: tuple, w_img: float,
                   w_txt: float, mesh):
  """One compiled scorer per (model architecture, weights, mesh): repeated
  ``score_records`` calls reuse it."""
  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import ModelConfig
  from prolip_jax.models import ProLIP
  # pylint: enable=g-import-not-at-top
  net = ProLIP(ModelConfig.from_config(json.loads(config_json)))
  mean_a = jnp.asarray(mean, jnp.float32)
  std_a = jnp.asarray(std, jnp.float32)

  def score(params, images, tokens):
    x = (images.astype(jnp.float32) / 255.0 - mean_a) / std_a
    v_mu, v_lv = net.apply({'params': params}, x, method='encode_image')
    t_mu, t_lv = net.apply({'params': params}, tokens, method='encode_text')
    if v_lv is None or t_lv is None:
      raise ValueError('filtering needs a probabilistic model (logvar)')
    return pair_scores(v_mu, v_lv, t_mu, t_lv, w_img, w_txt)

  if mesh is None:
    return jax.jit(score)
  batch = sharding_lib.batch_sharding(mesh)
  rep = sharding_lib.replicated(mesh)
  return jax.jit(score, in_shardings=(rep, batch, batch), out_shardings=batch)


def make_scorer(model, mesh=None, w_img: float = 0.0, w_txt: float = 0.0
                ) -> Callable[[Any, Any], jax.Array]:
  """``fn(images (b, s, s, 3) uint8, tokens (b, L) int32) -> scores (b,)``.

  ``model``: a ``prolip_jax.interop.load.LoadedModel`` (config, params,
  mean/std). With ``mesh`` the function is jitted with the batch split over
  the mesh's batch axes and the parameters replicated; inputs may be host
  arrays (the global batch) or global ``jax.Array``s built with
  ``sharding.host_to_global``.
  """
  fn = _jitted_scorer(json.dumps(model.config.to_dict(), sort_keys=True),
                      tuple(model.mean), tuple(model.std), float(w_img),
                      float(w_txt), mesh)
  params = model.params
  if mesh is not None:
    params = jax.device_put(params, sharding_lib.replicated(mesh))
  return lambda images, tokens: fn(params, images, tokens)


def _local_rows(x: jax.Array) -> np.ndarray:
  """This host's rows of a batch-sharded global array, in order."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
  seen, rows = set(), []
  for s in shards:
    start = s.index[0].start or 0
    if start not in seen:  # replicas along non-batch axes hold equal rows
      seen.add(start)
      rows.append(np.asarray(s.data))
  return np.concatenate(rows)


def record_caption(record: dict, caption_index: int = 0) -> str:
  if 'captions' in record:
    return record['captions'][caption_index]
  return record['caption']


def score_records(model, records: Sequence[dict], batch_size: int = 256,
                  mesh=None, w_img: float = 0.0, w_txt: float = 0.0,
                  caption_index: int = 0,
                  process_index: Optional[int] = None,
                  process_count: Optional[int] = None,
                  progress: Optional[Callable[[int, int], None]] = None
                  ) -> tuple[list[str], np.ndarray]:
  """Scores this host's share of ``records``.

  Args:
    model: a ``LoadedModel``.
    records: random-access records with ``image`` (array or encoded bytes),
      ``caption`` or ``captions``, and ``key`` (defaults to the index).
    batch_size: global batch per step (divisible by the number of processes
      and, with ``mesh``, by its batch shards).
    mesh: optional mesh; the batch is split over its batch axes.
    w_img, w_txt: sigma^2 penalties (see ``pair_scores``).
    caption_index: which of ``captions`` to score.
    process_index, process_count: host p takes records p, p + P, ...
      (default: ``jax.process_index()`` / ``jax.process_count()``).
    progress: called with (step, num_steps).

  Returns:
    (keys, scores ``(n_local,)``) for this host's records, in record order.
  """
  from prolip_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  p = jax.process_index() if process_index is None else process_index
  n_proc = jax.process_count() if process_count is None else process_count
  local_bs = batch_size // n_proc
  if local_bs * n_proc != batch_size:
    raise ValueError(f'batch_size {batch_size} not divisible by {n_proc} '
                     'processes')
  mine = list(range(p, len(records), n_proc))
  per_host = -(-len(records) // n_proc)  # the same on every host
  num_steps = -(-per_host // local_bs)
  scorer = make_scorer(model, mesh, w_img, w_txt)
  size = model.config.vision.image_size
  keys, scores = [], []
  for step in range(num_steps):
    idx = mine[step * local_bs:(step + 1) * local_bs]
    real = len(idx)
    pad_idx = idx + [idx[-1] if idx else (mine[-1] if mine else 0)] * (
        local_bs - real)
    recs = [records[i] for i in pad_idx] if records else []
    images = pipeline.eval_images([r['image'] for r in recs], size)
    tokens = model.tokenizer([record_caption(r, caption_index)
                              for r in recs])
    if mesh is not None and n_proc > 1:
      images, tokens = sharding_lib.host_to_global(mesh, (images, tokens))
    out = _local_rows(scorer(images, tokens))[:real]
    scores.append(out)
    keys += [str(records[i].get('key', i)) for i in idx]
    if progress:
      progress(step + 1, num_steps)
  return keys, (np.concatenate(scores) if scores
                else np.zeros((0,), np.float32))


@plotting.styled
def fig_scores(scores, threshold: float,
               corrupted: Optional[np.ndarray] = None):
  """Histogram of pair scores with the keep threshold (1 axis); with
  ``corrupted`` (bool per record) clean and corrupted pairs are drawn
  separately."""
  plt = plotting.pyplot()
  scores = np.asarray(scores)
  fig, ax = plt.subplots(figsize=(6, 3.4))
  bins = np.linspace(scores.min(), scores.max(), 50)
  if corrupted is None:
    ax.hist(scores, bins=bins, color='tab:blue', alpha=0.8, label='pairs')
  else:
    corrupted = np.asarray(corrupted, bool)
    ax.hist(scores[~corrupted], bins=bins, color='tab:blue', alpha=0.7,
            label='original pairs')
    ax.hist(scores[corrupted], bins=bins, color='tab:red', alpha=0.7,
            label='shuffled captions')
  ax.axvline(threshold, color='black', ls='--', lw=1, label='keep threshold')
  ax.legend()
  ax.set_xlabel('score = −CSD(image, caption)')
  ax.set_ylabel('records')
  ax.set_title('pair filtering: records right of the line are kept')
  return fig
