"""Objectives beyond ProLIP: PCME++ PML, OTTER, UniCLIP MP-NCE, PC-CLIP.

Each loss is checked against an independent float64 computation (numpy
transcriptions of the papers' formulas, explicit Python loops, or ott-jax's
Sinkhorn solver), and the blockwise (ring) forms against the dense ones on
the 8 host CPU devices forced by conftest.py.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from prolip_jax.applications import pcclip as pcclip_apps
from prolip_jax.data.transforms import identity_aug_vector
from prolip_jax.losses import contrastive
from prolip_jax.losses import otter
from prolip_jax.losses import pcclip
from prolip_jax.losses import pcme
from prolip_jax.losses import uniclip
from prolip_jax.models import heads
from prolip_jax.training import optimizer
from prolip_jax.objectives import uniclip as uniclip_objective


def _f64(x):
  return np.asarray(x, np.float64)


def _unit(x):
  x = _f64(x)
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _rand_unit(seed, shape):
  return _unit(np.random.default_rng(seed).normal(size=shape))


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def _log_softmax(x, axis):
  m = x.max(axis=axis, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _mesh(shape, names):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


# --------------------------------------------------------------------------
# PCME++ probabilistic matching loss
# --------------------------------------------------------------------------


def pml_loop(mu_i, lv_i, mu_t, lv_t, a, b, matched=None):
  """PML with a double loop: BCE(-a * CSD + b) averaged over all pairs."""
  n, m = len(mu_i), len(mu_t)
  total = 0.0
  for i in range(n):
    for j in range(m):
      dist = (np.sum((mu_i[i] - mu_t[j])**2) + np.sum(np.exp(lv_i[i]))
              + np.sum(np.exp(lv_t[j])))
      logit = -a * dist + b
      y = (1.0 if i == j else 0.0) if matched is None else matched[i, j]
      total -= y * _log_sigmoid(logit) + (1 - y) * _log_sigmoid(-logit)
  return total / (n * m)


@functools.lru_cache(maxsize=None)
def _gaussians(n=12, d=6):
  rng = np.random.default_rng(3)
  mu_i = _rand_unit(1, (n, d))
  mu_t = _unit(mu_i + 0.7 * rng.normal(size=(n, d)))
  lv_i = rng.normal(size=(n, d)) - 3.0
  lv_t = rng.normal(size=(n, d)) - 2.0
  return mu_i, lv_i, mu_t, lv_t


def test_pml_matches_double_loop():
  mu_i, lv_i, mu_t, lv_t = _gaussians()
  for a, b in ((5.0, 5.0), (2.0, -1.0)):
    got = pcme.pcme_pml_loss(mu_i, lv_i, mu_t, lv_t, a, b)
    np.testing.assert_allclose(got, pml_loop(mu_i, lv_i, mu_t, lv_t, a, b),
                               rtol=1e-5)
  # Soft / multi-positive labels on a rectangular batch.
  matched = np.random.default_rng(0).uniform(size=(12, 7))
  got = pcme.pcme_pml_loss(mu_i, lv_i, mu_t[:7], lv_t[:7], 3.0, 1.0,
                           matched=matched)
  np.testing.assert_allclose(
      got, pml_loop(mu_i, lv_i, mu_t[:7], lv_t[:7], 3.0, 1.0, matched),
      rtol=1e-5)


def test_pml_blockwise_equals_dense_on_8_devices():
  mu_i, lv_i, mu_t, lv_t = (jnp.asarray(x, jnp.float32) for x in
                            _gaussians(n=16))
  mesh = _mesh((8,), ('x',))
  f = jax.jit(jax.shard_map(
      functools.partial(pcme.pcme_pml_loss_blockwise, axis_name='x'),
      mesh=mesh, in_specs=(P('x'),) * 4 + (P(), P()), out_specs=P()))
  got = f(mu_i, lv_i, mu_t, lv_t, jnp.float32(5.0), jnp.float32(5.0))
  np.testing.assert_allclose(
      got, pml_loop(*map(_f64, (mu_i, lv_i, mu_t, lv_t)), 5.0, 5.0),
      rtol=1e-5)


# --------------------------------------------------------------------------
# OTTER: Sinkhorn (Algorithm 2), targets, loss
# --------------------------------------------------------------------------


def sinkhorn_np(S, lam, n_iter):
  """OTTER's Algorithm 2, literally, in float64 (no log space)."""
  T = np.exp(_f64(S) / lam)
  T = T / T.sum()
  n = T.shape[0]
  for _ in range(n_iter):
    T = T / (T.sum(axis=1, keepdims=True) * n)
    T = T / (T.sum(axis=0, keepdims=True) * n)
  return T / T.sum(axis=1, keepdims=True)


