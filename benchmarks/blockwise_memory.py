"""Per-device temporary memory: ring (blockwise) PPCL vs all-gather PPCL.

Compiles, without running, the PPCL loss (eq. 2) of a global batch of 16,384
pairs sharded over 8 host CPU devices, value and value-and-grad, in two forms:

* blockwise: ``prolip_jax.losses.ppcl_loss_blockwise`` -- text blocks travel
  the device ring, one ``b_local x b_local`` logits block alive at a time;
* gathered: ``all_gather`` the texts inside ``shard_map``, then score the
  local ``b_local x B`` logits at once (the naive data-parallel form).

and prints XLA's ``memory_analysis().temp_size_in_bytes`` of each per-device
program, their ratio and the size of the logits themselves. The issue asks for
blockwise <= 1/4 of gathered. A small batch is also run through both to check
they agree.

Usage: python benchmarks/blockwise_memory.py [--batch 16384] [--dim 64]
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from prolip_jax.losses import ppcl_logits
from prolip_jax.losses import ppcl_loss_blockwise

AXIS = 'data'


def ppcl_loss_gathered(mu_img, logvar_img, mu_txt, logvar_txt, scale, bias,
                       axis_name):
  """Reference: all-gather the texts, then the local b_local x B logits."""
  b_local = mu_img.shape[0]
  mu_all = jax.lax.all_gather(mu_txt, axis_name, tiled=True)
  logvar_all = jax.lax.all_gather(logvar_txt, axis_name, tiled=True)
  logits = ppcl_logits(mu_img, logvar_img, mu_all, logvar_all, scale, bias)
  offset = jax.lax.axis_index(axis_name) * b_local
  rows = jnp.arange(b_local)[:, None]
  cols = jnp.arange(mu_all.shape[0])[None, :]
  labels = jnp.where(cols == rows + offset, 1.0, -1.0)
  local = -jnp.sum(jax.nn.log_sigmoid(labels * logits))
  return jax.lax.psum(local, axis_name) / mu_all.shape[0]


def _programs(loss, mesh):
  sharded = jax.shard_map(
      lambda a, b, c, d, s, bb: loss(a, b, c, d, s, bb, AXIS), mesh=mesh,
      in_specs=(P(AXIS),) * 4 + (P(), P()), out_specs=P())
  return {'value': jax.jit(sharded),
          'value+grad': jax.jit(jax.value_and_grad(sharded, tuple(range(6))))}


def _args(mesh, batch, dim):
  rows = NamedSharding(mesh, P(AXIS))
  rep = NamedSharding(mesh, P())
  emb = jax.ShapeDtypeStruct((batch, dim), jnp.float32, sharding=rows)
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
  return (emb,) * 4 + (scalar, scalar)


def _mib(n):
  return f'{n / 2**20:9.2f} MiB'


def _check_agree(mesh, batch=512, dim=16):
  k = jax.random.split(jax.random.key(0), 4)
  mu_img = jax.random.normal(k[0], (batch, dim))
  mu_img /= jnp.linalg.norm(mu_img, axis=-1, keepdims=True)
  mu_txt = jax.random.normal(k[1], (batch, dim))
  mu_txt /= jnp.linalg.norm(mu_txt, axis=-1, keepdims=True)
  lv_img = jax.random.normal(k[2], (batch, dim)) - 4.0
  lv_txt = jax.random.normal(k[3], (batch, dim)) - 4.0
  args = (mu_img, lv_img, mu_txt, lv_txt, jnp.float32(10.0),
          jnp.float32(-10.0))
  ring = _programs(ppcl_loss_blockwise, mesh)['value+grad'](*args)
  gathered = _programs(ppcl_loss_gathered, mesh)['value+grad'](*args)
  for a, b in zip(jax.tree.leaves(ring), jax.tree.leaves(gathered)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-6)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=16384)
  parser.add_argument('--dim', type=int, default=64)
  flags = parser.parse_args()

  jax.config.update('jax_default_matmul_precision', 'highest')
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), (AXIS,))
  b_local = flags.batch // n
  print(f'jax {jax.__version__}, {n} x {devices[0].platform} devices; '
        f'global batch B = {flags.batch}, b_local = {b_local}, '
        f'd = {flags.dim}, float32')
  print(f'logits per device, theory: blockwise b_local^2 * 4 B = '
        f'{_mib(4 * b_local**2)}; gathered b_local * B * 4 B = '
        f'{_mib(4 * b_local * flags.batch)}')

  args = _args(mesh, flags.batch, flags.dim)
  temps = {}
  for name, loss in (('blockwise', ppcl_loss_blockwise),
                     ('gathered', ppcl_loss_gathered)):
    for mode, fn in _programs(loss, mesh).items():
      stats = fn.lower(*args).compile().memory_analysis()
      temps[name, mode] = stats.temp_size_in_bytes
  print(f'{"per-device temp_size_in_bytes":32s}{"blockwise":>16s}'
        f'{"gathered":>16s}{"ratio":>9s}')
  ok = True
  for mode in ('value', 'value+grad'):
    ring, gathered = temps['blockwise', mode], temps['gathered', mode]
    ratio = ring / gathered
    ok &= ratio <= 0.25
    print(f'{mode:32s}{_mib(ring):>16s}{_mib(gathered):>16s}{ratio:9.3f}')
  print(f'requirement blockwise <= 1/4 of gathered: '
        f'{"met" if ok else "NOT met"}')

  _check_agree(mesh)
  print('ring and gathered agree (value and grads) on a 512-pair batch')


if __name__ == '__main__':
  main()
