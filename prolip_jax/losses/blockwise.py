"""Cross-device (blockwise) forms of the pairwise sigmoid losses.

The functions here are called *inside* a ``shard_map`` (the user's own, or the
library's train step) on the LOCAL shard of a data-parallel batch: every device
holds ``b_local`` row-aligned image/text pairs, ``B = b_local * N`` over the
``N`` devices of ``axis_name``. Each returns the loss of the GLOBAL batch,
identical on every device and equal, up to float32 summation order, to the
single-device function applied to the gathered batch:

  ppcl_loss_blockwise  == ppcl_loss   (ProLIP eq. 2, logits of appendix A.1)
  siglip_loss_blockwise == siglip_loss (SigLIP eq. 1)
  prolip_loss_blockwise == prolip_loss (ProLIP eq. 6)

i.e. ``-(1/B) sum_{i,j < B} log sigmoid(y_ij * logit_ij)`` over all B x B
pairs, y_ij = +1 only for i == j.

Algorithm (SigLIP's "chunked" sigmoid loss, Zhai et al. 2023, section 3.3).
Images never move. The text block (``mu_txt`` and ``logvar_txt``, or
``emb_txt``) travels around the devices with ``jax.lax.ppermute``, in its
input dtype. Each device scores every text block once against its own images:
the own block is the only one holding its positives (its diagonal), every
foreign block is all negatives. The local partial sums are ``psum``-ed once at
the end and divided by ``B``.

The ring is bidirectional: each round sends one copy of the block to the right
and one to the left, so after round k a device holds the blocks of devices
i - k and i + k, and the ``N - 1`` foreign blocks arrive in ``N // 2`` rounds
instead of ``N - 1``, using both directions of every link. Two classic
pitfalls of this scheme are avoided:

1. Double counting the antipodal block. For even N the two copies meet at
   k = N/2 (i - N/2 == i + N/2 mod N). Only ``(N - 1) // 2`` rounds are
   bidirectional; for even N one extra ONE-directional hop follows.
2. Scoring a stale block. That extra hop must score the block it has just
   received (the right-going buffer permuted once more: device i - N/2), not
   the right-going buffer of the previous round, which was already counted.

``tests/test_blockwise.py`` checks that each device visits every block exactly
once (and only its own with positives) for N = 1, 2, 3, 4, 5, 8 and for tuple
axes, besides checking losses and gradients against the dense functions.

Memory (eq. 2's logits are the only O(batch^2) quantity). The gathered
alternative -- all-gather the texts, then score the local ``b_local x B``
logits -- holds O(b_local * B) = O(N * b_local^2) floats per device, for the
logits and again for their cotangents. Here one ``b_local x b_local`` block is
scored at a time, so logits memory is O(b_local^2) per device whatever N:

* the rounds run in a ``lax.fori_loop`` (a scan under reverse-mode AD), and
  each round scores its two blocks in an inner two-step loop; the blocks left
  at the end (the antipodal one for even N, then the own one) in one more.
  Loops are the ordering XLA keeps: it may drop ``optimization_barrier`` and
  interleave independent straight-line scorings, holding several blocks;
* each scoring is wrapped in ``jax.checkpoint``, so the backward pass
  recomputes a block's logits instead of the scan stacking all N of them.
  What it does keep per block is the received text block, O(b_local * d),
  i.e. O(B * d) in all: the size of the embeddings, not of the logits;
* the own block's positives are expressed with a possibly traced ``is_own``
  flag (negate its diagonal logits, then score every pair as a negative:
  -log sigmoid(-(-z)) is -log sigmoid(z) exactly), so the own block can be
  scored inside the same loops as the others.

``benchmarks/blockwise_memory.py`` compiles both forms at B = 16,384 on 8 host
devices: per-device temporaries are about 0.18x (value) and 0.17x (value and
grad) those of the gathered form.

Gradients flow through ``ppermute`` (its transpose is the inverse
permutation), so ``jax.grad`` of these losses -- outside the ``shard_map`` or
inside it -- is the gradient of the global loss. Inside ``shard_map`` this
relies on ``check_vma=True`` (the default): it makes the transpose of the
final ``psum`` a no-op and sums the gradients of replicated ``scale``/``bias``
over devices.

``axis_name`` is one mesh axis name or a tuple of them (e.g.
``('data', 'fsdp')``); the ring then runs over the devices of all those axes
in ``ppermute``'s linear order (the order of ``lax.axis_index`` on the same
tuple). The losses need no device index: the positives live in the block a
device starts with, and every ring is a single N-cycle, so the result does
not depend on how the tuple is linearised.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from prolip_jax.losses.contrastive import infonce_terms
from prolip_jax.losses.contrastive import siglip_logits
from prolip_jax.losses.probabilistic import ALPHA1
from prolip_jax.losses.probabilistic import ALPHA2
from prolip_jax.losses.probabilistic import BETA
from prolip_jax.losses.probabilistic import combine_prolip_terms
from prolip_jax.losses.probabilistic import GaussianBatch
from prolip_jax.losses.probabilistic import INCLUSION_C
from prolip_jax.losses.probabilistic import INCLUSION_EPS
from prolip_jax.losses.probabilistic import ppcl_logits
from prolip_jax.losses.probabilistic import prolip_regularizers
from prolip_jax.losses.probabilistic import sigmoid_pairwise_loss_sum

Array = jax.Array
AxisName = Union[str, Sequence[str]]

__all__ = ['clip_loss_blockwise', 'ppcl_loss_blockwise',
           'siglip_loss_blockwise',
           'prolip_loss_blockwise']


def hashable_axis(axis_name: AxisName):
  """A hashable axis name: one name, or a tuple of names."""
  if isinstance(axis_name, (list, tuple)):
    return tuple(axis_name)
  return axis_name


def _axis_size(axis_name) -> int:
  """Number of devices along ``axis_name`` (a name or a tuple of names)."""
  return int(jax.lax.axis_size(axis_name))


def _ring_sum(block_fn: Callable[[Any, Any], Any], txt: Any,
              axis_name) -> Any:
  """Local sum of ``block_fn(block, is_own)`` over every text block once.

  ``txt`` is this device's text block (any pytree of arrays). ``block_fn`` is
  applied to each of the N text blocks of the axis exactly once, with
  ``is_own`` (a boolean scalar, possibly traced) true only for this device's
  own block; the results (pytrees of arrays) are summed. Nothing is reduced
  across devices.

  Schedule: the bidirectional rounds (module docstring) run in a
  ``fori_loop``; each round scores its two blocks in an inner two-step loop,
  and the blocks left at the end -- the antipodal block for even N, then the
  own block -- are scored in one more such loop. Loops are the only ordering
  XLA always keeps (it may drop ``optimization_barrier`` and reorder
  straight-line code), so one block is scored at a time; each scoring is
  rematerialised in the backward pass, which therefore also holds one block's
  intermediates at a time.
  """
  n = _axis_size(axis_name)
  score = jax.checkpoint(block_fn, prevent_cse=False)
  add = lambda a, b: jax.tree.map(jnp.add, a, b)

  to_right = [(j, (j + 1) % n) for j in range(n)]  # device j -> j + 1
  to_left = [(j, (j - 1) % n) for j in range(n)]  # device j -> j - 1

  def send(tree, perm):
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)

  def score_in_turn(total, blocks, own_at=None):
    """Adds the scores of ``blocks`` (a list of blocks) one after another."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)

    def step(j, total):
      block = jax.tree.map(lambda x: x[j], stacked)
      is_own = jnp.asarray(False) if own_at is None else j == own_at
      return add(total, score(block, is_own))

    return jax.lax.fori_loop(0, len(blocks), step, total)

  # A device-varying zero accumulator shaped like one block's result.
  shapes = jax.eval_shape(block_fn, txt, jnp.asarray(False))
  total = jax.tree.map(
      lambda s: jax.lax.pcast(jnp.zeros(s.shape, s.dtype), axis_name,
                              to='varying'), shapes)

  def round_(_, carry):
    total, from_left, from_right = carry
    from_left = send(from_left, to_right)  # now holds block i - k
    from_right = send(from_right, to_left)  # now holds block i + k
    total = score_in_turn(total, [from_left, from_right])
    return total, from_left, from_right

  # Rounds k = 1 .. (N - 1) // 2 visit blocks i - k and i + k, all distinct.
  total, from_left, _ = jax.lax.fori_loop(0, (n - 1) // 2, round_,
                                          (total, txt, txt))
  if n % 2 == 0:
    # Even N: block i - N/2 == i + N/2 is left. One ONE-directional hop; the
    # block to score is the one it has just received (``antipodal``), not
    # ``from_left`` of the last round, which was already counted.
    antipodal = send(from_left, to_right)
    return score_in_turn(total, [antipodal, txt], own_at=1)
  return score_in_turn(total, [txt], own_at=0)


