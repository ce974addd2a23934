"""Blockwise (ring) losses against the dense single-device losses.

Runs on the 8 host CPU devices forced by conftest.py. The ring visits every
text block exactly once on each device, and every sharded loss equals the
dense loss on the same global batch, in value and in gradients (w.r.t. means
and log-variances of both modalities, scale and bias, and for eq. 6 the masked
copies), rtol 1e-5 in float32: PPCL and SigLIP for 1, 2, 3, 4, 5 and 8
devices on one axis and 2x4 / 4x2 meshes with ``axis_name=('data', 'fsdp')``,
eq. 6 on 3 devices, 8 devices and the 4x2 mesh. CLIP's ring also against a
float64 reference on nearly separated batches (losses 1e-2 .. 1e-7).

Masked-copy convention under sharding: each device passes the masked copies of
the first ``N_MASKED_LOCAL`` rows of its LOCAL shard, so the dense reference
masks global rows ``dev * b_local + r`` for r < N_MASKED_LOCAL.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from scipy import optimize

from prolip_jax import losses
from prolip_jax.losses import ring
from prolip_jax.losses.probabilistic import GaussianBatch

B = 120  # divisible by 1, 2, 3, 4, 5 and 8
D = 16
N_MASKED_LOCAL = 2  # masked copies per device: its first 2 local rows

# (mesh shape, mesh axis names, axis_name passed to the loss)
CONFIGS = [
    ((1,), ('x',), 'x'),
    ((2,), ('x',), 'x'),
    ((3,), ('x',), 'x'),
    ((4,), ('x',), 'x'),
    ((5,), ('x',), 'x'),
    ((8,), ('x',), 'x'),
    ((2, 4), ('data', 'fsdp'), ('data', 'fsdp')),
    ((4, 2), ('data', 'fsdp'), ('data', 'fsdp')),
]
IDS = ['1', '2', '3', '4', '5', '8', 'data2xfsdp4', 'data4xfsdp2']
# Each loss against its dense form: the fast tier compiles one odd ring and
# one 2-D mesh of 8 (its even ring has the antipodal hop); every other size
# runs in the slow tier (the schedule itself is checked on all sizes, fast).
FAST_IDS = ('3', 'data2xfsdp4')
LOSS_CONFIGS = [pytest.param(*cfg, id=i,
                             marks=() if i in FAST_IDS else pytest.mark.slow)
                for cfg, i in zip(CONFIGS, IDS)]


def _mesh(shape, names):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _unit(x):
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=None)
def _batch():
  k = jax.random.split(jax.random.key(0), 8)
  mu_img = _unit(jax.random.normal(k[0], (B, D)))
  mu_txt = _unit(mu_img + 0.8 * jax.random.normal(k[1], (B, D)))
  lv_img = jax.random.normal(k[2], (B, D)) - 4.0
  lv_txt = jax.random.normal(k[3], (B, D)) - 3.0
  return mu_img, lv_img, mu_txt, lv_txt


def _masked(n_dev):
  """Global masked arrays: device k's n_local rows follow its first rows."""
  mu_img, lv_img, mu_txt, lv_txt = _batch()
  rows = _masked_rows(n_dev)
  k = jax.random.split(jax.random.key(1), 4)
  shape = (len(rows), D)
  return (_unit(mu_img[rows] + 0.1 * jax.random.normal(k[0], shape)),
          lv_img[rows] + 0.5 + 0.1 * jax.random.normal(k[1], shape),
          _unit(mu_txt[rows] + 0.1 * jax.random.normal(k[2], shape)),
          lv_txt[rows] + 0.5 + 0.1 * jax.random.normal(k[3], shape))


def _masked_rows(n_dev):
  """Global rows masked under the per-device convention, in shard order."""
  b_local = B // n_dev
  return np.array([dev * b_local + r for dev in range(n_dev)
                   for r in range(N_MASKED_LOCAL)])


def _assert_close(actual, expected, rtol=1e-5):
  actual, expected = np.asarray(actual), np.asarray(expected)
  atol = 1e-6 * max(float(np.max(np.abs(expected))), 1e-30)
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# Dense single-device references, jitted once for all mesh configurations.
_dense_ppcl = jax.jit(jax.value_and_grad(losses.ppcl_loss, tuple(range(6))))
_dense_siglip = jax.jit(jax.value_and_grad(losses.siglip_loss,
                                           tuple(range(4))))