def _similarity(n=10, d=8, seed=0):
  img = _rand_unit(seed, (n, d))
  txt = _unit(img + 0.8 * np.random.default_rng(seed + 1).normal(size=(n, d)))
  return img @ txt.T + img @ img.T + txt @ txt.T


@pytest.mark.parametrize('n_iter', [0, 1, 5, 20])
def test_sinkhorn_matches_algorithm_2(n_iter):
  S = _similarity()
  np.testing.assert_allclose(otter.sinkhorn(S, 0.15, n_iter),
                             sinkhorn_np(S, 0.15, n_iter), rtol=2e-5,
                             atol=1e-7)


def test_sinkhorn_zero_iterations_is_row_softmax():
  S = _similarity(seed=4)
  np.testing.assert_allclose(otter.sinkhorn(S, 0.3, 0),
                             np.exp(_log_softmax(S / 0.3, axis=1)),
                             rtol=1e-5, atol=1e-8)


def test_sinkhorn_marginals_converge_to_uniform():
  S = np.random.default_rng(5).uniform(-1.0, 1.0, (12, 12))
  errs = []
  for n_iter in (0, 2, 10, 100):
    T = np.asarray(otter.sinkhorn(S, 0.15, n_iter), np.float64)
    np.testing.assert_allclose(T.sum(1), 1.0, rtol=1e-5)  # rows, always
    errs.append(np.abs(T.sum(0) - 1.0).max())  # columns, as it converges
  assert errs[0] > 0.5, errs  # a softmax is far from doubly stochastic
  assert errs[0] > errs[1] > errs[2] > errs[3], errs
  assert errs[3] < 1e-5, errs


@pytest.mark.slow  # imports ott-jax; the tests above check Algorithm 2
def test_sinkhorn_plan_equals_ott_jax():
  """Converged Algorithm 2 == N x ott-jax's entropic plan with C = -S,
  epsilon = lam (absolute) and uniform marginals 1/N."""
  ott_geometry = pytest.importorskip('ott.geometry.geometry')
  linear_problem = pytest.importorskip('ott.problems.linear.linear_problem')
  ott_sinkhorn = pytest.importorskip('ott.solvers.linear.sinkhorn')
  n = 9
  S = jnp.asarray(np.random.default_rng(7).uniform(-1.0, 1.0, (n, n)),
                  jnp.float32)
  for lam in (0.15, 0.5):
    geom = ott_geometry.Geometry(cost_matrix=-S, epsilon=lam,
                                 relative_epsilon=None, scale_cost=1.0)
    a = jnp.full((n,), 1.0 / n)
    prob = linear_problem.LinearProblem(geom, a, a)
    out = ott_sinkhorn.Sinkhorn(threshold=1e-6, max_iterations=5000)(prob)
    assert bool(out.converged)
    np.testing.assert_allclose(otter.sinkhorn(S, lam, 200), n * out.matrix,
                               rtol=1e-4)


def test_duplicated_captions_split_target_mass():
  """Three copies of one pair: each copy's image puts its (off-diagonal)
  mass on the OTHER copies' captions, split equally; other images see the
  copies' captions as equal candidates."""
  n, d = 10, 16
  img = _rand_unit(11, (n, d))
  txt = _rand_unit(12, (n, d))
  dup = [2, 5, 7]
  img[dup] = img[2]
  txt[dup] = txt[2]
  m_v, m_t = (np.asarray(m, np.float64) for m in otter.otter_targets(
      img, txt, lam=0.15, n_iter=5))
  for m in (m_v, m_t):
    np.testing.assert_allclose(np.diag(m), 0.0, atol=0)
    for j in dup:
      others = [k for k in dup if k != j]
      np.testing.assert_allclose(m[j, others[0]], m[j, others[1]], rtol=1e-4)
      assert m[j, others].sum() > 0.95, m[j]
    for i in set(range(n)) - set(dup):
      np.testing.assert_allclose(m[i, 2], m[i, 5], rtol=1e-4)
      np.testing.assert_allclose(m[i, 2], m[i, 7], rtol=1e-4)


