"""PC-CLIP (Sam et al.): CLIP plus the difference-alignment term (eq. 1).

Besides image-caption pairs, every step embeds a batch of image pairs
(I_i, I_j) with a text T_ij describing how they differ (``data.pairs``) and
adds ``loss.pcclip_weight`` times eq. 1 (with eq. 4's similarity, or eq. 5's
squared form). The difference texts' words go into the tokenizer's corpus.
The loop's held-out evaluation adds its difference-based classification
(eq. 2, ``difference_classification_digits``) through
``train_eval_metrics``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from prolip_jax import sharding as shd
from prolip_jax.applications.pcclip import difference_classify
from prolip_jax.data import digits
from prolip_jax.data import pairs
from prolip_jax.data import pipeline
from prolip_jax.embedding import normalize_images
from prolip_jax.losses import difference_alignment_loss
from prolip_jax.objectives.base import LossParts
from prolip_jax.objectives.clip import CLIPObjective

# Fields of config.loss that PC-CLIP reads.
LOSS_FIELDS = ('pcclip_weight', 'pcclip_tau', 'pcclip_squared',
               'pcclip_max_phrases')


def pcclip_pair_loss(encode_image: Callable, encode_text: Callable,
                     batch: dict, loss_cfg, mesh=None
                     ) -> tuple[jax.Array, dict]:
  """PC-CLIP's difference term (eq. 1 with eq. 4, or eq. 5) on a pair batch.

  Args:
    encode_image: uint8 ``(n, s, s, 3)`` images -> ``(n, d)`` normalised
      embeddings g(I).
    encode_text: ``(n, L)`` tokens -> ``(n, d)`` normalised embeddings f(T).
    batch: with ``pair_image_i``, ``pair_image_j`` ``(B, s, s, 3)`` and
      ``pair_tokens`` ``(B, L)`` (``data.pairs``).
    loss_cfg: ``pcclip_tau`` (1/scale of eq. 4) and ``pcclip_squared``.
    mesh: with several batch shards, the term runs in ``shard_map`` on the
      ring (``difference_alignment_loss(..., axis_name)``).

  Returns:
    the unweighted term (scalar) and ``{'pcclip_diff': term,
    'pcclip_diff_acc': ...}``; the accuracy is eq. 2 with T = T_ij itself (a
    cheap training-time signal, chance 50%).
  """
  return pair_term(*embed_pairs(encode_image, encode_text,
                                batch['pair_image_i'], batch['pair_image_j'],
                                batch['pair_tokens']), loss_cfg, mesh)


def embed_pairs(encode_image: Callable, encode_text: Callable,
                image_i: jax.Array, image_j: jax.Array, tokens: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(g_i, g_j, f)``, each ``(B, d)``: both images of each pair and its
  difference text embedded (row-wise: row k depends on the pair k alone)."""
  b = image_i.shape[0]
  # One image forward pass for both sides of the pairs.
  g = encode_image(jnp.concatenate([image_i, image_j]))
  return g[:b], g[b:], encode_text(tokens)


def pair_term(g_i: jax.Array, g_j: jax.Array, f: jax.Array, loss_cfg,
              mesh=None) -> tuple[jax.Array, dict]:
  """Eq. 1's term and its metrics (``pcclip_pair_loss``) over the pair
  batch's embeddings ``(B, d)`` each."""
  kwargs = dict(scale=1.0 / loss_cfg.pcclip_tau,
                squared=bool(loss_cfg.pcclip_squared))
  if mesh is None or shd.num_batch_shards(mesh) == 1:
    term = difference_alignment_loss(g_i, g_j, f, **kwargs)
  else:
    batch_spec = P(shd.BATCH_AXES)
    term = jax.shard_map(
        lambda a, b_, c: difference_alignment_loss(
            a, b_, c, axis_name=shd.BATCH_AXES, **kwargs),
        mesh=mesh, in_specs=(batch_spec,) * 3, out_specs=P())(g_i, g_j, f)
  acc = jnp.mean(difference_classify(g_i, g_j, f))
  return term, {'pcclip_diff': term, 'pcclip_diff_acc': acc}


def digits_eval_images(split: str, image_size: int
                       ) -> tuple[np.ndarray, np.ndarray]:
  """Eval views ``(n, s, s, 3)`` uint8 of a digits split, and its labels."""
  images, labels = digits.split(split)
  return pipeline.eval_images(np.repeat(images[..., None], 3, -1),
                              image_size), labels