def varying(tree: Any, axis_name) -> Any:
  """Marks every leaf device-varying over ``axis_name`` (fori_loop carries
  must keep one type; e.g. zero potentials start out replicated)."""
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

  def cast(x):
    aval = jax.typeof(x)
    vma = (aval.manual_axis_type.varying if hasattr(aval, 'manual_axis_type')
           else aval.vma)
    missing = tuple(a for a in names if a not in vma)
    return jax.lax.pcast(x, missing, to='varying') if missing else x

  return jax.tree.map(cast, tree)


def ring_fold(fn: Callable[[Any, Any, bool], Any], payload: Any, init: Any,
              axis_name) -> Any:
  """Folds ``fn(acc, block, is_own)`` over the N blocks of ``payload``.

  This device's own block comes first (``is_own=True``, a Python bool), then
  the blocks of devices i-1, i-2, ..., i-(N-1), each received by one
  ``ppermute`` hop to the right. ``fn`` is rematerialised in the backward
  pass, so at most one block's intermediates are alive at a time.
  """
  n = int(jax.lax.axis_size(axis_name))
  perm = [(j, (j + 1) % n) for j in range(n)]
  step = jax.checkpoint(fn, static_argnums=(2,), prevent_cse=False)
  payload = varying(payload, axis_name)
  acc = varying(step(init, payload, True), axis_name)

  def body(_, carry):
    acc, block = carry
    block = jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm),
                         block)
    return step(acc, block, False), block

  acc, _ = jax.lax.fori_loop(0, n - 1, body, (acc, payload))
  return acc