def otter_np(img, txt, img_t, txt_t, scale, alpha, lam, n_iter, gv, gt, eta,
             lv_img=None, lv_txt=None):
  """OTTER's Algorithm 1 transcribed in float64."""
  img, txt, img_t, txt_t = map(_f64, (img, txt, img_t, txt_t))
  n = len(img)
  eye = np.eye(n)
  if lv_img is None:
    logits = scale * img @ txt.T
  else:
    tr_i = np.exp(_f64(lv_img)).sum(1)
    tr_t = np.exp(_f64(lv_txt)).sum(1)
    logits = scale * (img @ txt.T - 0.5 * tr_i[:, None] - 0.5 * tr_t[None])
  log_p_v = _log_softmax(logits, 1)
  log_p_t = _log_softmax(logits.T, 1)
  xent = lambda log_p, q: -np.sum(q * log_p) / n
  infonce = xent(log_p_v, eye) + xent(log_p_t, eye)
  sim_vv, sim_tt = img_t @ img_t.T, txt_t @ txt_t.T
  sim_vt, sim_tv = img_t @ txt_t.T, txt_t @ img_t.T
  s_v = gv * sim_vv + gt * sim_tt + sim_vt - eta * eye
  s_t = gv * sim_vv + gt * sim_tt + sim_tv - eta * eye
  m_v = sinkhorn_np(s_v, lam, n_iter) * (1 - eye)
  m_t = sinkhorn_np(s_t, lam, n_iter) * (1 - eye)
  distill = xent(log_p_v, m_v) + xent(log_p_t, m_t)
  return alpha * infonce + (1 - alpha) * distill, infonce, distill


@functools.lru_cache(maxsize=None)
def _otter_batch(n=16, d=8):
  rng = np.random.default_rng(21)
  img = _rand_unit(20, (n, d))
  txt = _unit(img + 0.9 * rng.normal(size=(n, d)))
  img_t = _unit(img + 0.3 * rng.normal(size=(n, d)))
  txt_t = _unit(txt + 0.3 * rng.normal(size=(n, d)))
  lv_img = rng.normal(size=(n, d)) - 3.0
  lv_txt = rng.normal(size=(n, d)) - 2.5
  return tuple(np.asarray(x, np.float32) for x in
               (img, txt, img_t, txt_t, lv_img, lv_txt))


@pytest.mark.parametrize('probabilistic', [False, True])
def test_otter_loss_matches_numpy(probabilistic):
  img, txt, img_t, txt_t, lv_img, lv_txt = _otter_batch()
  kw = dict(alpha=0.3, lam=0.15, n_iter=5, gamma_v=0.7, gamma_t=1.2,
            eta=100.0)
  lvs = (lv_img, lv_txt) if probabilistic else (None, None)
  loss, metrics = otter.otter_loss(img, txt, img_t, txt_t, 8.0,
                                   logvar_img=lvs[0], logvar_txt=lvs[1], **kw)
  want, infonce, distill = otter_np(
      img, txt, img_t, txt_t, 8.0, kw['alpha'], kw['lam'], kw['n_iter'],
      kw['gamma_v'], kw['gamma_t'], kw['eta'], *lvs)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(metrics['infonce'], infonce, rtol=1e-5)
  np.testing.assert_allclose(metrics['otter_distill'], distill, rtol=1e-5)
  if not probabilistic:  # alpha = 1: L_v + L_t = 2 x CLIP's mean InfoNCE
    hard, _ = otter.otter_loss(img, txt, img_t, txt_t, 8.0, alpha=1.0)
    np.testing.assert_allclose(hard, 2 * contrastive.clip_loss(img, txt, 8.0),
                               rtol=1e-5)


OTTER_SHARDED = [((8,), ('x',), 'x', False),
                 ((2, 4), ('data', 'fsdp'), ('data', 'fsdp'), False),
                 ((8,), ('x',), 'x', True)]


@pytest.mark.parametrize('shape,names,axis_name,probabilistic', [
    pytest.param(*OTTER_SHARDED[0], id='8', marks=pytest.mark.slow),
    pytest.param(*OTTER_SHARDED[1], id='data2xfsdp4'),
    pytest.param(*OTTER_SHARDED[2], id='8-csd', marks=pytest.mark.slow)])