def _dense_prolip_fn(mi, li, mt, lt, mmi, lmi, mmt, lmt, s, bb, order):
  """Dense eq. 6 on the batch reordered so that ``order``'s rows come first."""
  return losses.prolip_loss(
      GaussianBatch(mi[order], li[order]), GaussianBatch(mt[order],
                                                         lt[order]),
      s, bb, GaussianBatch(mmi, lmi), GaussianBatch(mmt, lmt))


_dense_prolip = jax.jit(jax.value_and_grad(_dense_prolip_fn, tuple(range(10)),
                                           has_aux=True))


def _sharded(fn, mesh, axis_name, n_sharded, n_replicated):
  """jit(shard_map(fn)) with the first args batch-sharded, the rest not."""
  spec = P(axis_name)
  return jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=(spec,) * n_sharded + (P(),) * n_replicated,
      out_specs=P()))


@pytest.mark.parametrize('shape,names,axis_name', CONFIGS, ids=IDS)
def test_ring_visits_every_block_exactly_once(shape, names, axis_name):
  """Each device scores every text block once, its own with positives."""
  mesh = _mesh(shape, names)
  n = int(np.prod(shape))

  def visits():
    own_index = jax.lax.axis_index(axis_name)  # linear index over the tuple
    block = jnp.full((1,), own_index)
    count = ring.ring_sum(
        lambda t, positives: jax.nn.one_hot(t[0], n) * (1 + 9 * positives),
        block, axis_name)
    return count[None], own_index[None]

  count, index = jax.jit(jax.shard_map(
      visits, mesh=mesh, in_specs=(), out_specs=(P(axis_name),
                                                 P(axis_name))))()
  # Device d must see block d once with positives (10) and others once (1).
  assert sorted(np.asarray(index).tolist()) == list(range(n))
  expected = np.ones((n, n)) + 9 * np.eye(n)[np.asarray(index)]
  np.testing.assert_array_equal(np.asarray(count), expected)


@pytest.mark.parametrize('shape,names,axis_name', LOSS_CONFIGS)
def test_ppcl_blockwise_matches_dense(shape, names, axis_name):
  mesh = _mesh(shape, names)
  f = _sharded(
      lambda a, b, c, d, s, bb: losses.ppcl_loss_blockwise(
          a, b, c, d, s, bb, axis_name), mesh, axis_name, 4, 2)
  args = (*_batch(), jnp.float32(10.0), jnp.float32(-10.0))
  argnums = tuple(range(6))
  value, grads = jax.value_and_grad(f, argnums)(*args)
  value0, grads0 = _dense_ppcl(*args)
  _assert_close(value, value0)
  for g, g0 in zip(grads, grads0):
    _assert_close(g, g0)


@pytest.mark.parametrize('shape,names,axis_name', LOSS_CONFIGS)
def test_siglip_blockwise_matches_dense(shape, names, axis_name):
  mesh = _mesh(shape, names)
  f = _sharded(
      lambda a, c, s, bb: losses.siglip_loss_blockwise(a, c, s, bb,
                                                       axis_name),
      mesh, axis_name, 2, 2)
  mu_img, _, mu_txt, _ = _batch()
  args = (mu_img, mu_txt, jnp.float32(10.0), jnp.float32(-10.0))
  argnums = tuple(range(4))
  value, grads = jax.value_and_grad(f, argnums)(*args)
  value0, grads0 = _dense_siglip(*args)
  _assert_close(value, value0)
  for g, g0 in zip(grads, grads0):
    _assert_close(g, g0)


_dense_clip = jax.jit(jax.value_and_grad(losses.clip_loss, tuple(range(3))))


@pytest.mark.parametrize('shape,names,axis_name', LOSS_CONFIGS)
def test_clip_blockwise_matches_dense(shape, names, axis_name):
  mesh = _mesh(shape, names)
  f = _sharded(
      lambda a, c, s: losses.clip_loss_blockwise(a, c, s, axis_name),
      mesh, axis_name, 2, 1)
  mu_img, _, mu_txt, _ = _batch()
  # A large scale makes each row's logsumexp hinge on the global maximum.
  for scale in (1.0 / 0.07, 100.0):
    args = (mu_img, mu_txt, jnp.float32(scale))
    value, grads = jax.value_and_grad(f, (0, 1, 2))(*args)
    value0, grads0 = _dense_clip(*args)
    _assert_close(value, value0)
    for g, g0 in zip(grads, grads0):
      # Online logsumexp rounds differently from the dense one: ~1e-6
      # absolute on the smallest entries of a gradient.
      np.testing.assert_allclose(
          np.asarray(g), np.asarray(g0), rtol=1e-4,
          atol=5e-5 * float(np.max(np.abs(np.asarray(g0)))))