def difference_classification_digits(embed_images: Callable,
                                     embed_texts: Callable, image_size: int,
                                     num_pairs: int = 500, seed: int = 0,
                                     split: str = 'heldout'
                                     ) -> dict[str, float]:
  """PC-CLIP's difference-based classification (eq. 2) on the digits.

  For each ordered attribute of ``data.pairs.DIGIT_SCHEMA`` that varies
  over ``split`` (digit value, thickness, width; the bundled digits are all
  centred, so position never differs): ``num_pairs`` random ordered pairs of
  ``split`` images that differ in it, the prompt T = the attribute's "first
  has more" phrase (e.g. "the first digit is larger than the second"), and
  the prediction 1{(g(I_i) - g(I_j)) . f(T) >= 0}. Chance is 50%.

  Args:
    embed_images: uint8 images ``(n, s, s, 3)`` -> (mu ``(n, d)``, logvar).
    embed_texts: captions -> (mu ``(m, d)``, logvar).
    image_size: the model's image size.

  Returns:
    ``{'diff_acc/<attribute>': accuracy, 'diff_acc': their mean}``.
  """
  images, _ = digits_eval_images(split, image_size)
  attrs = digits.attributes(split)
  g, _ = embed_images(images)
  out = {}
  for attr in pairs.DIGIT_SCHEMA:
    if attr.more is None:
      continue
    f_t = np.asarray(embed_texts([attr.more])[0])[0]
    i, j, truth = pairs.difference_eval_pairs(attrs, attr, num_pairs, seed)
    if not len(i):  # no two images differ in it: nothing to rank
      continue
    pred = np.asarray(difference_classify(g[i], g[j], f_t))
    out[f'diff_acc/{attr.name}'] = float(np.mean(pred == truth))
  out['diff_acc'] = float(np.mean(list(out.values())))
  return out


class PCCLIPObjective(CLIPObjective):
  """loss = CLIP(img, txt) + ``loss.pcclip_weight`` * eq. 1's term."""

  name = 'pcclip'
  # The demos: CLIP's (the temperature init) and the declared loss.pcclip_*
  # defaults, i.e. weight 1 and tau = 1 (appendix C.1) and one differing
  # attribute per T_ij: with the 256-piece demo tokenizer one phrase is
  # 15-26 tokens, and two would not fit the 32-token context.
  demo_settings = CLIPObjective.demo_settings

  def validate(self, config) -> None:
    super().validate(config)
    if config.model.use_unc:
      raise ValueError("objective 'pcclip' uses deterministic towers: set "
                       'model.use_unc=False (see configs/pcclip_tiny.py)')
    missing = [k for k in LOSS_FIELDS if k not in config.loss]
    if missing:
      raise ValueError(f"objective 'pcclip' needs config.loss.{missing[0]} "
                       f'(all of {LOSS_FIELDS}; defaults in '
                       "demos.tiny_demo_config('pcclip'))")
    if config.loss.pcclip_weight < 0:
      raise ValueError('loss.pcclip_weight must be >= 0, got '
                       f'{config.loss.pcclip_weight}')
    if config.loss.pcclip_tau <= 0:
      raise ValueError('loss.pcclip_tau must be > 0 (the paper uses 1.0), got '
                       f'{config.loss.pcclip_tau}')
    if int(config.loss.pcclip_max_phrases) < 0:
      raise ValueError('loss.pcclip_max_phrases must be >= 0 (0: every '
                       f'difference), got {config.loss.pcclip_max_phrases}')
    if config.data.get('sources'):
      raise ValueError("objective 'pcclip' builds its difference pairs from "
                       'one source (data.name), not a mixture '
                       '(data.sources)')
    if config.data.name != 'digits':
      raise ValueError("objective 'pcclip' builds its difference pairs from "
                       "per-record attributes, which only data.name='digits' "
                       f'has for now (got {config.data.name!r})')

  def extend_corpus(self, corpus):
    # Difference texts are tokenized too: give their words pieces.
    return lambda: corpus() + pairs.difference_corpus()

  def wrap_dataset(self, config, dataset, source, tokenizer, image_size: int,
                   process_index: int, process_count: int):
    return pairs.pcclip_train_dataset(config, dataset, source, tokenizer,
                                      image_size, process_index,
                                      process_count)

  def make_loss_parts(self, model, config, mesh, mask_id: int):
    """CLIP's parts plus the pair batch: its images and difference texts
    are rows of the towers too (split like the pairs by ``accum_steps``),
    eq. 1's term is added in the loss."""
    clip = super().make_loss_parts(model, config, mesh, mask_id)
    loss_cfg = config.loss
    mean, std = config.data.mean, config.data.std

    def inputs(batch, rng):
      return dict(clip.inputs(batch, rng),
                  pair_image_i=normalize_images(batch['pair_image_i'],
                                                mean, std),
                  pair_image_j=normalize_images(batch['pair_image_j'],
                                                mean, std),
                  pair_tokens=batch['pair_tokens'])

    def towers(params, teacher, rows):
      apply = functools.partial(model.apply, {'params': params})
      pairs_out = embed_pairs(
          lambda x: apply(x, method='encode_image')[0],
          lambda t: apply(t, method='encode_text')[0], rows['pair_image_i'],
          rows['pair_image_j'], rows['pair_tokens'])
      return clip.towers(params, teacher, rows), pairs_out

    def loss(params, outs, batch):
      clip_outs, pairs_out = outs
      value, metrics = clip.loss(params, clip_outs, batch)
      term, extra = pair_term(*pairs_out, loss_cfg, mesh)
      value = value + loss_cfg.pcclip_weight * term
      return value, dict(metrics, **extra, loss=value)

    return LossParts(inputs, towers, loss)

  def heldout_metrics(self, embed_images, embed_texts, image_size: int):
    return difference_classification_digits(embed_images, embed_texts,
                                            image_size)