def clip_loss_blockwise(emb_img: Array, emb_txt: Array, scale: Array,
                        axis_name: AxisName) -> Array:
  """``clip_loss`` of the global batch from this device's shard.

  CLIP's symmetric InfoNCE needs, per row, a logsumexp over the B - 1
  negatives in each direction; each row's term is then
  ``softplus(lse_negatives - positive)`` (``contrastive.infonce_terms``:
  no cancellation when the positive dominates, unlike logsumexp over all B
  minus the positive). Two unidirectional ring passes fold that logsumexp
  online, one ``b_local x b_local`` block of logits at a time: texts travel
  past the local images (image-to-text), then images past the local texts
  (text-to-image); the positives are the own block's diagonal, masked out of
  the logsumexp there. Memory per device is O(b_local^2) for logits, as for
  the sigmoid losses; each pass is N - 1 hops (one direction: a running
  logsumexp cannot merge the two ends of a bidirectional ring any cheaper).

  Args:
    emb_img, emb_txt: ``(b_local, d)`` local shards of the L2-normalised
      embeddings, row-aligned.
    scale: the inverse temperature, replicated.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.

  Returns:
    scalar float32 loss of the global batch, identical on every device.
  """
  axis_name = hashable_axis(axis_name)
  emb_img = jnp.asarray(emb_img, jnp.float32)
  emb_txt = jnp.asarray(emb_txt, jnp.float32)
  b = emb_img.shape[0]
  neg_inf = jnp.full((b,), -jnp.inf, jnp.float32)
  zeros = jnp.zeros((b,), jnp.float32)

  def direction(rows, cols):
    def fold(acc, blk, is_own):
      lse, diag = acc
      logits = scale * (rows @ blk.T)
      if is_own:
        # The positives leave the logsumexp, which runs over negatives only.
        # With b_local == 1 the own block has none: its logsumexp is -inf
        # (and B == 1 leaves it so: softplus(-inf) == 0, zero gradients).
        diag = diag + jnp.diagonal(logits)
        logits = jnp.where(jnp.eye(*logits.shape, dtype=bool), -jnp.inf,
                           logits)
      return jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=1)), diag
    lse, diag = ring_fold(fold, cols, (neg_inf, zeros), axis_name)
    return jnp.sum(infonce_terms(lse, diag))

  total = direction(emb_img, emb_txt) + direction(emb_txt, emb_img)
  return 0.5 * jax.lax.psum(total, axis_name) / (b * _axis_size(axis_name))