def _clip_ref64(img, txt, scale):
  """CLIP's loss and gradients w.r.t. (img, txt, scale) in float64 numpy (as
  ``clip_ref64`` in test_losses.py): log(1 + sum_{j != i} e^(L_ij - L_ii))
  per row and column, G = (softmax_rows - I + softmax_cols - I) / (2 B) with
  the diagonal summed from the negatives."""
  img, txt = np.float64(img), np.float64(txt)
  cos = img @ txt.T
  logits = scale * cos
  eye = np.eye(logits.shape[0], dtype=bool)

  def direction(lg):
    e = np.exp(lg - lg.max(axis=1, keepdims=True))
    e_neg = np.where(eye, 0.0, e)
    total = e.sum(axis=1, keepdims=True)
    g = e_neg / total
    g[eye] = -e_neg.sum(axis=1) / total[:, 0]
    return np.log1p(e_neg.sum(axis=1) / np.diagonal(e)), g

  (t_i2t, g_i2t), (t_t2i, g_t2i) = direction(logits), direction(logits.T)
  g = (g_i2t + g_t2i.T) / (2 * logits.shape[0])
  return (0.5 * (t_i2t.mean() + t_t2i.mean()),
          (scale * g @ txt, scale * g.T @ img, np.sum(g * cos)))


def _separated(n, d=64, seed=5):
  """Unit images; texts within ~0.3 of their image (cosine ~0.96), so every
  matching pair dominates its row and column."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  img = unit(rng.normal(size=(n, d)))
  txt = unit(img + 0.3 * rng.normal(size=(n, d)) / np.sqrt(d))
  return img.astype(np.float32), txt.astype(np.float32)


@pytest.mark.parametrize('shape,names,axis_name,batch', [
    pytest.param((8,), ('x',), 'x', 32, id='8', marks=pytest.mark.slow),
    # b_local = 1: the own block has no negatives
    pytest.param((8,), ('x',), 'x', 8, id='8-b_local1'),
    pytest.param((2, 4), ('data', 'fsdp'), ('data', 'fsdp'), 32,
                 id='data2xfsdp4', marks=pytest.mark.slow),
])
def test_clip_blockwise_near_separated_matches_float64(shape, names,
                                                       axis_name, batch):
  """Losses 1e-2 .. 1e-7: value and gradients within 1e-4 (relative; for a
  gradient max |g - g0| / max |g0|) of the float64 formula. The ring folds a
  logsumexp of the negatives only; folding all B logits and subtracting the
  positive cancels here (relative error ~1 at 1e-7)."""
  f = jax.jit(jax.value_and_grad(_sharded(
      lambda a, c, s: losses.clip_loss_blockwise(a, c, s, axis_name),
      _mesh(shape, names), axis_name, 2, 1), (0, 1, 2)))
  img, txt = _separated(batch)
  for target in (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7):
    scale = optimize.brentq(
        lambda s: np.log(_clip_ref64(img, txt, s)[0] / target), 0.1, 300.0,
        xtol=1e-12)
    scale = float(np.float32(scale))
    value0, grads0 = _clip_ref64(img, txt, scale)
    value, grads = f(img, txt, jnp.float32(scale))
    assert abs(float(value) - value0) <= 1e-4 * value0, (target, value,
                                                         value0)
    for g, g0 in zip(grads, grads0):
      err = np.max(np.abs(np.float64(g) - g0)) / np.max(np.abs(g0))
      assert err <= 1e-4, (target, err)


def test_clip_blockwise_single_pair_is_zero_with_zero_gradients():
  """B = 1: no negatives anywhere, loss 0 and finite (zero) gradients."""
  f = jax.value_and_grad(_sharded(
      lambda a, c, s: losses.clip_loss_blockwise(a, c, s, 'x'),
      _mesh((1,), ('x',)), 'x', 2, 1), (0, 1, 2))
  img, txt = _separated(1, d=8)
  value, grads = f(img, txt, jnp.float32(10.0))
  assert float(value) == 0.0
  for g in grads:
    np.testing.assert_array_equal(np.asarray(g), 0.0)


# The ring of eq. 6 is ppcl_loss_blockwise's, covered on every config above;
# here one of each kind (odd, 8, 2-D) keeps compile time down.
PROLIP_IDS = ('3', '8', 'data4xfsdp2')


@pytest.mark.parametrize(
    'shape,names,axis_name',
    [pytest.param(*cfg, id=i, marks=() if i == '3' else pytest.mark.slow)
     for cfg, i in zip(CONFIGS, IDS) if i in PROLIP_IDS])
def test_prolip_blockwise_matches_dense(shape, names, axis_name):
  """Eq. 6 sharded == dense, masked copies of each shard's first rows."""
  mesh = _mesh(shape, names)
  n_dev = int(np.prod(shape))

  def sharded(mi, li, mt, lt, mmi, lmi, mmt, lmt, s, bb):
    return losses.prolip_loss_blockwise(
        GaussianBatch(mi, li), GaussianBatch(mt, lt), s, bb,
        GaussianBatch(mmi, lmi), GaussianBatch(mmt, lmt), axis_name=axis_name)

  # Dense reference: the masked rows (first N_MASKED_LOCAL of every shard)
  # moved to the front, which changes no other term.
  rows = _masked_rows(n_dev)
  order = np.concatenate([rows, np.setdiff1d(np.arange(B), rows)])

  f = _sharded(sharded, mesh, axis_name, 8, 2)
  args = (*_batch(), *_masked(n_dev), jnp.float32(10.0), jnp.float32(-10.0))
  argnums = tuple(range(10))
  (value, metrics), grads = jax.value_and_grad(f, argnums, has_aux=True)(*args)
  (value0, metrics0), grads0 = _dense_prolip(*args, order)
  assert set(metrics) == set(metrics0)
  assert int(metrics['guard_dropped']) == 0
  for name in metrics0:
    _assert_close(metrics[name], metrics0[name])
  _assert_close(value, value0)
  for g, g0 in zip(grads, grads0):
    _assert_close(g, g0)