def test_otter_blockwise_equals_dense(shape, names, axis_name, probabilistic):
  """Value, metrics and gradients (student arrays, scale) of the ring form
  equal the dense loss on the gathered batch."""
  img, txt, img_t, txt_t, lv_img, lv_txt = (
      jnp.asarray(x) for x in _otter_batch(n=32))
  kw = dict(alpha=0.4, lam=0.15, n_iter=5, gamma_v=0.8, gamma_t=1.1)
  scale = jnp.float32(6.0)

  def dense(img, txt, lv_img, lv_txt, scale):
    lvs = (lv_img, lv_txt) if probabilistic else (None, None)
    return otter.otter_loss(img, txt, img_t, txt_t, scale, logvar_img=lvs[0],
                            logvar_txt=lvs[1], **kw)

  def per_device(img, txt, img_t, txt_t, lv_img, lv_txt, scale):
    lvs = (lv_img, lv_txt) if probabilistic else (None, None)
    return otter.otter_loss_blockwise(img, txt, img_t, txt_t, scale,
                                      axis_name, logvar_img=lvs[0],
                                      logvar_txt=lvs[1], **kw)

  sharded = jax.shard_map(per_device, mesh=_mesh(shape, names),
                          in_specs=(P(axis_name),) * 6 + (P(),),
                          out_specs=P())

  def ring(img, txt, lv_img, lv_txt, scale):
    return sharded(img, txt, img_t, txt_t, lv_img, lv_txt, scale)

  argnums = (0, 1, 2, 3, 4)
  (want, want_m), want_g = jax.jit(jax.value_and_grad(
      dense, argnums, has_aux=True))(img, txt, lv_img, lv_txt, scale)
  (got, got_m), got_g = jax.jit(jax.value_and_grad(
      ring, argnums, has_aux=True))(img, txt, lv_img, lv_txt, scale)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5)
  for g_got, g_want in zip(got_g, want_g):
    np.testing.assert_allclose(g_got, g_want, rtol=1e-4, atol=1e-6)
  if probabilistic:
    assert float(jnp.abs(want_g[2]).max()) > 0  # logvars do get gradients


def test_ema_update():
  teacher = {'w': jnp.ones((3,), jnp.float32),
             'b': {'c': jnp.full((2,), 2.0, jnp.bfloat16)}}
  student = {'w': jnp.zeros((3,), jnp.float32),
             'b': {'c': jnp.full((2,), 4.0, jnp.bfloat16)}}
  out = optimizer.ema_update(teacher, student, decay=0.9)
  np.testing.assert_allclose(out['w'], 0.9, rtol=1e-7)
  np.testing.assert_allclose(np.asarray(out['b']['c'], np.float32), 2.2,
                             rtol=1e-2)
  assert out['b']['c'].dtype == jnp.bfloat16


# --------------------------------------------------------------------------
# UniCLIP: MP-NCE with domain-dependent similarity
# --------------------------------------------------------------------------


def mp_nce_loop(views, txt, tau, off, w, ids=None):
  """Eq. 12 / 16 with explicit loops over anchors and positives."""
  views, txt = _f64(views), _f64(txt)
  v, n, _ = views.shape
  ids = np.arange(n) if ids is None else np.asarray(ids)
  items = [(views[a, k], 0, ids[k]) for a in range(v) for k in range(n)]
  items += [(txt[k], 1, ids[k]) for k in range(n)]
  m = len(items)

  def score(i, j):
    zi, di, _ = items[i]
    zj, dj, _ = items[j]
    cos = zi @ zj / (np.linalg.norm(zi) * np.linalg.norm(zj))
    dom = di + dj
    return math.exp((cos - off[dom]) / tau[dom]), dom

  total = 0.0
  for i in range(m):
    pos = [j for j in range(m) if items[j][2] == items[i][2]]  # incl. i
    neg = [j for j in range(m) if items[j][2] != items[i][2]]
    neg_sum = sum(score(i, j)[0] for j in neg)
    li = 0.0
    for p in pos:
      s, dom = score(i, p)
      li += -w[dom] * math.log(s / (s + neg_sum))
    total += li / len(pos)
  return total / m


