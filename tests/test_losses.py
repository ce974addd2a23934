"""Value tests of the pure loss functions (probabilistic.py, contrastive.py).

Every test compares the JAX float32 result with an independent float64
computation: numerical integration, Monte-Carlo sampling, a direct numpy
transcription of the paper's formulas, or an explicit Python loop over pairs.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate
from scipy import optimize
from scipy import special

from prolip_jax.losses import contrastive
from prolip_jax.losses import probabilistic as prob

EPSILONS = (0.0, -20.0, -100.0)


# --------------------------------------------------------------------------
# Independent float64 references.
# --------------------------------------------------------------------------


def _f64(x):
  return np.asarray(x, np.float64)


def _gauss_pdf(x, mu, var):
  return np.exp(-(x - mu)**2 / (2.0 * var)) / np.sqrt(2.0 * np.pi * var)


def inc_direct(mu1, lv1, mu2, lv2, eps):
  """Eq. 3 as printed, transcribed literally in float64 (s = sigma^2)."""
  mu1, lv1, mu2, lv2 = map(_f64, (mu1, lv1, mu2, lv2))
  s1, s2 = np.exp(lv1), np.exp(lv2)
  i1 = np.exp(eps) / s1
  i2 = np.exp(eps) / s2
  a = i1 + i2 / 2.0
  b = 2.0 * mu1 * i1 + mu2 * i2
  c = mu1**2 * i1 + mu2**2 * i2 / 2.0
  return (-2.0 * np.log(s1) - np.log(s2) - 0.5 * np.log(a) + b**2 / (4.0 * a)
          - c)


def hyp_ref(mu1, lv1, mu2, lv2, eps):
  """Per-dimension H(Z1 ⊂ Z2) = inc(Z1, Z2) - inc(Z2, Z1), float64."""
  return inc_direct(mu1, lv1, mu2, lv2, eps) - inc_direct(mu2, lv2, mu1, lv1,
                                                          eps)


def inclusion_loss_ref(mu1, lv1, mu2, lv2, c, eps):
  h = hyp_ref(mu1, lv1, mu2, lv2, eps)
  return np.mean(-special.log_expit(c * h))


def pairwise_sigmoid_ref(logit_fn, n, m):
  """-sum_ij log sigmoid(y_ij logit_ij) / n with an explicit double loop."""
  total = 0.0
  for i in range(n):
    for j in range(m):
      y = 1.0 if i == j else -1.0
      total += -float(special.log_expit(y * logit_fn(i, j)))
  return total / n


def ppcl_logit_ref(mu_i, lv_i, mu_j, lv_j, scale, bias):
  mu_i, lv_i, mu_j, lv_j = map(_f64, (mu_i, lv_i, mu_j, lv_j))
  return scale * (float(np.dot(mu_i, mu_j))
                  - 0.5 * (np.exp(lv_i).sum() + np.exp(lv_j).sum())) + bias


def ppcl_ref(mu_img, lv_img, mu_txt, lv_txt, scale, bias):
  return pairwise_sigmoid_ref(
      lambda i, j: ppcl_logit_ref(mu_img[i], lv_img[i], mu_txt[j], lv_txt[j],
                                  scale, bias),
      mu_img.shape[0], mu_txt.shape[0])


def vib_ref(mu, lv):
  """Mean closed-form KL(N(mu, s) || N(0, 1)) = 1/2 (s + mu^2 - 1 - log s)."""
  mu, lv = _f64(mu), _f64(lv)
  s = np.exp(lv)
  return np.mean(0.5 * (s + mu**2 - 1.0 - np.log(s)))


def _normalize(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _rand_gaussians(rng, n, d, lv_low=-6.0, lv_high=1.0):
  mu = _normalize(rng.normal(size=(n, d))).astype(np.float32)
  lv = rng.uniform(lv_low, lv_high, size=(n, d)).astype(np.float32)
  return mu, lv


# --------------------------------------------------------------------------
# 1. log_inclusion_exact against numerical integration.
# --------------------------------------------------------------------------

CASES_1D = [
    # (mu1, var1, mu2, var2)
    (0.0, 1.0, 0.0, 1.0),
    (0.3, 0.5, -0.2, 2.0),
    (0.1, 1e-3, 0.0, 10.0),  # narrow p1 inside a wide p2
    (0.0, 10.0, 0.05, 1e-3),  # wide p1, narrow p2
    (1.0, 0.04, -1.0, 0.04),  # separated means, integral ~ e^-33
    (0.5, 3.0, 0.0, 1e-2),
    (-0.2, 1e-4, 0.3, 1e-2),
]


def _window(mus, variances, width=20.0):
  sd = math.sqrt(max(variances))
  return min(mus) - width * sd, max(mus) + width * sd


@pytest.mark.parametrize('mu1,var1,mu2,var2', CASES_1D)
def test_log_inclusion_exact_1d_matches_quad(mu1, var1, mu2, var2):
  lo, hi = _window((mu1, mu2), (var1, var2))
  val, _ = integrate.quad(
      lambda x: _gauss_pdf(x, mu1, var1)**2 * _gauss_pdf(x, mu2, var2), lo, hi,
      points=sorted({mu1, mu2}), epsabs=0.0, epsrel=1e-11, limit=500)
  got = prob.log_inclusion_exact(
      jnp.array([mu1]), jnp.log(jnp.array([var1])), jnp.array([mu2]),
      jnp.log(jnp.array([var2])))
  assert got.shape == (1,) and got.dtype == jnp.float32
  np.testing.assert_allclose(float(got[0]), math.log(val), rtol=1e-5,
                             atol=5e-5)


CASES_2D = [
    ((0.2, -0.1), (0.5, 2.0), (0.0, 0.3), (1.5, 0.1)),
    ((0.0, 0.4), (1e-2, 5.0), (0.05, 0.0), (3.0, 2e-2)),
]


@pytest.mark.parametrize('mu1,var1,mu2,var2', CASES_2D)
def test_log_inclusion_exact_2d_matches_dblquad(mu1, var1, mu2, var2):
  def integrand(y, x):
    p1 = _gauss_pdf(x, mu1[0], var1[0]) * _gauss_pdf(y, mu1[1], var1[1])
    p2 = _gauss_pdf(x, mu2[0], var2[0]) * _gauss_pdf(y, mu2[1], var2[1])
    return p1 * p1 * p2

  # The product of Gaussians is concentrated near the narrower of p1, p2 in
  # each coordinate: integrate over 12 of its standard deviations.
  def box(k):
    if var1[k] <= var2[k]:
      m, v = mu1[k], var1[k] / 2.0
    else:
      m, v = mu2[k], var2[k]
    far = abs(mu1[k] - mu2[k])
    return m - 12.0 * math.sqrt(v) - far, m + 12.0 * math.sqrt(v) + far

  (xlo, xhi), (ylo, yhi) = box(0), box(1)
  val, _ = integrate.dblquad(integrand, xlo, xhi, ylo, yhi, epsabs=0.0,
                             epsrel=1e-9)
  got = prob.log_inclusion_exact(jnp.array(mu1), jnp.log(jnp.array(var1)),
                                 jnp.array(mu2), jnp.log(jnp.array(var2)))
  assert got.shape == (2,)
  np.testing.assert_allclose(float(jnp.sum(got)), math.log(val), rtol=1e-5,
                             atol=5e-5)


# --------------------------------------------------------------------------
# 2. log_inclusion (eq. 3 as printed) against its direct transcription.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('eps', EPSILONS)
def test_log_inclusion_matches_direct_formula(eps):
  rng = np.random.default_rng(0)
  mu1, lv1 = _rand_gaussians(rng, 5, 7, -18.0, 6.9)  # sigma^2 in [1e-8, 1e3]
  mu2, lv2 = _rand_gaussians(rng, 5, 7, -18.0, 6.9)
  # Some non-normalised means too, so that the quadratic term is visible.
  mu2[0] *= 3.0
  got = prob.log_inclusion(mu1, lv1, mu2, lv2, eps)
  ref = inc_direct(mu1, lv1, mu2, lv2, eps)
  assert got.shape == (5, 7) and got.dtype == jnp.float32
  # Values reach |inc| ~ 60; float32 keeps ~7 digits of that scale.
  np.testing.assert_allclose(_f64(got), ref, rtol=2e-6,
                             atol=2e-6 * np.max(np.abs(ref)))


def test_log_inclusion_quadratic_term_with_eps():
  """With eps = -20 and large mean gaps the exp(eps) factor is visible."""
  mu1 = np.array([[0.0, 1.0, -2.0]], np.float32)
  mu2 = np.array([[0.0, 0.0, 2.0]], np.float32)
  lv1 = np.log(np.array([[1e-8, 1e-8, 1e-8]], np.float32))
  lv2 = np.log(np.array([[1e-8, 2e-8, 3e-8]], np.float32))
  for eps in (0.0, -20.0):
    got = _f64(prob.log_inclusion(mu1, lv1, mu2, lv2, eps))
    ref = inc_direct(mu1, lv1, mu2, lv2, eps)
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_log_inclusion_broadcasts():
  rng = np.random.default_rng(1)
  mu1, lv1 = _rand_gaussians(rng, 4, 6)
  mu2, lv2 = _rand_gaussians(rng, 1, 6)
  got = prob.log_inclusion(mu1[:, None], lv1[:, None], mu2[None], lv2[None],
                           -20.0)
  assert got.shape == (4, 1, 6)
  ref = inc_direct(mu1[:, None], lv1[:, None], mu2[None], lv2[None], -20.0)
  np.testing.assert_allclose(_f64(got), ref, rtol=1e-6, atol=1e-5)


def test_log_inclusion_minus_exact_is_prefactor_and_constant():
  rng = np.random.default_rng(2)
  mu1, lv1 = _rand_gaussians(rng, 4, 5, -10.0, 5.0)
  mu2, lv2 = _rand_gaussians(rng, 4, 5, -10.0, 5.0)
  # log of 1/(2 pi) * 1/sqrt(2 pi) * sqrt(pi): the constant of ∫p1^2 p2.
  const = math.log(math.sqrt(math.pi) / (2.0 * math.pi *
                                         math.sqrt(2.0 * math.pi)))
  diff = _f64(prob.log_inclusion(mu1, lv1, mu2, lv2, 0.0)) - _f64(
      prob.log_inclusion_exact(mu1, lv1, mu2, lv2))
  expected = -_f64(lv1) - 0.5 * _f64(lv2) - const
  np.testing.assert_allclose(diff, expected, rtol=0, atol=3e-5)


# --------------------------------------------------------------------------
# 3. inclusion_hypothesis.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('eps', EPSILONS)
def test_inclusion_hypothesis_signs(eps):
  rng = np.random.default_rng(3)
  mu = _normalize(rng.normal(size=(4, 6))).astype(np.float32)
  lv_small = rng.uniform(-15.0, 2.0, size=(4, 6)).astype(np.float32)
  lv_big = lv_small + rng.uniform(0.5, 4.0, size=(4, 6)).astype(np.float32)
  inside = prob.inclusion_hypothesis(mu, lv_small, mu, lv_big, eps,
                                     per_dimension=True)
  outside = prob.inclusion_hypothesis(mu, lv_big, mu, lv_small, eps,
                                      per_dimension=True)
  assert np.all(_f64(inside) > 0.0)
  assert np.all(_f64(outside) < 0.0)
  # Same mean: H = log r - 1/2 log((2r + 1)/(r + 2)), r = sigma2^2/sigma1^2.
  r = np.exp(_f64(lv_big) - _f64(lv_small))
  closed = np.log(r) - 0.5 * np.log((2.0 * r + 1.0) / (r + 2.0))
  np.testing.assert_allclose(_f64(inside), closed, rtol=1e-5, atol=1e-5)
  assert np.all(_f64(prob.inclusion_hypothesis(mu, lv_small, mu, lv_big,
                                               eps)) > 0.0)


@pytest.mark.parametrize('eps', EPSILONS)
def test_inclusion_hypothesis_matches_reference(eps):
  rng = np.random.default_rng(4)
  mu1, lv1 = _rand_gaussians(rng, 5, 8, -18.0, 6.9)
  mu2, lv2 = _rand_gaussians(rng, 5, 8, -18.0, 6.9)
  h12 = prob.inclusion_hypothesis(mu1, lv1, mu2, lv2, eps, per_dimension=True)
  h21 = prob.inclusion_hypothesis(mu2, lv2, mu1, lv1, eps, per_dimension=True)
  ref = hyp_ref(mu1, lv1, mu2, lv2, eps)
  scale = np.max(np.abs(ref))
  np.testing.assert_allclose(_f64(h12), ref, rtol=1e-5, atol=1e-6 * scale)
  np.testing.assert_allclose(_f64(h21), -_f64(h12), rtol=0, atol=1e-6 * scale)
  total = prob.inclusion_hypothesis(mu1, lv1, mu2, lv2, eps)
  assert total.shape == (5,)
  np.testing.assert_allclose(_f64(total), _f64(h12).sum(-1), rtol=1e-6,
                             atol=1e-6 * scale)
  np.testing.assert_allclose(_f64(total), ref.sum(-1), rtol=1e-5,
                             atol=8e-6 * scale)


# --------------------------------------------------------------------------
# 4. inclusion_loss.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('c,eps', [(1000.0, -20.0), (10.0, -100.0),
                                   (1.0, 0.0)])
def test_inclusion_loss_matches_reference(c, eps):
  rng = np.random.default_rng(5)
  mu1, lv1 = _rand_gaussians(rng, 6, 8, -8.0, 1.0)
  # Half of the pairs nearly satisfy the inclusion, half violate it, and a
  # small hypothesis gap keeps c*H in the non-saturated part of log sigmoid.
  mu2 = _normalize(mu1 + 0.05 * rng.normal(size=mu1.shape)).astype(np.float32)
  lv2 = (lv1 + rng.uniform(-0.01, 0.01, size=lv1.shape) *
         (10.0 if c < 100 else 1.0)).astype(np.float32)
  lv2[:3] += 1.0
  got = prob.inclusion_loss(mu1, lv1, mu2, lv2, c, eps)
  ref = inclusion_loss_ref(mu1, lv1, mu2, lv2, c, eps)
  assert got.shape == () and got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), ref, rtol=1e-4, atol=1e-4)
  # And the defaults are the paper's c = 1000, eps = -20.
  np.testing.assert_allclose(
      float(prob.inclusion_loss(mu1, lv1, mu2, lv2)),
      inclusion_loss_ref(mu1, lv1, mu2, lv2, 1000.0, -20.0), rtol=1e-4,
      atol=1e-4)


# --------------------------------------------------------------------------
# 5. csd.
# --------------------------------------------------------------------------


def test_csd_matches_monte_carlo_and_pair_loop():
  rng = np.random.default_rng(6)
  mu1, lv1 = _rand_gaussians(rng, 2, 4, -3.0, 0.5)
  mu2, lv2 = _rand_gaussians(rng, 3, 4, -3.0, 0.5)
  got = _f64(prob.csd(mu1, lv1, mu2, lv2))
  assert got.shape == (2, 3)
  n_samples = 200_000
  for i in range(2):
    for j in range(3):
      z1 = mu1[i] + np.sqrt(np.exp(_f64(lv1[i]))) * rng.standard_normal(
          (n_samples, 4))
      z2 = mu2[j] + np.sqrt(np.exp(_f64(lv2[j]))) * rng.standard_normal(
          (n_samples, 4))
      dist = np.sum((z1 - z2)**2, -1)
      se = dist.std() / math.sqrt(n_samples)
      assert abs(got[i, j] - dist.mean()) < 5.0 * se, (i, j)
      loop = (np.sum((_f64(mu1[i]) - _f64(mu2[j]))**2)
              + np.exp(_f64(lv1[i])).sum() + np.exp(_f64(lv2[j])).sum())
      np.testing.assert_allclose(got[i, j], loop, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------
# 6. PPCL, SigLIP, CLIP.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('scale,bias', [(10.0, -10.0), (3.0, 1.5)])
def test_ppcl_matches_double_loop(scale, bias):
  rng = np.random.default_rng(7)
  n, d = 5, 6
  mu_i, lv_i = _rand_gaussians(rng, n, d, -5.0, -1.0)
  mu_t, lv_t = _rand_gaussians(rng, n, d, -5.0, -1.0)
  mu_t[:3] = _normalize(mu_i[:3] + 0.2 * rng.normal(size=(3, d)))
  logits = _f64(prob.ppcl_logits(mu_i, lv_i, mu_t, lv_t, scale, bias))
  for i in range(n):
    for j in range(n):
      np.testing.assert_allclose(
          logits[i, j], ppcl_logit_ref(mu_i[i], lv_i[i], mu_t[j], lv_t[j],
                                       scale, bias), rtol=1e-6, atol=1e-5)
  got = prob.ppcl_loss(mu_i, lv_i, mu_t, lv_t, jnp.float32(scale),
                       jnp.float32(bias))
  assert got.shape == ()
  np.testing.assert_allclose(float(got),
                             ppcl_ref(mu_i, lv_i, mu_t, lv_t, scale, bias),
                             rtol=1e-5)


def test_ppcl_rectangular_logits_and_no_positive_block():
  rng = np.random.default_rng(8)
  mu_i, lv_i = _rand_gaussians(rng, 3, 4)
  mu_t, lv_t = _rand_gaussians(rng, 5, 4)
  logits = prob.ppcl_logits(mu_i, lv_i, mu_t, lv_t, 10.0, -10.0)
  assert logits.shape == (3, 5)
  ref_logits = np.array([[ppcl_logit_ref(mu_i[i], lv_i[i], mu_t[j], lv_t[j],
                                         10.0, -10.0) for j in range(5)]
                         for i in range(3)])
  np.testing.assert_allclose(_f64(logits), ref_logits, rtol=1e-6, atol=1e-5)
  neg_only = prob.sigmoid_pairwise_loss_sum(logits, positives_on_diagonal=False)
  np.testing.assert_allclose(float(neg_only),
                             -special.log_expit(-ref_logits).sum(), rtol=1e-5)
  with_pos = prob.sigmoid_pairwise_loss_sum(logits)
  labels = -np.ones((3, 5))
  labels[np.arange(3), np.arange(3)] = 1.0
  np.testing.assert_allclose(float(with_pos),
                             -special.log_expit(labels * ref_logits).sum(),
                             rtol=1e-5)


def test_siglip_matches_double_loop():
  rng = np.random.default_rng(9)
  n, d = 6, 5
  img = _normalize(rng.normal(size=(n, d))).astype(np.float32)
  txt = _normalize(img + 0.3 * rng.normal(size=(n, d))).astype(np.float32)
  scale, bias = 10.0, -10.0
  got = contrastive.siglip_loss(img, txt, scale, bias)
  ref = pairwise_sigmoid_ref(
      lambda i, j: scale * float(np.dot(_f64(img[i]), _f64(txt[j]))) + bias,
      n, n)
  np.testing.assert_allclose(float(got), ref, rtol=1e-5)
  logits = contrastive.siglip_logits(img, txt, scale, bias)
  np.testing.assert_allclose(_f64(logits), scale * _f64(img) @ _f64(txt).T
                             + bias, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize('scale', [1.0 / 0.07, 1.0])
def test_clip_matches_cross_entropy(scale):
  rng = np.random.default_rng(10)
  n, d = 6, 5
  img = _normalize(rng.normal(size=(n, d))).astype(np.float32)
  txt = _normalize(img + 0.5 * rng.normal(size=(n, d))).astype(np.float32)
  logits = scale * _f64(img) @ _f64(txt).T

  def cross_entropy(lg):
    loss = 0.0
    for i in range(n):
      row = lg[i] - lg[i].max()
      loss += -(row[i] - math.log(np.exp(row).sum()))
    return loss / n

  ref = 0.5 * (cross_entropy(logits) + cross_entropy(logits.T))
  got = contrastive.clip_loss(img, txt, scale)
  np.testing.assert_allclose(float(got), ref, rtol=1e-5)


# Near-separated batches: the positive logit dominates every row and column,
# and the loss is ~ mean sum_{j != i} exp(L_ij - L_ii). The textbook form
# logsumexp(row) - L_ii then cancels in float32 (relative error 1 at a loss of
# 1e-7, and the same on the positive's gradient softmax_ii - 1), so these
# tests fail on it; the softplus form keeps ~1e-6.
CLIP_TARGETS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)
CLIP_RTOL = 1e-4


def separated_batch(seed, n, d, noise=0.3):
  """Random unit images; texts = images + noise of norm ~``noise``, so the
  matching cosine (~0.96) beats every other one in its row and column."""
  rng = np.random.default_rng(seed)
  img = _normalize(rng.normal(size=(n, d)))
  txt = _normalize(img + noise * rng.normal(size=(n, d)) / math.sqrt(d))
  return img.astype(np.float32), txt.astype(np.float32)


def clip_ref64(img, txt, scale):
  """CLIP's loss and its gradients w.r.t. (img, txt, scale), float64 numpy.

  Value: 0.5 * mean over both directions of log(1 + sum_{j != i}
  exp(L_ij - L_ii)). Gradients analytically: with G the cotangent of the
  logits, G = (softmax_rows(L) - I + softmax_cols(L) - I) / (2 n), the
  diagonal written as -(sum of the negatives' probabilities) so it keeps its
  relative precision; then d/dimg = scale G txt, d/dtxt = scale G^T img,
  d/dscale = sum(G * img txt^T).
  """
  img, txt = _f64(img), _f64(txt)
  cos = img @ txt.T
  logits = scale * cos
  n = logits.shape[0]
  eye = np.eye(n, dtype=bool)

  def direction(lg):
    """Per-row terms and the row-softmax-minus-one-hot, rows of ``lg``."""
    e = np.exp(lg - lg.max(axis=1, keepdims=True))
    e_neg = np.where(eye, 0.0, e)
    total = e.sum(axis=1, keepdims=True)
    terms = np.log1p(e_neg.sum(axis=1) / np.diagonal(e))
    g = e_neg / total
    g[eye] = -e_neg.sum(axis=1) / total[:, 0]
    return terms, g

  terms_i2t, g_i2t = direction(logits)
  terms_t2i, g_t2i = direction(logits.T)
  value = 0.5 * (terms_i2t.mean() + terms_t2i.mean())
  g = (g_i2t + g_t2i.T) / (2 * n)
  return value, (scale * g @ txt, scale * g.T @ img, float(np.sum(g * cos)))


def scale_for_clip_loss(img, txt, target):
  """The scale at which ``clip_ref64`` equals ``target`` (log-space root)."""
  return optimize.brentq(
      lambda s: math.log(clip_ref64(img, txt, s)[0] / target), 0.1, 300.0,
      xtol=1e-12)


def assert_clip_close(value, grads, value0, grads0, rtol=CLIP_RTOL):
  """Relative error of the value, and of each gradient array as
  max |g - g0| / max |g0| (its entries span orders of magnitude)."""
  assert abs(float(value) - value0) <= rtol * value0, (float(value), value0)
  for g, g0 in zip(grads, grads0):
    g, g0 = _f64(g), _f64(g0)
    err = np.max(np.abs(g - g0)) / np.max(np.abs(g0))
    assert err <= rtol, (err, g, g0)


_clip_value_and_grad = jax.jit(jax.value_and_grad(contrastive.clip_loss,
                                                  (0, 1, 2)))


@functools.lru_cache(maxsize=None)
def _separated_scaled(target):
  img, txt = separated_batch(12, 32, 64)
  return img, txt, scale_for_clip_loss(img, txt, target)


@pytest.mark.parametrize('target', CLIP_TARGETS)
def test_clip_near_separated_matches_float64(target):
  """float32 clip_loss and its gradients, losses 1e-2 .. 1e-7, rtol 1e-4."""
  img, txt, scale = _separated_scaled(target)
  value0, grads0 = clip_ref64(img, txt, scale)
  np.testing.assert_allclose(value0, target, rtol=1e-9)
  value, grads = _clip_value_and_grad(img, txt, jnp.float32(scale))
  # scale is rounded to float32 too: the reference uses the same number.
  value0, grads0 = clip_ref64(img, txt, float(np.float32(scale)))
  assert_clip_close(value, grads, value0, grads0)


@pytest.mark.torch
@pytest.mark.parametrize('target', CLIP_TARGETS)
def test_clip_near_separated_matches_open_clip(target):
  """Against open_clip's ClipLoss (what CLIP/ProLIP trainings use), run in
  float64: in float32 it cancels as the old formula did (relative error
  ~1e-3 at a loss of 1e-5, ~0.4 at 1e-7), so it is no reference there."""
  torch = pytest.importorskip('torch')
  open_clip_loss = pytest.importorskip('open_clip.loss')
  img, txt, scale = _separated_scaled(target)
  scale = float(np.float32(scale))
  leaves = [torch.tensor(_f64(x), requires_grad=True)
            for x in (img, txt, scale)]
  value_t = open_clip_loss.ClipLoss()(*leaves)
  value_t.backward()
  value0 = value_t.item()
  grads0 = [x.grad.numpy() for x in leaves]
  # The float64 reference above is the same function (to float64 rounding).
  ref_value, ref_grads = clip_ref64(img, txt, scale)
  assert_clip_close(ref_value, ref_grads, value0, grads0, rtol=1e-8)
  value, grads = _clip_value_and_grad(img, txt, jnp.float32(scale))
  assert_clip_close(value, grads, value0, grads0)


def test_clip_single_pair_is_zero_with_zero_gradients():
  """n = 1: no negatives, the loss is 0 identically (softplus(-inf))."""
  img, txt = separated_batch(13, 1, 8)
  value, grads = _clip_value_and_grad(img, txt, jnp.float32(10.0))
  assert float(value) == 0.0
  for g in grads:
    np.testing.assert_array_equal(np.asarray(g), 0.0)


# --------------------------------------------------------------------------
# 7. VIB.
# --------------------------------------------------------------------------


def test_vib_matches_closed_form_kl():
  rng = np.random.default_rng(11)
  mu = rng.normal(size=(4, 7)).astype(np.float32)
  lv = rng.uniform(-18.0, 6.9, size=(4, 7)).astype(np.float32)
  got = prob.vib_loss(mu, lv)
  np.testing.assert_allclose(float(got), vib_ref(mu, lv), rtol=1e-6)


def test_vib_matches_monte_carlo_kl():
  rng = np.random.default_rng(12)
  mu = np.array([[0.3, -0.5, 0.1], [0.0, 0.8, -0.2]], np.float32)
  lv = np.log(np.array([[0.5, 2.0, 0.1], [1.0, 0.3, 1.5]], np.float32))
  n_samples = 200_000
  sd = np.sqrt(np.exp(_f64(lv)))
  x = _f64(mu) + sd * rng.standard_normal((n_samples,) + mu.shape)
  # log q(x) - log p(x), q = N(mu, s), p = N(0, 1), averaged over elements.
  log_ratio = (-0.5 * ((x - mu) / sd)**2 - np.log(sd)) - (-0.5 * x**2)
  per_sample = log_ratio.mean(axis=(1, 2))
  mc, se = per_sample.mean(), per_sample.std() / math.sqrt(n_samples)
  got = float(prob.vib_loss(mu, lv))
  assert abs(got - mc) < 5.0 * se, (got, mc, se)
  np.testing.assert_allclose(got, vib_ref(mu, lv), rtol=1e-6)


def test_vib_release_quirk_formula():
  rng = np.random.default_rng(13)
  mu = rng.normal(size=(3, 5)).astype(np.float32)
  lv = rng.uniform(-10.0, 5.0, size=(3, 5)).astype(np.float32)
  half = _f64(lv) / 2.0
  ref = np.mean(-0.5 * (1.0 + half - _f64(mu)**2 - np.exp(half)))
  got = prob.vib_loss(mu, lv, release_quirk=True)
  np.testing.assert_allclose(float(got), ref, rtol=1e-6)
  assert abs(float(got) - vib_ref(mu, lv)) > 1e-2  # genuinely different


# --------------------------------------------------------------------------
# 8. The full ProLIP objective.
# --------------------------------------------------------------------------


def _prolip_inputs(seed, n=6, n_masked=3, d=8):
  rng = np.random.default_rng(seed)
  img = _rand_gaussians(rng, n, d, -6.0, -2.0)
  txt = _rand_gaussians(rng, n, d, -6.0, -2.0)
  img_m = _rand_gaussians(rng, n_masked, d, -6.0, -2.0)
  txt_m = _rand_gaussians(rng, n_masked, d, -6.0, -2.0)
  return img, txt, img_m, txt_m


def _prolip_ref(img, txt, img_m, txt_m, scale, bias, c, eps, keep_vib=True):
  k = img_m[0].shape[0]
  terms = {
      'ppcl': ppcl_ref(*img, *txt, scale, bias),
      'inclusion_img_txt': inclusion_loss_ref(*img, *txt, c, eps),
      'inclusion_masked_img': inclusion_loss_ref(img[0][:k], img[1][:k],
                                                 *img_m, c, eps),
      'inclusion_masked_txt': inclusion_loss_ref(txt[0][:k], txt[1][:k],
                                                 *txt_m, c, eps),
      'vib_img': vib_ref(*img),
      'vib_txt': vib_ref(*txt),
  }
  total = (terms['ppcl'] + 1e-7 * terms['inclusion_img_txt']
           + 1e-3 * (terms['inclusion_masked_img']
                     + terms['inclusion_masked_txt'])
           + 1e-4 * ((terms['vib_img'] if keep_vib else 0.0)
                     + terms['vib_txt']))
  return total, terms


@pytest.mark.parametrize('c,eps', [(1000.0, -20.0), (10.0, -100.0)])
def test_prolip_loss_is_weighted_sum_of_terms(c, eps):
  img, txt, img_m, txt_m = _prolip_inputs(14)
  scale, bias = 10.0, -10.0
  total, metrics = prob.prolip_loss(
      prob.GaussianBatch(*img), prob.GaussianBatch(*txt), jnp.float32(scale),
      jnp.float32(bias), prob.GaussianBatch(*img_m), prob.GaussianBatch(*txt_m),
      c=c, eps=eps)
  ref_total, ref_terms = _prolip_ref(img, txt, img_m, txt_m, scale, bias, c,
                                     eps)
  assert set(metrics) == set(ref_terms) | {'loss', 'guard_dropped'}
  for name, value in ref_terms.items():
    np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-4,
                               atol=1e-5, err_msg=name)
  assert int(metrics['guard_dropped']) == 0
  np.testing.assert_allclose(float(total), ref_total, rtol=1e-5)
  np.testing.assert_allclose(float(metrics['loss']), ref_total, rtol=1e-5)
  # The masked terms compare with the *first* n_masked rows: a reference that
  # used the last rows would differ.
  k = img_m[0].shape[0]
  wrong = inclusion_loss_ref(img[0][-k:], img[1][-k:], *img_m, c, eps)
  assert abs(wrong - ref_terms['inclusion_masked_img']) > 1e-3


def test_prolip_loss_without_masked_copies():
  img, txt, _, _ = _prolip_inputs(15)
  total, metrics = prob.prolip_loss(prob.GaussianBatch(*img),
                                    prob.GaussianBatch(*txt), 10.0, -10.0)
  assert 'inclusion_masked_img' not in metrics
  ref = (ppcl_ref(*img, *txt, 10.0, -10.0)
         + 1e-7 * inclusion_loss_ref(*img, *txt, 1000.0, -20.0)
         + 1e-4 * (vib_ref(*img) + vib_ref(*txt)))
  np.testing.assert_allclose(float(total), ref, rtol=1e-5)


def test_prolip_guard_drops_exploding_vib():
  # n * d = 4 elements; one huge log-variance (sigma^2 = e^12) pushes the mean
  # KL of the images to exp(12) / 8 ~ 2e4 > 1e4. A small PPCL scale keeps the
  # contrastive term O(10), so the dropped 1e-4 * VIB (~2) is visible.
  img, txt, img_m, txt_m = _prolip_inputs(16, n=2, n_masked=1, d=2)
  img[1][0, 0] = 12.0
  scale, bias = 1e-3, 0.0
  args = (prob.GaussianBatch(*img), prob.GaussianBatch(*txt),
          jnp.float32(scale), jnp.float32(bias), prob.GaussianBatch(*img_m),
          prob.GaussianBatch(*txt_m))
  total, metrics = prob.prolip_loss(*args)
  ref_kept, ref_terms = _prolip_ref(img, txt, img_m, txt_m, scale, bias,
                                    1000.0, -20.0, keep_vib=False)
  ref_all, _ = _prolip_ref(img, txt, img_m, txt_m, scale, bias, 1000.0, -20.0)
  assert ref_terms['vib_img'] > prob.VIB_GUARD
  assert abs(ref_terms['inclusion_img_txt']) < prob.INCLUSION_GUARD
  np.testing.assert_allclose(float(metrics['vib_img']), ref_terms['vib_img'],
                             rtol=1e-5)
  assert int(metrics['guard_dropped']) == 1
  np.testing.assert_allclose(float(total), ref_kept, rtol=1e-5)
  assert abs(ref_all - ref_kept) > 100 * 1e-5 * abs(ref_kept)
  total_ng, metrics_ng = prob.prolip_loss(*args, guard=False)
  assert 'guard_dropped' not in metrics_ng
  np.testing.assert_allclose(float(total_ng), ref_all, rtol=1e-5)


def test_prolip_guard_lets_non_finite_terms_through():
  # As the release's `if term > limit`: a NaN term is not "exploding", so the
  # total shows it (and the train step skips the update) rather than a
  # silently smaller loss; PPCL is never dropped, even when it is NaN.
  terms = {'ppcl': jnp.float32(0.7), 'vib_img': jnp.float32(jnp.nan),
           'vib_txt': jnp.float32(2e4), 'inclusion_img_txt': jnp.float32(3.0)}
  total, metrics = prob.combine_prolip_terms(terms)
  assert np.isnan(float(total)) and int(metrics['guard_dropped']) == 1
  terms = dict(terms, vib_img=jnp.float32(1.0), ppcl=jnp.float32(jnp.inf))
  total, metrics = prob.combine_prolip_terms(terms)
  assert np.isinf(float(total)) and int(metrics['guard_dropped']) == 1
  terms['ppcl'] = jnp.float32(0.7)
  total, _ = prob.combine_prolip_terms(terms)
  np.testing.assert_allclose(float(total), 0.7 + 1e-4 * 1.0 + 1e-7 * 3.0,
                             rtol=1e-6)


# --------------------------------------------------------------------------
# 9. Gradients.
# --------------------------------------------------------------------------

VARIANCES = np.array([1e-8, 1e-4, 1.0, 1e3])


def _grad_inputs():
  """All pairs of extreme variances: (16, 3) arrays, rows enumerate pairs."""
  lv = np.log(VARIANCES)
  lv1, lv2 = np.meshgrid(lv, lv, indexing='ij')
  lv1 = np.repeat(lv1.reshape(-1, 1), 3, axis=1).astype(np.float32)
  lv2 = np.repeat(lv2.reshape(-1, 1), 3, axis=1).astype(np.float32)
  rng = np.random.default_rng(17)
  mu1 = _normalize(rng.normal(size=lv1.shape)).astype(np.float32)
  mu2 = _normalize(rng.normal(size=lv1.shape)).astype(np.float32)
  mu2[::3] = mu1[::3]  # identical means too (zero quadratic term)
  return mu1, lv1, mu2, lv2


def _assert_finite_grads(fn, *args):
  grads = jax.grad(fn, argnums=tuple(range(len(args))))(*args)
  for k, g in enumerate(grads):
    g = np.asarray(g)
    assert g.shape == np.shape(args[k])
    assert np.all(np.isfinite(g)), (k, g)
  return grads


@pytest.mark.parametrize('eps', EPSILONS)
@pytest.mark.parametrize('c', [1000.0, 10.0])
def test_inclusion_loss_gradients_finite(eps, c):
  mu1, lv1, mu2, lv2 = _grad_inputs()
  grads = _assert_finite_grads(
      lambda a, b, cc, d: prob.inclusion_loss(a, b, cc, d, c, eps), mu1, lv1,
      mu2, lv2)
  assert np.any(np.asarray(grads[1]) != 0.0)


def test_other_loss_gradients_finite():
  mu1, lv1, mu2, lv2 = _grad_inputs()
  _assert_finite_grads(
      lambda a, b, cc, d: prob.ppcl_loss(a, b, cc, d, 10.0, -10.0), mu1, lv1,
      mu2, lv2)
  _assert_finite_grads(prob.vib_loss, mu1, lv1)
  _assert_finite_grads(lambda a, b: prob.vib_loss(a, b, True), mu1, lv1)
  _assert_finite_grads(lambda a, b, cc, d: jnp.sum(prob.csd(a, b, cc, d)),
                       mu1, lv1, mu2, lv2)
  for eps in EPSILONS:
    _assert_finite_grads(
        lambda a, b, cc, d, e=eps: jnp.sum(prob.log_inclusion(a, b, cc, d, e)),
        mu1, lv1, mu2, lv2)


@pytest.mark.parametrize('eps', [0.0, -20.0])
def test_log_inclusion_gradient_matches_finite_difference(eps):
  rng = np.random.default_rng(18)
  mu1 = np.array([0.4, -0.1, 0.0], np.float32)
  mu2 = np.array([-0.3, 0.2, 0.0], np.float32)
  lv1 = rng.uniform(-3.0, 1.0, size=3).astype(np.float32)
  lv2 = rng.uniform(-3.0, 1.0, size=3).astype(np.float32)
  if eps == -20.0:  # make the quadratic term matter at eps = -20
    lv1 -= 20.0
    lv2 -= 20.0
  fn = lambda a, b, c, d: jnp.sum(prob.log_inclusion(a, b, c, d, eps))
  grads = jax.grad(fn, argnums=(0, 1, 2, 3))(mu1, lv1, mu2, lv2)
  base = [_f64(x) for x in (mu1, lv1, mu2, lv2)]
  h = 1e-6
  for arg in range(4):
    for k in range(3):
      plus = [x.copy() for x in base]
      minus = [x.copy() for x in base]
      plus[arg][k] += h
      minus[arg][k] -= h
      fd = (inc_direct(*plus, eps).sum() - inc_direct(*minus, eps).sum()) / (
          2.0 * h)
      np.testing.assert_allclose(float(grads[arg][k]), fd, rtol=1e-4,
                                 atol=1e-4, err_msg=f'arg {arg} dim {k}')


# --------------------------------------------------------------------------
# 12. float64 inputs are computed in float64 (promoted, never downcast).
# --------------------------------------------------------------------------

# float64 arithmetic agrees with the references to ~1e-15 relative; float32
# arithmetic would be ~1e-7 off, so these fail on any downcast.
F64_RTOL = 1e-12


def _f64_gaussians(seed, n, d):
  rng = np.random.default_rng(seed)
  return _normalize(rng.normal(size=(n, d))), rng.uniform(-5.0, 0.0, (n, d))


def _assert_f64(got, want, atol=0.0):
  assert got.dtype == jnp.float64, got.dtype
  np.testing.assert_allclose(np.asarray(got), want, rtol=F64_RTOL, atol=atol)


def test_float64_inputs_give_float64_probabilistic_losses():
  (mu_i, lv_i), (mu_t, lv_t) = _f64_gaussians(40, 5, 6), _f64_gaussians(41, 5,
                                                                       6)
  with jax.enable_x64(True):
    args = [jnp.asarray(x) for x in (mu_i, lv_i, mu_t, lv_t)]
    assert args[0].dtype == jnp.float64
    csd_want = (np.sum((mu_i[:, None] - mu_t[None])**2, -1)
                + np.exp(lv_i).sum(-1)[:, None] + np.exp(lv_t).sum(-1)[None])
    _assert_f64(prob.csd(*args), csd_want)
    _assert_f64(prob.ppcl_loss(*args, 10.0, -10.0),
                ppcl_ref(mu_i, lv_i, mu_t, lv_t, 10.0, -10.0))
    for eps in (0.0, -20.0):
      _assert_f64(prob.log_inclusion(*args, eps=eps),
                  inc_direct(mu_i, lv_i, mu_t, lv_t, eps), atol=1e-12)
    _assert_f64(prob.inclusion_loss(*args, c=10.0, eps=0.0),
                inclusion_loss_ref(mu_i, lv_i, mu_t, lv_t, 10.0, 0.0))
    _assert_f64(prob.vib_loss(args[0], args[1]), vib_ref(mu_i, lv_i))
    total, metrics = prob.prolip_loss(
        prob.GaussianBatch(*args[:2]), prob.GaussianBatch(*args[2:]), 10.0,
        -10.0, prob.GaussianBatch(args[0][:3], args[1][:3] + 0.5),
        prob.GaussianBatch(args[2][:3], args[3][:3] + 0.5), c=10.0, eps=0.0)
    want, terms = _prolip_ref((mu_i, lv_i), (mu_t, lv_t),
                              (mu_i[:3], lv_i[:3] + 0.5),
                              (mu_t[:3], lv_t[:3] + 0.5), 10.0, -10.0, 10.0,
                              0.0)
    _assert_f64(total, want)
    for name, value in terms.items():
      _assert_f64(metrics[name], value)


def test_float64_inputs_give_float64_contrastive_losses():
  img, txt = separated_batch(42, 6, 5)
  img, txt = _normalize(_f64(img)), _normalize(_f64(txt))
  with jax.enable_x64(True):
    i64, t64 = jnp.asarray(img), jnp.asarray(txt)
    _assert_f64(contrastive.siglip_loss(i64, t64, 10.0, -10.0),
                pairwise_sigmoid_ref(
                    lambda i, j: 10.0 * float(img[i] @ txt[j]) - 10.0, 6, 6))
    value, grads = jax.value_and_grad(contrastive.clip_loss, (0, 1, 2))(
        i64, t64, jnp.float64(20.0))
    want, want_grads = clip_ref64(img, txt, 20.0)
    _assert_f64(value, want)
    for g, g0 in zip(grads, want_grads):
      _assert_f64(g, g0, atol=1e-14)


def test_bf16_and_float32_inputs_still_compute_in_float32():
  """Promotion keeps float32 for narrower inputs, with x64 on or off."""
  mu, lv = (x.astype(np.float32) for x in _f64_gaussians(43, 4, 3))
  for x64 in (False, True):
    with jax.enable_x64(x64):
      for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        args = [jnp.asarray(x, dtype) for x in (mu, lv, mu, lv)]
        assert prob.ppcl_loss(*args, 10.0, -10.0).dtype == jnp.float32
        assert prob.log_inclusion(*args).dtype == jnp.float32
        assert contrastive.clip_loss(args[0], args[2], 5.0).dtype == (
            jnp.float32)
      # A NumPy float64 array is float64 only where JAX can hold one.
      got = prob.csd(_f64(mu), _f64(lv), _f64(mu), _f64(lv)).dtype
      assert got == (jnp.float64 if x64 else jnp.float32)