def test_grad_inside_shard_map_is_global_gradient():
  """jax.grad taken per device inside shard_map gives the global gradient."""
  mesh = _mesh((2, 4), ('data', 'fsdp'))
  axis_name = ('data', 'fsdp')

  def per_device(mi, li, mt, lt, s, bb):
    g = jax.grad(losses.ppcl_loss_blockwise, tuple(range(6)))(
        mi, li, mt, lt, s, bb, axis_name)
    return g

  spec = P(axis_name)
  f = jax.jit(jax.shard_map(per_device, mesh=mesh,
                            in_specs=(spec,) * 4 + (P(), P()),
                            out_specs=(spec,) * 4 + (P(), P())))
  args = (*_batch(), jnp.float32(10.0), jnp.float32(-10.0))
  grads = f(*args)
  _, grads0 = _dense_ppcl(*args)
  for g, g0 in zip(grads, grads0):
    _assert_close(g, g0)


def test_loss_is_identical_on_every_device():
  mesh = _mesh((8,), ('x',))
  f = jax.jit(jax.shard_map(
      lambda a, b, c, d: losses.ppcl_loss_blockwise(
          a, b, c, d, 10.0, -10.0, 'x')[None],
      mesh=mesh, in_specs=(P('x'),) * 4, out_specs=P('x')))
  per_device = np.asarray(f(*_batch()))
  assert per_device.shape == (8,)
  assert np.all(per_device == per_device[0])


def test_bf16_inputs_travel_in_bf16_and_score_in_f32():
  mesh = _mesh((4,), ('x',))
  f = _sharded(
      lambda a, b, c, d: losses.ppcl_loss_blockwise(a, b, c, d, 10.0, -10.0,
                                                    'x'), mesh, 'x', 4, 0)
  bf16 = [x.astype(jnp.bfloat16) for x in _batch()]
  value = f(*bf16)
  assert value.dtype == jnp.float32
  _assert_close(value, losses.ppcl_loss(*bf16, 10.0, -10.0))