@functools.lru_cache(maxsize=None)
def _uniclip_batch(v=3, n=5, d=8):
  rng = np.random.default_rng(30)
  base = rng.normal(size=(n, d))
  views = base[None] + 0.5 * rng.normal(size=(v, n, d))
  txt = base + 1.0 * rng.normal(size=(n, d))
  return views.astype(np.float32), txt.astype(np.float32)


TAU = np.array([0.1, 0.07, 0.2])
OFF = np.array([0.3, -0.1, 0.05])


@pytest.mark.parametrize('ids', [None, (0, 1, 2, 1, 3)],
                         ids=['distinct', 'duplicate'])
def test_mp_nce_matches_loop(ids):
  views, txt = _uniclip_batch()
  loss, metrics = uniclip.mp_nce_loss(views, txt, TAU, OFF,
                                      sample_ids=ids)
  want = mp_nce_loop(views, txt, TAU, OFF, uniclip.UNICLIP_WEIGHTS, ids)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  parts = sum(metrics[f'mp_nce_{k}'] for k in uniclip.DOMAIN_PAIRS)
  np.testing.assert_allclose(parts, loss, rtol=1e-5)
  # Unweighted (eq. 11) too, and the part of each domain pair.
  loss1, _ = uniclip.mp_nce_loss(views, txt, TAU, OFF, weights=None,
                                 sample_ids=ids)
  np.testing.assert_allclose(
      loss1, mp_nce_loop(views, txt, TAU, OFF, (1, 1, 1), ids), rtol=1e-5)
  for k, name in enumerate(uniclip.DOMAIN_PAIRS):
    only = [0.0, 0.0, 0.0]
    only[k] = 1.0
    np.testing.assert_allclose(
        metrics[f'mp_nce_{name}'],
        mp_nce_loop(views, txt, TAU, OFF,
                    np.array(only) * uniclip.UNICLIP_WEIGHTS, ids),
        rtol=1e-5, atol=1e-7)


def test_mp_nce_gradient_on_every_positive_is_negative():
  """Eq. 10: dL_i/ds_iq = -(1/|P|) sum_n s_in / (s_iq (s_iq + sum_n s_in)) < 0
  for every positive, easy ones included; SupCon's is positive for an easy
  positive on the same scores (eq. 8)."""
  rng = np.random.default_rng(40)
  m = 12
  ids = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
  positives = ids[:, None] == ids[None, :]
  logits = rng.normal(size=(m, m)) * 2.0
  logits[np.eye(m, dtype=bool)] = 8.0  # the trivial pair: very easy
  w = np.ones((m, m))
  grad = np.asarray(jax.grad(lambda l: jnp.sum(uniclip.mp_nce_from_logits(
      l, positives, w)))(jnp.asarray(logits, jnp.float32)), np.float64)
  assert np.all(grad[positives] < 0), grad[positives]
  # Eq. 10 in closed form, chained through s = exp(l): dL/dl = s dL/ds.
  s = np.exp(logits)
  neg_sum = np.where(positives, 0.0, s).sum(1, keepdims=True)
  n_pos = positives.sum(1, keepdims=True)
  eq10 = -neg_sum / (n_pos * s * (s + neg_sum))
  np.testing.assert_allclose(grad[positives], (s * eq10)[positives],
                             rtol=1e-4, atol=1e-7)

  def supcon(l):
    lse_all = jax.nn.logsumexp(l, axis=1, keepdims=True)
    return jnp.sum(jnp.where(positives, lse_all - l, 0.0) / n_pos)

  g_sup = np.asarray(jax.grad(supcon)(jnp.asarray(logits, jnp.float32)))
  assert np.any(g_sup[positives] > 0)


def test_mp_nce_domain_offsets_and_temperatures_get_gradients():
  views, txt = _uniclip_batch()
  f = lambda tau, off: uniclip.mp_nce_loss(views, txt, tau, off)[0]
  g_tau, g_off = jax.grad(f, (0, 1))(jnp.asarray(TAU, jnp.float32),
                                     jnp.asarray(OFF, jnp.float32))
  assert np.all(np.abs(np.asarray(g_off)) > 1e-4), g_off
  assert np.all(np.abs(np.asarray(g_tau)) > 1e-4), g_tau
  # Offsets act relatively (eq. 15): a common shift with a shared tau is a
  # no-op, a shift of one domain pair is not.
  tau = np.full(3, 0.1)
  base = f(tau, OFF)
  np.testing.assert_allclose(f(tau, OFF + 0.2), base, rtol=1e-5)
  assert abs(float(f(tau, OFF + np.array([0.2, 0, 0]))) - float(base)) > 1e-3