def _ring_sigmoid_loss(logits_fn: Callable[..., Array], img: Any, txt: Any,
                       axis_name) -> Array:
  """Global pairwise sigmoid loss from local blocks: sum of B x B pairs / B."""
  b_img = jax.tree.leaves(img)[0].shape[0]
  b_txt = jax.tree.leaves(txt)[0].shape[0]
  if b_img != b_txt:
    raise ValueError(f'local image and text batches differ: {b_img} images, '
                     f'{b_txt} texts; pairs must be row-aligned per device')

  def block(txt_block, is_own):
    # is_own may be traced, so the own block's positives are expressed by
    # negating its diagonal logits and scoring every pair as a negative:
    # -log sigmoid(-(-z)) is -log sigmoid(z) bit for bit, as in
    # sigmoid_pairwise_loss_sum(..., positives_on_diagonal=True).
    logits = logits_fn(img, txt_block)
    own_diagonal = jnp.eye(*logits.shape, dtype=bool) & is_own
    logits = jnp.where(own_diagonal, -logits, logits)
    return sigmoid_pairwise_loss_sum(logits, positives_on_diagonal=False)

  local = _ring_sum(block, txt, axis_name)
  return jax.lax.psum(local, axis_name) / (b_img * _axis_size(axis_name))


def ppcl_loss_blockwise(mu_img: Array, logvar_img: Array, mu_txt: Array,
                        logvar_txt: Array, scale: Array, bias: Array,
                        axis_name: AxisName) -> Array:
  """PPCL (ProLIP eq. 2) of the global batch, from this device's shard.

  Call inside ``shard_map``. Equals ``ppcl_loss`` on the batch gathered over
  ``axis_name``: ``-(1/B) sum_{i,j} log sigmoid(y_ij * logit_ij)`` with the
  CSD logits ``a * (mu_i^T mu_j - 1/2 tr(Sigma_i + Sigma_j)) + b`` of
  ``ppcl_logits`` (appendix A.1), pair (i, i) positive.

  ``mu_txt`` and ``logvar_txt`` travel the device ring by ``ppermute`` in
  their input dtype; logits are float32 and at most one ``b_local x b_local``
  block of them is alive per device (forward and backward), against
  ``b_local x B`` for the all-gather form. See the module docstring for the
  ring and the two pitfalls it avoids.

  Args:
    mu_img, logvar_img, mu_txt, logvar_txt: ``(b_local, d)`` local shards;
      local row i of the images pairs with local row i of the texts.
    scale: ``a`` itself (not its log), a scalar replicated over the axis.
    bias: ``b``, a replicated scalar.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.

  Returns:
    scalar float32 loss of the global batch, the same on every device.
  """
  axis_name = hashable_axis(axis_name)
  return _ring_sigmoid_loss(
      lambda img, txt: ppcl_logits(img[0], img[1], txt[0], txt[1], scale,
                                   bias),
      (mu_img, logvar_img), (mu_txt, logvar_txt), axis_name)


