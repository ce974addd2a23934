"""Each loss's one entry (``losses.<loss>(..., axis_name=None)``) against
its two forms.

The dense function of each loss family is its entry: without ``axis_name``
it is the dense loss on the whole batch, and with it (inside ``shard_map``)
it must be the blockwise (ring) form, to the bit, passing on every keyword
it was given. Run on the 8 host CPU devices of conftest.py with small
random inputs and non-default keywords (a keyword the entry forgot to pass
on changes the ring's number); the dense value on the whole batch must
equal the ring's on the split batch (``test_blockwise.py`` and
``test_objectives.py`` check the ring forms against independent
computations in more depth).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from prolip_jax import losses
from prolip_jax.losses import GaussianBatch
from prolip_jax.losses.contrastive import unit_rows

AX = 'x'
B, D, V = 16, 8, 2  # 2 rows per device on 8 devices
ROW, REP = P(AX), P()

# Non-default keywords, so that each must reach the ring form.
PROLIP_KW = dict(alpha1=0.3, alpha2=0.2, beta=0.1, c=5.0, eps=-2.0,
                 vib_release_quirk=True, guard=False)
OTTER_KW = dict(alpha=0.3, lam=0.5, n_iter=3, gamma_v=0.7, gamma_t=0.4,
                eta=20.0)
MP_NCE_WEIGHTS = (0.5, 0.25, 1.0)


def _unit(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _arrays():
  k = jax.random.split(jax.random.key(46), 10)
  mu_i = _unit(jax.random.normal(k[0], (B, D)))
  mu_t = _unit(mu_i + 0.8 * jax.random.normal(k[1], (B, D)))
  lv_i = jax.random.normal(k[2], (B, D)) - 4.0
  lv_t = jax.random.normal(k[3], (B, D)) - 3.0
  # Masked copies of every row (each device's shard masks all its rows,
  # so the dense and the local conventions agree).
  mmu_i = _unit(mu_i + 0.3 * jax.random.normal(k[4], (B, D)))
  mmu_t = _unit(mu_t + 0.3 * jax.random.normal(k[5], (B, D)))
  views = _unit(mu_i[None] + 0.5 * jax.random.normal(k[6], (V, B, D)))
  return dict(mu_i=mu_i, mu_t=mu_t, lv_i=lv_i, lv_t=lv_t, mmu_i=mmu_i,
              mmu_t=mmu_t, lvm_i=lv_i + 0.5, lvm_t=lv_t + 0.5, views=views,
              tea_i=_unit(mu_i + 0.1 * jax.random.normal(k[7], (B, D))),
              tea_t=_unit(mu_t + 0.1 * jax.random.normal(k[8], (B, D))),
              pair_j=_unit(jax.random.normal(k[9], (B, D))))


def _prolip(fn, axis, mu_i, lv_i, mu_t, lv_t, mmu_i, lvm_i, mmu_t, lvm_t, a,
            b):
  return fn(GaussianBatch(mu_i, lv_i), GaussianBatch(mu_t, lv_t), a, b,
            GaussianBatch(mmu_i, lvm_i), GaussianBatch(mmu_t, lvm_t),
            axis_name=axis, **PROLIP_KW)


def _otter(fn, axis, img, txt, img_t, txt_t, lv_i, lv_t, scale):
  return fn(img, txt, img_t, txt_t, scale, logvar_img=lv_i,
            logvar_txt=lv_t, axis_name=axis, **OTTER_KW)


def _mp_nce(fn, axis, views, txt, ids, tau, offset):
  return fn(views, txt, tau, offset, weights=MP_NCE_WEIGHTS, sample_ids=ids,
            axis_name=axis)


def _difference_ring(g_i, g_j, f, scale, axis):
  """Eq. 4's ring: CLIP's blockwise InfoNCE over unit differences."""
  return losses.clip_loss_blockwise(unit_rows(g_i - g_j), unit_rows(f), scale,
                                    axis)


def _families():
  """``{family: (entry(axis, *args), ring(axis, *args), args, specs)}``."""
  x = _arrays()
  a, b = jnp.float32(7.0), jnp.float32(-4.0)
  gauss = (x['mu_i'], x['lv_i'], x['mu_t'], x['lv_t'])
  prolip_args = gauss + (x['mmu_i'], x['lvm_i'], x['mmu_t'], x['lvm_t'], a, b)
  ids = jnp.arange(B) // 2  # pairs of samples share an id: positives
  tau, offset = jnp.array([0.2, 0.1, 0.3]), jnp.array([0.1, -0.2, 0.05])
  pairs = (x['mu_i'], x['pair_j'], x['mu_t'], a)
  return {
      'ppcl': (lambda ax, *r: losses.ppcl_loss(*r, axis_name=ax),
               lambda ax, *r: losses.ppcl_loss_blockwise(*r, ax),
               gauss + (a, b), (ROW,) * 4 + (REP,) * 2),
      'siglip': (lambda ax, *r: losses.siglip_loss(*r, axis_name=ax),
                 lambda ax, *r: losses.siglip_loss_blockwise(*r, ax),
                 (x['mu_i'], x['mu_t'], a, b), (ROW, ROW, REP, REP)),
      'clip': (lambda ax, *r: losses.clip_loss(*r, axis_name=ax),
               lambda ax, *r: losses.clip_loss_blockwise(*r, ax),
               (x['mu_i'], x['mu_t'], a), (ROW, ROW, REP)),
      'pcme_pml': (lambda ax, *r: losses.pcme_pml_loss(*r, axis_name=ax),
                   lambda ax, *r: losses.pcme_pml_loss_blockwise(*r, ax),
                   gauss + (a, b), (ROW,) * 4 + (REP,) * 2),
      'prolip': (lambda ax, *r: _prolip(losses.prolip_loss, ax, *r),
                 lambda ax, *r: _prolip(losses.prolip_loss_blockwise, ax, *r),
                 prolip_args, (ROW,) * 8 + (REP,) * 2),
      'otter': (lambda ax, *r: _otter(losses.otter_loss, ax, *r),
                lambda ax, *r: _otter(losses.otter_loss_blockwise, ax, *r),
                (x['mu_i'], x['mu_t'], x['tea_i'], x['tea_t'], x['lv_i'],
                 x['lv_t'], a), (ROW,) * 6 + (REP,)),
      'mp_nce': (lambda ax, *r: _mp_nce(losses.mp_nce_loss, ax, *r),
                 lambda ax, *r: _mp_nce(losses.mp_nce_loss_sharded, ax, *r),
                 (x['views'], x['mu_t'], ids, tau, offset),
                 (P(None, AX), ROW, ROW, REP, REP)),
      'difference_alignment': (
          lambda ax, *r: losses.difference_alignment_loss(*r, axis_name=ax),
          lambda ax, *r: _difference_ring(*r, ax), pairs,
          (ROW, ROW, ROW, REP)),
  }


FAMILIES = tuple(_families())


def _on_8_devices(fn, specs):
  mesh = Mesh(np.array(jax.devices()[:8]), (AX,))
  return jax.jit(jax.shard_map(lambda *r: fn(AX, *r), mesh=mesh,
                               in_specs=specs, out_specs=P()))


@pytest.mark.parametrize('family', FAMILIES)
def test_entry_is_dense_without_axis_and_ring_with_it(family):
  entry, ring_form, args, specs = _families()[family]
  ring_value = _on_8_devices(ring_form, specs)(*args)
  # With axis_name: the ring form itself, every keyword passed on.
  jax.tree.map(np.testing.assert_array_equal,
               _on_8_devices(entry, specs)(*args), ring_value)
  # Without: the dense loss of the whole batch, which the ring equals.
  dense = entry(None, *args)
  jax.tree.map(lambda d, r: np.testing.assert_allclose(d, r, rtol=1e-5,
                                                       atol=1e-6),
               dense, ring_value)
  # The entry on one device's shard alone is a different (local) loss: the
  # comparison above could not pass by the ring computing it.
  local = entry(None, *(r if s == REP else r[:, :B // 8] if s == P(None, AX)
                        else r[:B // 8] for r, s in zip(args, specs)))
  assert not np.allclose(jax.tree.leaves(local)[0],
                         jax.tree.leaves(dense)[0], rtol=1e-3)


def test_squared_difference_alignment_entry():
  """Eq. 5 (squared) has no ring: with ``axis_name`` the entry takes the
  mean of the shards' means, the whole batch's mean."""
  x = _arrays()
  args = (x['mu_i'], x['pair_j'], x['mu_t'])
  fn = lambda ax, *r: losses.difference_alignment_loss(*r, squared=True,
                                                       axis_name=ax)
  x_diff = np.asarray(unit_rows(args[0] - args[1]), np.float64)
  y = np.asarray(unit_rows(args[2]), np.float64)
  want = np.mean(np.sum((x_diff - y)**2, axis=-1))
  np.testing.assert_allclose(_on_8_devices(fn, (ROW,) * 3)(*args), want,
                             rtol=1e-5)
  np.testing.assert_allclose(fn(None, *args), want, rtol=1e-5)


def test_pml_entry_refuses_matched_labels_on_a_split_batch():
  x = _arrays()
  with pytest.raises(ValueError, match='matched must be None'):
    losses.pcme_pml_loss(x['mu_i'], x['lv_i'], x['mu_t'], x['lv_t'], 5.0,
                         5.0, jnp.eye(B), axis_name=AX)