@pytest.mark.parametrize('shape,names,axis_name,dup', [
    ((8,), ('x',), 'x', False),
    ((2, 4), ('data', 'fsdp'), ('data', 'fsdp'), True)],
                         ids=['8', 'data2xfsdp4-duplicates'])
def test_mp_nce_sharded_equals_dense(shape, names, axis_name, dup):
  rng = np.random.default_rng(31)
  v, n, d = 3, 16, 8
  base = rng.normal(size=(n, d))
  views = jnp.asarray(base[None] + 0.5 * rng.normal(size=(v, n, d)),
                      jnp.float32)
  txt = jnp.asarray(base + rng.normal(size=(n, d)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, 10, n) if dup else np.arange(n))
  tau, off = jnp.asarray(TAU, jnp.float32), jnp.asarray(OFF, jnp.float32)

  def dense(views, txt, tau, off):
    return uniclip.mp_nce_loss(views, txt, tau, off, sample_ids=ids)

  def per_device(views, txt, ids, tau, off):
    return uniclip.mp_nce_loss_sharded(views, txt, tau, off, axis_name,
                                       sample_ids=ids if dup else None)

  sharded = jax.shard_map(
      per_device, mesh=_mesh(shape, names),
      in_specs=(P(None, axis_name), P(axis_name), P(axis_name), P(), P()),
      out_specs=P())
  args = (views, txt, tau, off)
  (want, want_m), want_g = jax.jit(jax.value_and_grad(
      dense, (0, 1, 2, 3), has_aux=True))(*args)
  (got, got_m), got_g = jax.jit(jax.value_and_grad(
      lambda a, b, c, e: sharded(a, b, ids, c, e), (0, 1, 2, 3),
      has_aux=True))(*args)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5)
  for g_got, g_want in zip(got_g, want_g):
    np.testing.assert_allclose(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_uniclip_weights_and_params():
  assert uniclip.default_weights(3) == pytest.approx((1 / 9, 1 / 6, 1))
  tau, off = uniclip_objective.uniclip_scalars(
      uniclip_objective.init_uniclip_params())
  np.testing.assert_allclose(tau, 0.07, rtol=1e-6)
  np.testing.assert_allclose(off, 0.0)


# --------------------------------------------------------------------------
# UniCLIP heads
# --------------------------------------------------------------------------


def _gelu(x):
  from scipy.special import erf  # pylint: disable=g-import-not-at-top
  return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _ln(x, p, eps=1e-6):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu)**2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * _f64(p['scale']) + _f64(p['bias'])


def _dense(x, p):
  return x @ _f64(p['kernel']) + _f64(p['bias'])


def _random_params(module, seed, *args):
  """Parameters of ``module`` with the shapes of its init, filled with
  N(0, 0.5^2) (LayerNorm scales around 1): no init compile needed."""
  shapes = jax.eval_shape(module.init, jax.random.key(0), *args)['params']
  rng = np.random.default_rng(seed)
  def fill(path, s):
    offset = 1.0 if path[-1].key == 'scale' else 0.0
    return jnp.asarray(offset + 0.5 * rng.normal(size=s.shape), s.dtype)
  return jax.tree_util.tree_map_with_path(fill, shapes)


def head_np(params, h, aug, num_blocks):
  """AugAwareImageHead's forward pass in numpy, from its parameters."""
  a = _dense(_gelu(_dense(_f64(aug), params['aug_encoder']['fc1'])),
             params['aug_encoder']['fc2'])
  x = _dense(np.concatenate([_f64(h), a], -1), params['proj_in'])
  for k in range(num_blocks):
    p = params[f'block{k}']
    x = x + _dense(_gelu(_dense(_ln(x, p['ln']), p['fc1'])), p['fc2'])
  return _dense(_ln(x, params['ln_out']), params['proj_out'])


