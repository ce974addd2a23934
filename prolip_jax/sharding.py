"""Every sharding rule of the project, in one place.

Mesh axes:
  ``data``  pure data parallelism: parameters replicated across it.
  ``fsdp``  data parallelism whose devices also split parameters and optimizer
            state (ZeRO-3 style); XLA all-gathers each weight where it is used.
The global batch is split over both axes (``BATCH_AXES``): each of the
``data * fsdp`` devices holds ``batch_size / (data * fsdp)`` examples. Model
code never mentions devices; ``jax.jit`` propagates these shardings.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = 'data'  # parameters replicated across it
FSDP_AXIS = 'fsdp'  # large parameters split across it
MESH_AXES = (DATA_AXIS, FSDP_AXIS)
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int
               ) -> tuple[int, int]:
  """Resolves ``{'data': d, 'fsdp': f}`` with at most one ``-1`` ("the rest")."""
  sizes = [int(mesh_cfg.get(a, 1)) for a in MESH_AXES]
  mesh_cfg = {a: mesh_cfg.get(a, 1) for a in MESH_AXES}
  if sizes.count(-1) > 1:
    raise ValueError(f'at most one mesh axis may be -1, got {dict(mesh_cfg)}')
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f'mesh sizes must be positive or -1, got {dict(mesh_cfg)}')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f'{num_devices} devices cannot be split as '
                       f'{dict(mesh_cfg)}')
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f'mesh {dict(zip(MESH_AXES, sizes))} needs '
                     f'{math.prod(sizes)} devices, have {num_devices}')
  return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices=None,
              whole_topology: bool = False) -> Mesh:
  """A ``(data, fsdp)`` mesh with Auto axes.

  Over ``devices`` if given, else the first ``mesh_cfg['num_devices']``
  devices (0 or absent: all of them). All of a platform's devices (or
  ``whole_topology``: ``devices`` are a whole TPU slice or GPU cluster, as
  ``prolip_jax.aot`` compiles for) are laid out by ``jax.make_mesh``, which
  follows the physical interconnect.
  """
  if devices is None:
    n = int(mesh_cfg.get('num_devices', 0) or 0)
    devices = jax.devices()[:n] if n > 0 else jax.devices()
  devices = list(devices)
  shape = mesh_shape(mesh_cfg, len(devices))
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if whole_topology or len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dimension split over ``data`` x ``fsdp``."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  """The same full array on every device of ``mesh``."""
  return NamedSharding(mesh, P())


def num_batch_shards(mesh: Mesh) -> int:
  """How many pieces the global batch is split into (``data * fsdp``)."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


# big_vision's default (``fsdp(..., min_size_to_shard_mb=4)``): splitting a
# small array saves little memory and costs one more all-gather per use.
FSDP_MIN_SIZE_MB = 4.0


def param_spec(shape: tuple[int, ...], fsdp_size: int, itemsize: int = 4,
               min_size_mb: float = 0.0) -> P:
  """FSDP rule: split the largest dimension that ``fsdp`` divides, else none.

  Arrays under ``min_size_mb`` MiB (``prod(shape) * itemsize`` bytes) stay
  replicated.
  """
  if fsdp_size <= 1 or not shape:
    return P()
  if math.prod(shape) * itemsize < min_size_mb * 2**20:
    return P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % fsdp_size == 0:
      spec = [None] * len(shape)
      spec[dim] = 'fsdp'
      return P(*spec)
  return P()


def param_shardings(mesh: Mesh, abstract_tree: Any,
                    min_size_mb: float = FSDP_MIN_SIZE_MB) -> Any:
  """NamedShardings for a pytree of parameters (or optimizer state): the
  FSDP rule of ``param_spec`` with a floor of ``min_size_mb`` MiB."""
  fsdp = mesh.shape['fsdp']
  return jax.tree.map(
      lambda x: NamedSharding(mesh, param_spec(
          tuple(x.shape), fsdp, np.dtype(x.dtype).itemsize, min_size_mb)),
      abstract_tree)


def host_to_global(mesh: Mesh, local_batch: Any) -> Any:
  """Assembles each host's part of the batch into global sharded arrays."""
  sharding = batch_sharding(mesh)
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x),
      local_batch)
