"""Exact gradient accumulation (``accum_steps``): the whole batch's loss and
gradient with the towers' memory of one micro-batch.

A contrastive loss couples every pair of the global batch, so summing the
gradients of K smaller batches (big_vision's and MaxText's accumulation)
trains with fewer negatives: another objective. The GradCache construction
(Gao et al., 2021; open_clip's ``--accum-freq``) keeps the objective:

1. ``LossParts.inputs`` on the whole global batch: normalised images and
   every random draw (ProLIP's masked rows, patches and tokens), so they are
   the un-split step's whatever K is.
2. The towers forward, one micro-batch at a time, keeping only their
   outputs (no activations): ``lax.map`` over the K micro-batches.
3. The loss on the whole batch's outputs, the ring over devices included,
   and its gradient with respect to those outputs and to the parameters it
   reads itself (the scale and bias).
4. For each micro-batch again: the towers' forward and their backward from
   the cached output gradients (``jax.vjp``), summed into the parameter
   gradient: on a ``data``-parallel mesh each device sums its own rows' and
   the sums are all-reduced once per step (``_summed_tower_grads``).

The gradient is the un-split one up to float rounding (the sums run in
another order), at the cost of one more forward pass of the towers per step
(a forward is about a third of a forward-and-backward: with ``model.remat``
the backward already recomputes it once more). Each device splits its own
rows: micro-batch k is rows ``k*m .. (k+1)*m - 1`` of every device's share,
so no row moves between devices.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from prolip_jax import errors
from prolip_jax import sharding as shd
from prolip_jax.objectives.base import LossParts

# (params, teacher, batch, rng) -> ((loss, metrics), grads)
ValueAndGrad = Callable[..., tuple[tuple[jax.Array, dict], Any]]


def split_rows(x: jax.Array, shards: int, k: int) -> jax.Array:
  """``(n, ...)`` -> ``(k, n // k, ...)``: micro-batch j is rows
  ``j*m .. (j+1)*m - 1`` of each of the ``shards`` consecutive shares of
  ``m * k`` rows, in shard order (each device keeps its rows)."""
  n = x.shape[0]
  if n % (shards * k):
    raise errors.ConfigError(
        f'accum_steps={k}: a tower input of {n} rows over {shards} batch '
        f'shard(s) does not split into {k} equal micro-batches; choose a '
        f'batch_size with a per-device share divisible by {k}')
  m = n // (shards * k)
  y = x.reshape(shards, k, m, *x.shape[1:])
  return jnp.swapaxes(y, 0, 1).reshape(k, shards * m, *x.shape[1:])


def join_rows(y: jax.Array, shards: int) -> jax.Array:
  """The inverse of ``split_rows``: ``(k, n // k, ...)`` -> ``(n, ...)``."""
  k, per = y.shape[:2]
  z = y.reshape(k, shards, per // shards, *y.shape[2:])
  return jnp.swapaxes(z, 0, 1).reshape(k * per, *y.shape[2:])


def _constrain(mesh, spec: P) -> Callable[[Any], Any]:
  """Pins every array of a pytree to ``spec`` on ``mesh`` (one device:
  nothing to pin)."""
  if mesh is None or shd.num_batch_shards(mesh) == 1:
    return lambda tree: tree
  sharding = NamedSharding(mesh, spec)
  return lambda tree: jax.tree.map(
      lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def value_and_grad(parts: LossParts, accum_steps: int, mesh) -> ValueAndGrad:
  """``vg(params, teacher, batch, rng) -> ((loss, metrics), grads)`` of the
  whole batch's loss, with the towers run ``accum_steps`` micro-batches at
  a time (module docstring); ``accum_steps=1`` differentiates the composed
  loss directly."""
  if accum_steps == 1:
    def whole(params, teacher, batch, rng):
      outs = parts.towers(params, teacher, parts.inputs(batch, rng))
      return parts.loss(params, outs, batch)
    return jax.value_and_grad(whole, has_aux=True)

  shards = shd.num_batch_shards(mesh) if mesh is not None else 1
  k = accum_steps
  micro_sharded = _constrain(mesh, P(None, shd.BATCH_AXES))
  batch_sharded = _constrain(mesh, P(shd.BATCH_AXES))
  split = lambda tree: micro_sharded(jax.tree.map(
      lambda x: split_rows(x, shards, k), tree))
  join = lambda tree: batch_sharded(jax.tree.map(
      lambda y: join_rows(y, shards), tree))

  def vg(params, teacher, batch, rng):
    micro_rows = split(parts.inputs(batch, rng))
    # Forward only: lax.map keeps each micro-batch's outputs, no residuals.
    outs = join(jax.lax.map(lambda rows: parts.towers(params, teacher, rows),
                            micro_rows))
    (loss, metrics), (grads, d_outs) = jax.value_and_grad(
        parts.loss, argnums=(0, 1), has_aux=True)(params, outs, batch)

    tower_grads = _summed_tower_grads(parts, params, teacher, mesh)
    return (loss, metrics), jax.tree.map(
        jnp.add, grads, tower_grads(micro_rows, split(d_outs)))

  return vg


def _summed_tower_grads(parts: LossParts, params, teacher, mesh
                        ) -> Callable[[Any, Any], Any]:
  """``f(micro_rows, micro_d_outs)``: the parameter gradient of the towers
  summed over the K micro-batches (step 4 of the module docstring), from
  ``(K, n // K, ...)`` rows and output gradients.

  On a mesh of several ``data`` shards and no ``fsdp`` split, each device
  sums its own rows' gradients over the micro-batches (``shard_map``) and
  the devices' sums are added once, after the last one: one all-reduce per
  step. Summing the reduced gradient instead would all-reduce it after
  every micro-batch, K times the traffic. With ``fsdp`` > 1 the large
  parameters are split over devices, so each micro-batch's gradient is
  reduced (and scattered) as it ends, as in MaxText's accumulation.
  """
  def summed(micro_rows, micro_d_outs, params=params, teacher=teacher):
    def backward(acc, micro):
      rows, d_out = micro
      _, pullback = jax.vjp(lambda p: parts.towers(p, teacher, rows), params)
      return jax.tree.map(jnp.add, acc, pullback(d_out)[0]), None
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.scan(backward, zeros, (micro_rows, micro_d_outs))[0]

  if (mesh is None or shd.num_batch_shards(mesh) == 1
      or mesh.shape[shd.FSDP_AXIS] > 1):
    return summed

  def reduced_once(micro_rows, micro_d_outs, params, teacher):
    return jax.lax.psum(summed(micro_rows, micro_d_outs, params, teacher),
                        shd.DATA_AXIS)
  rows_spec = P(None, shd.DATA_AXIS)  # (K, n // K, ...): each device's rows
  # check_vma=False: with it on, shard_map types the replicated parameters
  # as invariant and sums their cotangent over the devices inside every
  # micro-batch's backward (so would pcast(to='varying'), but jax 0.12
  # then refuses the exact GELU's derivative: its erfc polynomial mixes
  # varying and invariant operands). Off, each device keeps its own sum and
  # the one psum above adds them.
  over_devices = jax.shard_map(
      reduced_once, mesh=mesh, in_specs=(rows_spec, rows_spec, P(), P()),
      out_specs=P(), check_vma=False)
  return lambda micro_rows, micro_d_outs: over_devices(
      micro_rows, micro_d_outs, params, teacher)