def siglip_loss_blockwise(emb_img: Array, emb_txt: Array, scale: Array,
                          bias: Array, axis_name: AxisName) -> Array:
  """SigLIP's sigmoid loss (Zhai et al. 2023, eq. 1) of the global batch.

  Call inside ``shard_map``. Equals ``siglip_loss`` on the gathered batch:
  ``-(1/B) sum_{i,j} log sigmoid(y_ij (t x_i . y_j + b))``. ``emb_txt``
  travels the device ring; per-device logits memory is O(b_local^2).

  Args:
    emb_img, emb_txt: ``(b_local, d)`` local, row-aligned, L2-normalised.
    scale: ``t``, bias: ``b``; replicated scalars.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.

  Returns:
    scalar float32 loss of the global batch, the same on every device.
  """
  axis_name = hashable_axis(axis_name)
  return _ring_sigmoid_loss(
      lambda img, txt: siglip_logits(img, txt, scale, bias), emb_img, emb_txt,
      axis_name)


def prolip_loss_blockwise(img: GaussianBatch, txt: GaussianBatch,
                          scale: Array, bias: Array,
                          img_masked: Optional[GaussianBatch] = None,
                          txt_masked: Optional[GaussianBatch] = None, *,
                          axis_name: AxisName, alpha1: float = ALPHA1,
                          alpha2: float = ALPHA2, beta: float = BETA,
                          c: float = INCLUSION_C, eps: float = INCLUSION_EPS,
                          vib_release_quirk: bool = False, guard: bool = True
                          ) -> tuple[Array, dict[str, Array]]:
  """The full ProLIP objective (eq. 6) of the global batch, from local shards.

  Call inside ``shard_map``; the sharded counterpart of ``prolip_loss``:

    L = PPCL(v, t) + alpha1 * L_inc(v ⊂ t)
        + alpha2 * [L_inc(v ⊂ v_masked) + L_inc(t ⊂ t_masked)]
        + beta * [VIB(v) + VIB(t)].

  PPCL (eq. 2) couples all pairs and runs on the ring
  (``ppcl_loss_blockwise``). The per-sample terms (eq. 5 inclusions, eq. A.2
  VIB) are computed once on the local shard by ``prolip_regularizers`` -- the
  image ⊂ text inclusion always on the device's own row-aligned texts, never
  per hop -- then ``pmean``-ed over ``axis_name``. As every device holds the
  same number of rows, the pmean of local means is the global mean.
  ``combine_prolip_terms`` then weighs and guards the global terms, so the
  guard drops a term on all devices or none.

  Masked-copy convention: ``img_masked`` / ``txt_masked`` are ``(n_local, d)``
  per device and are the masked copies of the first ``n_local`` rows of this
  device's LOCAL shard (not of the first rows of the global batch). The dense
  equivalent is ``prolip_loss`` on the global batch with those rows, i.e. the
  first ``n_local`` of every shard, moved to the front.

  Args:
    img, txt: ``GaussianBatch`` of ``(b_local, d)`` local, row-aligned pairs.
    scale, bias: the PPCL scalars ``a`` (not its log) and ``b``, replicated.
    img_masked, txt_masked: optional ``(n_local, d)`` local masked copies.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.
    alpha1, alpha2, beta, c, eps, vib_release_quirk, guard: as in
      ``prolip_loss``.

  Returns:
    ``(total, metrics)``, identical on every device; metrics holds every
    unweighted global term, ``loss`` and (with ``guard``) ``guard_dropped``.
  """
  axis_name = hashable_axis(axis_name)
  terms = {'ppcl': ppcl_loss_blockwise(img.mu, img.logvar, txt.mu,
                                       txt.logvar, scale, bias, axis_name)}
  local = prolip_regularizers(img, txt, img_masked, txt_masked, c=c, eps=eps,
                              vib_release_quirk=vib_release_quirk)
  terms.update(jax.lax.pmean(local, axis_name))
  return combine_prolip_terms(terms, alpha1=alpha1, alpha2=alpha2, beta=beta,
                              guard=guard)
