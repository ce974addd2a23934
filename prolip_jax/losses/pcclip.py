"""PC-CLIP: aligning image-embedding differences with difference texts.

Sam et al., "Finetuning CLIP to Reason about Pairwise Differences" (PC-CLIP).
g is the image encoder, f the text encoder (L2-normalised outputs).

* Eq. 1: min_{f,g} l( g(I_i) - g(I_j), f(T_ij) ), with T_ij a text describing
  how image i differs from image j, and l the CLIP contrastive loss (eq. 4,
  appendix B.2, over a batch of normalised image-difference and text
  embeddings, tau = 1.0 in all the paper's runs) or the squared loss (eq. 5).
* Eq. 2 (difference-based classification): image i is predicted to have more
  of the attribute described by T_ij than image j iff
  (g(I_i) - g(I_j)) . f(T_ij) >= (g(I_j) - g(I_i)) . f(T_ij).
* Eq. 3 (comparative prompting): f'_A = alpha f_A + (1 - alpha)(f_B - f_{B-A}),
  alpha = 0.9 in the paper's reported results.

The paper generates T_ij with an LLM from caption pairs. Here
``difference_texts`` / ``iter_difference_pairs`` build them from structured
attributes instead (pure Python, deterministic given a seed), with a schema for
the bundled MNIST digits (``DIGIT_SCHEMA``: the digit's value and the
thickness / width / position words of ``prolip_jax.data.digits``).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Iterator, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from prolip_jax.losses.contrastive import clip_loss

Array = jax.Array

PCCLIP_TAU = 1.0  # appendix C.1: temperature of the contrastive loss
PCCLIP_ALPHA = 0.9  # appendix C.1: comparative prompting weight reported

__all__ = ['difference_alignment_loss', 'difference_classify',
           'comparative_prompt', 'Attribute', 'DIGIT_SCHEMA',
           'difference_texts', 'difference_text', 'attribute_prompts',
           'iter_difference_pairs']


def _unit(x):
  x = jnp.asarray(x, jnp.float32)
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def difference_alignment_loss(img_i_emb: Array, img_j_emb: Array,
                              diff_txt_emb: Array,
                              scale: Array = 1.0 / PCCLIP_TAU,
                              squared: bool = False,
                              normalize: bool = True,
                              axis_name: Optional[Any] = None) -> Array:
  """PC-CLIP's objective (eq. 1 with eq. 4, or eq. 5 when ``squared``).

  x_k = g(I_i,k) - g(I_j,k) (L2-normalised when ``normalize``: eq. 4 says
  "a batch of normalized image and text (difference) embeddings"),
  y_k = f(T_ij,k), L2-normalised.

  * contrastive (default): CLIP's symmetric InfoNCE between the x's and y's,
    ``clip_loss(x, y, scale)`` with scale = 1/tau: the mean over the batch of
    eq. 4's per-pair term (eq. 4 as printed is the sum; multiply by B).
  * ``squared``: eq. 5, ||x_k - y_k||^2 summed over dimensions and averaged
    over the batch (eq. 5 sums over the batch).

  Args:
    img_i_emb, img_j_emb: ``(B, d)`` image embeddings g(I_i), g(I_j).
    diff_txt_emb: ``(B, d)`` embeddings f(T_ij) of the difference texts.
    scale: 1/tau (paper tau = 1.0).
    squared: use eq. 5 instead of eq. 4.
    normalize: L2-normalise the image difference (default, as eq. 4).
    axis_name: inside ``shard_map``, the mesh axis name(s) the pairs are
      sharded over (equal local batches): the result is then the loss of the
      global batch on every device (``clip_loss_blockwise`` for eq. 4).

  Returns:
    scalar float32 loss.
  """
  x = jnp.asarray(img_i_emb, jnp.float32) - jnp.asarray(img_j_emb,
                                                       jnp.float32)
  if normalize:
    x = _unit(x)
  y = _unit(diff_txt_emb)
  if squared:
    loss = jnp.mean(jnp.sum((x - y)**2, axis=-1))
    return loss if axis_name is None else jax.lax.pmean(loss, axis_name)
  if axis_name is None:
    return clip_loss(x, y, scale)
  from prolip_jax.losses.blockwise import clip_loss_blockwise  # pylint: disable=g-import-not-at-top
  return clip_loss_blockwise(x, y, scale, axis_name)


def difference_classify(img_i_emb: Array, img_j_emb: Array,
                        attr_txt_emb: Array) -> Array:
  """Eq. 2: does image i have more of the attribute than image j?

  1{ (g(I_i) - g(I_j)) . f(T) >= (g(I_j) - g(I_i)) . f(T) }, equivalently
  (g(I_i) - g(I_j)) . f(T) >= 0. ``T`` is phrased about the FIRST image
  ("the first image is larger"); True predicts that image i is the one.

  Args:
    img_i_emb, img_j_emb: ``(..., d)`` image embeddings.
    attr_txt_emb: ``(..., d)`` attribute text embeddings (broadcastable, e.g.
      one ``(d,)`` prompt for every pair).

  Returns:
    bool array of the broadcast batch shape.
  """
  gi, gj, f = (jnp.asarray(x, jnp.float32) for x in (img_i_emb, img_j_emb,
                                                     attr_txt_emb))
  return jnp.sum((gi - gj) * f, -1) >= jnp.sum((gj - gi) * f, -1)


def comparative_prompt(f_a: Array, f_b: Array, f_b_minus_a: Array,
                       alpha: float = PCCLIP_ALPHA,
                       normalize: bool = False) -> Array:
  """Eq. 3: f'_A = alpha f_A + (1 - alpha)(f_B - f_{B-A}).

  Args:
    f_a, f_b: ``(..., d)`` class-prompt text embeddings of classes A and B.
    f_b_minus_a: ``(..., d)`` embedding of the text describing how B differs
      from A.
    alpha: reliance on the original prompt (paper reports 0.9).
    normalize: L2-normalise the result (the paper does not; cosine-based
      zero-shot classification is unaffected either way).

  Returns:
    the updated class prompt embedding, ``(..., d)`` float32.
  """
  f_a, f_b, f_ba = (jnp.asarray(x, jnp.float32) for x in (f_a, f_b,
                                                          f_b_minus_a))
  out = alpha * f_a + (1.0 - alpha) * (f_b - f_ba)
  return _unit(out) if normalize else out


# ----------------------------------------------------------------------------
# Difference texts from structured attributes (pure Python)


@dataclasses.dataclass(frozen=True)
class Attribute:
  """How one attribute compares across a pair of images.

  ``levels`` orders the values of an ordinal attribute (None: numeric, values
  compared directly, or categorical when ``more``/``less`` are None).
  ``more`` / ``less`` describe the FIRST image having the higher / lower
  value; ``categorical`` is a template with ``{a}`` (first) and ``{b}``
  (second) for unordered values.
  """
  name: str
  levels: Optional[tuple[Any, ...]] = None
  more: Optional[str] = None
  less: Optional[str] = None
  categorical: Optional[str] = None

  def compare(self, a: Any, b: Any) -> Optional[str]:
    """The phrase for (first = a, second = b), or None when equal."""
    if a == b:
      return None
    if self.more is None:
      return self.categorical.format(a=a, b=b)
    if self.levels is not None:
      a, b = self.levels.index(a), self.levels.index(b)
    return self.more if a > b else self.less


DIGIT_SCHEMA: tuple[Attribute, ...] = (
    Attribute('digit', None,
              'the first digit is larger than the second',
              'the first digit is smaller than the second'),
    Attribute('thickness', ('thin', 'medium', 'thick'),
              'the first is drawn with thicker strokes',
              'the first is drawn with thinner strokes'),
    Attribute('width', ('narrow', 'regular', 'wide'),
              'the first digit is wider than the second',
              'the first digit is narrower than the second'),
    Attribute('position', ('left', 'center', 'right'),
              'the first digit sits further to the right',
              'the first digit sits further to the left'),
)


def difference_texts(attrs_first: Mapping[str, Any],
                     attrs_second: Mapping[str, Any],
                     schema: Sequence[Attribute] = DIGIT_SCHEMA) -> list[str]:
  """One phrase per attribute that differs, in schema order.

  Attributes missing from either mapping are skipped. E.g. for digits
  ``{'digit': 7, 'thickness': 'thick', ...}`` vs ``{'digit': 2, 'thickness':
  'thin', ...}`` -> ['the first digit is larger than the second', 'the first
  is drawn with thicker strokes', ...].
  """
  out = []
  for attr in schema:
    if attr.name in attrs_first and attr.name in attrs_second:
      phrase = attr.compare(attrs_first[attr.name], attrs_second[attr.name])
      if phrase is not None:
        out.append(phrase)
  return out


def difference_text(attrs_first: Mapping[str, Any],
                    attrs_second: Mapping[str, Any],
                    schema: Sequence[Attribute] = DIGIT_SCHEMA,
                    max_phrases: Optional[int] = None) -> Optional[str]:
  """The difference phrases joined into one caption T_ij ('; ' then ' and '),
  or None when the two images do not differ in any schema attribute."""
  phrases = difference_texts(attrs_first, attrs_second, schema)
  if max_phrases is not None:
    phrases = phrases[:max_phrases]
  if not phrases:
    return None
  if len(phrases) == 1:
    return phrases[0]
  return ', '.join(phrases[:-1]) + ' and ' + phrases[-1]


def attribute_prompts(schema: Sequence[Attribute] = DIGIT_SCHEMA
                      ) -> dict[str, str]:
  """Per ordered attribute, the 'first has more' text for eq. 2's T."""
  return {a.name: a.more for a in schema if a.more is not None}


def iter_difference_pairs(attributes: Sequence[Mapping[str, Any]],
                          seed: int = 0,
                          schema: Sequence[Attribute] = DIGIT_SCHEMA,
                          max_phrases: Optional[int] = None,
                          max_tries: int = 100
                          ) -> Iterator[tuple[int, int, str]]:
  """Endless stream of ``(i, j, T_ij)``: random ordered pairs i != j of
  differing items with their difference caption.

  Args:
    attributes: per-item attribute mappings (e.g. digit records' attributes
      plus ``'digit': label``).
    seed: seed of the Python RNG drawing the pairs (deterministic stream).
    schema, max_phrases: see ``difference_text``.
    max_tries: give up (StopIteration) after this many consecutive draws of
      identical pairs, e.g. when every item is the same.
  """
  rng = random.Random(seed)
  n = len(attributes)
  if n < 2:
    return
  misses = 0
  while misses < max_tries:
    i, j = rng.sample(range(n), 2)
    text = difference_text(attributes[i], attributes[j], schema, max_phrases)
    if text is None:
      misses += 1
      continue
    misses = 0
    yield i, j, text