def test_aug_aware_head_matches_numpy_and_uses_augmentation():
  head = heads.AugAwareImageHead(embed_dim=8, width=12, num_blocks=3,
                                 aug_features=6, aug_hidden=10)
  rng = np.random.default_rng(50)
  h = rng.normal(size=(4, 20)).astype(np.float32)
  aug = np.tile(identity_aug_vector(), (4, 1))
  aug[1, 9] = 1.0  # flipped
  aug[2, 10] = 1.0  # grayscale
  aug[3, :4] = (0.1, 0.05, 0.8, 0.9)  # a crop
  params = _random_params(head, 0, h, aug)
  assert len([k for k in params if k.startswith('block')]) == 3
  z = head.apply({'params': params}, h, aug)
  np.testing.assert_allclose(z, head_np(params, h, aug, 3), rtol=1e-4,
                             atol=1e-5)
  # Same features, different augmentation -> different embedding.
  z_same_h = head.apply({'params': params}, np.repeat(h[:1], 4, 0), aug)
  assert np.all(np.abs(np.asarray(z_same_h[1:] - z_same_h[:1])).max(1)
                > 1e-4)
  # The ablation head ignores the augmentation (and has no f_A).
  plain = heads.AugAwareImageHead(embed_dim=8, use_aug=False)
  p_plain = _random_params(plain, 1, h)
  assert 'aug_encoder' not in p_plain
  np.testing.assert_array_equal(
      plain.apply({'params': p_plain}, h, aug),
      plain.apply({'params': p_plain}, h, np.zeros_like(aug)))
  with pytest.raises(ValueError):
    head.apply({'params': params}, h, aug[:, :5])


def test_text_head_is_linear():
  head = heads.TextHead(embed_dim=5)
  rng = np.random.default_rng(51)
  h = rng.normal(size=(3, 7)).astype(np.float32)
  params = _random_params(head, 2, h)
  np.testing.assert_allclose(head.apply({'params': params}, h),
                             _dense(h, params['proj']), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# PC-CLIP
# --------------------------------------------------------------------------


def test_difference_alignment_loss_matches_numpy():
  b, d = 6, 8
  gi, gj, ft = (_rand_unit(s, (b, d)) for s in (61, 62, 63))
  x = _unit(gi - gj)
  logits = 2.0 * x @ ft.T
  want = -0.5 * np.mean(np.diag(_log_softmax(logits, 1))
                        + np.diag(_log_softmax(logits, 0)))
  np.testing.assert_allclose(
      pcclip.difference_alignment_loss(gi, gj, ft, 2.0), want, rtol=1e-5)
  want_sq = np.mean(np.sum((x - ft)**2, 1))
  np.testing.assert_allclose(
      pcclip.difference_alignment_loss(gi, gj, ft, squared=True), want_sq,
      rtol=1e-5)
  raw = gi - gj
  np.testing.assert_allclose(
      pcclip.difference_alignment_loss(gi, gj, ft, squared=True,
                                       normalize=False),
      np.mean(np.sum((raw - ft)**2, 1)), rtol=1e-5)


def test_comparative_prompt_formula():
  rng = np.random.default_rng(70)
  fa, fb, fba = (rng.normal(size=(3, 8)) for _ in range(3))
  for alpha in (0.9, 0.5, 0.0):
    np.testing.assert_allclose(
        pcclip_apps.comparative_prompt(fa, fb, fba, alpha),
        alpha * fa + (1 - alpha) * (fb - fba), rtol=1e-5, atol=1e-6)
  out = pcclip_apps.comparative_prompt(fa, fb, fba, 0.7, normalize=True)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1), 1.0, rtol=1e-5)
  # Figure 3: with f_B - f_{B-A} pointing at the true class A, a misaligned
  # f_A is pulled towards it.
  true_a = np.array([1.0, 0.0, 0.0])
  fa, fb = np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.0, 1.0])
  fba = fb - true_a
  new = np.asarray(pcclip_apps.comparative_prompt(fa, fb, fba, 0.5))
  assert new @ true_a > fa @ true_a