def _sigmoid_pairs64(logits):
  """float64 numpy: -sum_ij log sigmoid(y_ij logit_ij) / n, y = +1 on i == j."""
  y = 2.0 * np.eye(*logits.shape) - 1.0
  return np.sum(np.logaddexp(0.0, -y * logits)) / logits.shape[0]


def test_float64_inputs_stay_float64_on_the_ring():
  """With x64, float64 shards give float64 global losses equal to float64
  references to ~1e-12 (float32 arithmetic would be ~1e-7 off), on an even
  ring (the antipodal hop) and on both one-way CLIP passes."""
  mesh = _mesh((4,), ('x',))
  mi, li, mt, lt = (np.float64(x) for x in _batch())
  tr_i, tr_t = np.exp(li).sum(1), np.exp(lt).sum(1)
  ppcl64 = _sigmoid_pairs64(
      10.0 * (mi @ mt.T - 0.5 * tr_i[:, None] - 0.5 * tr_t[None]) - 10.0)
  with jax.enable_x64(True):
    args = [jnp.asarray(x) for x in (mi, li, mt, lt)]
    s, bb = jnp.float64(10.0), jnp.float64(-10.0)
    got = {
        'ppcl': _sharded(functools.partial(losses.ppcl_loss_blockwise,
                                           axis_name='x'),
                         mesh, 'x', 4, 2)(*args, s, bb),
        'siglip': _sharded(functools.partial(losses.siglip_loss_blockwise,
                                             axis_name='x'),
                           mesh, 'x', 2, 2)(args[0], args[2], s, bb),
        'clip': _sharded(functools.partial(losses.clip_loss_blockwise,
                                           axis_name='x'),
                         mesh, 'x', 2, 1)(args[0], args[2], s),
    }
    prolip, _ = _sharded(
        lambda a, b, c, d, e, f: losses.prolip_loss_blockwise(
            GaussianBatch(a, b), GaussianBatch(c, d), e, f, axis_name='x'),
        mesh, 'x', 4, 2)(*args, s, bb)
    prolip0, _ = losses.prolip_loss(GaussianBatch(*args[:2]),
                                    GaussianBatch(*args[2:]), s, bb)
  want = {'ppcl': ppcl64, 'siglip': _sigmoid_pairs64(10.0 * mi @ mt.T - 10.0),
          'clip': _clip_ref64(mi, mt, 10.0)[0]}
  for name, value in got.items():
    assert value.dtype == jnp.float64, name
    np.testing.assert_allclose(np.asarray(value), want[name], rtol=1e-12,
                               err_msg=name)
  assert prolip.dtype == prolip0.dtype == jnp.float64
  np.testing.assert_allclose(np.asarray(prolip), np.asarray(prolip0),
                             rtol=1e-12)


def test_mismatched_local_batches_raise():
  mesh = _mesh((2,), ('x',))
  mu_img, _, mu_txt, _ = _batch()
  f = jax.shard_map(
      lambda a, c: losses.siglip_loss_blockwise(a, c, 10.0, -10.0, 'x'),
      mesh=mesh, in_specs=(P('x'), P('x')), out_specs=P())
  with pytest.raises(ValueError, match='row-aligned'):
    f(mu_img, mu_txt[:B // 2])


@pytest.mark.parametrize('squared', [False, True])
def test_difference_alignment_loss_sharded_matches_dense(squared):
  """PC-CLIP's eq. 4 (on the CLIP ring) and eq. 5 with ``axis_name``."""
  mesh = _mesh((8,), ('x',))
  mu_img, _, mu_txt, _ = _batch()
  g_j = _unit(jnp.roll(mu_img, 3, axis=0) + 0.5 * mu_txt)
  args = (mu_img, g_j, mu_txt)
  f = _sharded(lambda a, b, c: losses.difference_alignment_loss(
      a, b, c, scale=4.0, squared=squared, axis_name='x'), mesh, 'x', 3, 0)
  dense = lambda a, b, c: losses.difference_alignment_loss(
      a, b, c, scale=4.0, squared=squared)
  value, grads = jax.value_and_grad(f, (0, 1, 2))(*args)
  value0, grads0 = jax.value_and_grad(dense, (0, 1, 2))(*args)
  _assert_close(value, value0)
  for g, g0 in zip(grads, grads0):
    np.testing.assert_allclose(
        np.asarray(g), np.asarray(g0), rtol=1e-4,
        atol=5e-5 * float(np.max(np.abs(np.asarray(g0)))))
