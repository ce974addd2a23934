"""The device ring under every blockwise (cross-device) loss.

A blockwise loss is called *inside* a ``shard_map`` (the user's own, or the
library's train step) on the LOCAL shard of a data-parallel batch: each of
the ``N`` devices of ``axis_name`` holds ``b_local`` row-aligned samples,
``B = b_local * N`` in all. A pairwise loss needs every local row against
every global column, i.e. a ``B x B`` matrix (logits, a transport plan) that
no device should hold. Here the local rows never move; the column blocks
travel around the devices with ``jax.lax.ppermute`` and each device scores
one ``b_local x b_local`` block at a time against its own rows. The
positives of row-aligned pairs all live in the block a device starts with,
its "own" block. Two schedules are provided:

* ``ring_sum`` -- a bidirectional ring for sums that do not care about the
  order of the blocks (the pairwise sigmoid losses of SigLIP, ProLIP eq. 2
  and PCME++). Each round sends one copy of the block to the right and one
  to the left, so after round k a device holds the blocks of devices i - k
  and i + k, and the ``N - 1`` foreign blocks arrive in ``N // 2`` rounds
  instead of ``N - 1``, using both directions of every link.
* ``ring_fold`` -- a one-way ring for a running fold such as an online
  logsumexp (CLIP's InfoNCE, OTTER's Sinkhorn): the own block first, then
  the blocks of devices i - 1, i - 2, ..., i - (N - 1), one hop each.

Two classic pitfalls of the bidirectional ring are avoided:

1. Double counting the antipodal block. For even N the two copies meet at
   k = N/2 (i - N/2 == i + N/2 mod N). Only ``(N - 1) // 2`` rounds are
   bidirectional; for even N one extra ONE-directional hop follows.
2. Scoring a stale block. That extra hop must score the block it has just
   received (the right-going buffer permuted once more: device i - N/2), not
   the right-going buffer of the previous round, which was already counted.

``tests/test_blockwise.py`` checks that each device visits every block exactly
once (and only its own with positives) for N = 1, 2, 3, 4, 5, 8 and for tuple
axes, besides checking every blockwise loss and its gradients against the
dense function.

Memory. The gathered alternative -- all-gather the columns, then score the
local ``b_local x B`` slab -- holds O(b_local * B) = O(N * b_local^2) floats
per device, for the logits and again for their cotangents. The ring holds
O(b_local^2) whatever N:

* the rounds run in a ``lax.fori_loop`` (a scan under reverse-mode AD), and
  each round of ``ring_sum`` scores its two blocks in an inner two-step loop;
  the blocks left at the end (the antipodal one for even N, then the own one)
  in one more. Loops are the ordering XLA keeps: it may drop
  ``optimization_barrier`` and interleave independent straight-line
  scorings, holding several blocks;
* each scoring is wrapped in ``jax.checkpoint``, so the backward pass
  recomputes a block's logits instead of the scan stacking all N of them.
  What it does keep per block is the received block, O(b_local * d), i.e.
  O(B * d) in all: the size of the embeddings, not of the logits.

``benchmarks/blockwise_memory.py`` compiles the ring and gathered forms of
PPCL at B = 16,384 on 8 host devices: per-device temporaries are about 0.18x
(value) and 0.17x (value and grad) those of the gathered form.

Gradients flow through ``ppermute`` (its transpose is the inverse
permutation), so ``jax.grad`` of a blockwise loss -- outside the
``shard_map`` or inside it -- is the gradient of the global loss. Inside
``shard_map`` this relies on ``check_vma=True`` (the default): it makes the
transpose of a loss's final ``psum`` a no-op and sums the gradients of
replicated scalars (``scale``, ``bias``) over devices.

``axis_name`` is one mesh axis name or a tuple of them (e.g.
``('data', 'fsdp')``); the ring then runs over the devices of all those axes
in ``ppermute``'s linear order (the order of ``lax.axis_index`` on the same
tuple). The ring needs no device index: the positives live in the block a
device starts with, and every ring is a single N-cycle, so a result does not
depend on how the tuple is linearised.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp

AxisName = Union[str, Sequence[str]]

__all__ = ['AxisName', 'axis_size', 'global_mean', 'hashable_axis',
           'ring_fold', 'ring_sum', 'varying']


def hashable_axis(axis_name: AxisName):
  """A hashable axis name: one name, or a tuple of names (from a list)."""
  if isinstance(axis_name, (list, tuple)):
    return tuple(axis_name)
  return axis_name


def axis_size(axis_name) -> int:
  """Number of devices N along ``axis_name`` (a name or a tuple of names)."""
  return int(jax.lax.axis_size(axis_name))


def global_mean(local_mean: Any, axis_name: Optional[AxisName]) -> Any:
  """The global batch's mean from each device's mean over its rows.

  ``pmean`` over ``axis_name`` (every device holds the same number of rows,
  so the mean of the local means is the global one); with ``axis_name``
  None (one device holds the batch) ``local_mean`` itself.
  """
  if axis_name is None:
    return local_mean
  return jax.lax.pmean(local_mean, hashable_axis(axis_name))


def varying(tree: Any, axis_name) -> Any:
  """Every leaf of ``tree`` marked device-varying over ``axis_name``.

  ``fori_loop`` carries must keep one type, and a carry that starts
  replicated (e.g. zero Sinkhorn potentials) becomes varying after one hop;
  leaves already varying over every axis are returned unchanged.
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

  def cast(x):
    aval = jax.typeof(x)
    vma = (aval.manual_axis_type.varying if hasattr(aval, 'manual_axis_type')
           else aval.vma)
    missing = tuple(a for a in names if a not in vma)
    return jax.lax.pcast(x, missing, to='varying') if missing else x

  return jax.tree.map(cast, tree)