def test_difference_classify_constructed_case():
  """Images g = base + c u with attribute direction u: eq. 2 ranks by c."""
  rng = np.random.default_rng(80)
  d = 16
  u = _unit(rng.normal(size=d))
  base = rng.normal(size=(20, d))
  base -= np.outer(base @ u, u)  # nothing along u but the attribute
  c = rng.uniform(-2, 2, size=20)
  g = base + c[:, None] * u
  i, j = np.arange(0, 20, 2), np.arange(1, 20, 2)
  pred = np.asarray(pcclip_apps.difference_classify(g[i], g[j], u))
  np.testing.assert_array_equal(pred, c[i] > c[j])
  np.testing.assert_array_equal(
      np.asarray(pcclip_apps.difference_classify(g[j], g[i], u)), ~pred)
  # Ties (identical images) count as "first has more" (the >= of eq. 2).
  assert bool(pcclip_apps.difference_classify(g[0], g[0], u))


# --------------------------------------------------------------------------
# float64 inputs are computed in float64, dense and on the ring
# --------------------------------------------------------------------------

# float32 arithmetic would be ~1e-7 off the float64 references.
F64_RTOL = 1e-11


def _assert_f64(got, want):
  assert got.dtype == jnp.float64, got.dtype
  np.testing.assert_allclose(np.asarray(got), want, rtol=F64_RTOL)


def test_float64_inputs_give_float64_objective_losses():
  mu_i, lv_i, mu_t, lv_t = _gaussians()
  views, txt = map(_f64, _uniclip_batch())
  img, txt_o, img_t, txt_t, lv_img, lv_txt = map(_f64, _otter_batch())
  gi, gj, ft = (_rand_unit(s, (6, 8)) for s in (61, 62, 63))
  kw = dict(alpha=0.3, lam=0.15, n_iter=5, gamma_v=0.7, gamma_t=1.2,
            eta=100.0)
  with jax.enable_x64(True):
    _assert_f64(pcme.pcme_pml_loss(*map(jnp.asarray, (mu_i, lv_i, mu_t,
                                                      lv_t)), 5.0, 5.0),
                pml_loop(mu_i, lv_i, mu_t, lv_t, 5.0, 5.0))
    loss, _ = uniclip.mp_nce_loss(jnp.asarray(views), jnp.asarray(txt), TAU,
                                  OFF)
    _assert_f64(loss, mp_nce_loop(views, txt, TAU, OFF,
                                  uniclip.UNICLIP_WEIGHTS))
    loss, _ = otter.otter_loss(*map(jnp.asarray, (img, txt_o, img_t, txt_t)),
                               8.0, logvar_img=jnp.asarray(lv_img),
                               logvar_txt=jnp.asarray(lv_txt), **kw)
    _assert_f64(loss, otter_np(img, txt_o, img_t, txt_t, 8.0, *kw.values(),
                               lv_img, lv_txt)[0])
    x = _unit(gi - gj)
    logits = 2.0 * x @ ft.T
    _assert_f64(pcclip.difference_alignment_loss(
        *map(jnp.asarray, (gi, gj, ft)), 2.0),
                -0.5 * np.mean(np.diag(_log_softmax(logits, 1))
                               + np.diag(_log_softmax(logits, 0))))


def test_float64_inputs_give_float64_on_the_ring():
  """The ring's carries and accumulators follow the inputs' dtype."""
  mu_i, lv_i, mu_t, lv_t = _gaussians(n=16)
  img, txt, img_t, txt_t, _, _ = map(_f64, _otter_batch())
  kw = dict(alpha=0.3, lam=0.15, n_iter=2, gamma_v=0.7, gamma_t=1.2,
            eta=100.0)
  mesh = _mesh((2,), ('x',))
  with jax.enable_x64(True):
    pml = jax.jit(jax.shard_map(
        functools.partial(pcme.pcme_pml_loss_blockwise, axis_name='x'),
        mesh=mesh, in_specs=(P('x'),) * 4 + (P(), P()), out_specs=P()))
    _assert_f64(pml(*map(jnp.asarray, (mu_i, lv_i, mu_t, lv_t)),
                    jnp.float64(5.0), jnp.float64(5.0)),
                pml_loop(mu_i, lv_i, mu_t, lv_t, 5.0, 5.0))
    ott = jax.jit(jax.shard_map(
        lambda *a: otter.otter_loss_blockwise(*a, axis_name='x', **kw)[0],
        mesh=mesh, in_specs=(P('x'),) * 4 + (P(),), out_specs=P()))
    _assert_f64(ott(*map(jnp.asarray, (img, txt, img_t, txt_t)),
                    jnp.float64(8.0)),
                otter_np(img, txt, img_t, txt_t, 8.0, *kw.values())[0])