def ring_sum(block_fn: Callable[[Any, Any], Any], block: Any,
             axis_name) -> Any:
  """Local sum of ``block_fn(b, is_own)`` over the N blocks ``b`` of the ring.

  Bidirectional schedule (module docstring). ``block`` is this device's own
  block, any pytree of ``(b_local, ...)`` arrays (e.g. ``(mu, logvar)``, each
  ``(b_local, d)``); every device's block travels by ``ppermute`` in its
  input dtype. ``block_fn`` is applied to each of the N blocks exactly once,
  with ``is_own`` (a boolean scalar, possibly traced) true only for this
  device's own block, and the results (pytrees of arrays of fixed shapes)
  are summed. Nothing is reduced across devices: the caller ``psum``-s.

  The rounds run in a ``fori_loop``; each round scores its two blocks in an
  inner two-step loop, and the blocks left at the end -- the antipodal block
  for even N, then the own block -- in one more such loop. Each scoring is
  rematerialised in the backward pass, so forward and backward hold one
  block's intermediates at a time.
  """
  n = axis_size(axis_name)
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
      blk = jax.tree.map(lambda x: x[j], stacked)
      is_own = jnp.asarray(False) if own_at is None else j == own_at
      return add(total, score(blk, is_own))

    return jax.lax.fori_loop(0, len(blocks), step, total)

  # A device-varying zero accumulator shaped like one block's result.
  shapes = jax.eval_shape(block_fn, block, jnp.asarray(False))
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
                                          (total, block, block))
  if n % 2 == 0:
    # Even N: block i - N/2 == i + N/2 is left. One ONE-directional hop; the
    # block to score is the one it has just received (``antipodal``), not
    # ``from_left`` of the last round, which was already counted.
    antipodal = send(from_left, to_right)
    return score_in_turn(total, [antipodal, block], own_at=1)
  return score_in_turn(total, [block], own_at=0)


def ring_fold(fn: Callable[[Any, Any, bool], Any], payload: Any, init: Any,
              axis_name) -> Any:
  """Folds ``acc = fn(acc, block, is_own)`` over the N blocks of ``payload``.

  One-way schedule (module docstring): this device's own block comes first
  (``is_own=True``, a Python bool, so ``fn`` may branch on it), then the
  blocks of devices i-1, i-2, ..., i-(N-1), each received by one
  ``ppermute`` hop to the right. ``payload`` is a pytree of ``(b_local,
  ...)`` arrays; ``init`` and every ``fn`` result are pytrees of one
  structure, shapes and dtypes (e.g. a ``(b_local,)`` running logsumexp).
  ``fn`` is rematerialised in the backward pass, so at most one block's
  intermediates are alive at a time. Returns the local fold; nothing is
  reduced across devices.
  """
  n = axis_size(axis_name)
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
