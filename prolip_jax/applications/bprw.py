"""Bayesian Prompt Re-Weighting, BPRW (paper 3.4, Algorithm 1 of A.8, C.7).

For each class c the N prompt embeddings Z_t^n = N(mu_n, Sigma_n) are the
components of a mixture with weights pi_c. Observations are points sampled
from image Gaussians that belong to the class (few-shot: labelled images;
zero-shot: the images nearest to the class's prompt ensemble). EM with a
Dirichlet(alpha) prior finds the MAP weights:

  E-step  gamma_jn = pi_n f_n(x_j) / sum_i pi_i f_i(x_j)
  M-step  pi_n = (N_n + alpha_n - 1) / (M' + sum_i (alpha_i - 1)),
          N_n = sum_j gamma_jn

with f_n the diagonal Gaussian density of component n after Sigma_n += eps I.
Initial pi is the normalised 1 / tr(Sigma_n) (before eps is added). This is
the exact EM for the MAP objective

  log p(X | pi) + sum_n (alpha_n - 1) log pi_n,

(``log_posterior``), concave in pi for alpha >= 1, so EM's fixed point is its
unique maximiser. For alpha < 1 a weight can hit zero; it is clipped there and
the rest renormalised ("ensure pi_n >= 0").

The re-weighted class embedding Z_t^new = sum_n pi_n Z_t^n is the Gaussian
N(sum_n pi_n mu_n, sum_n pi_n sigma_n^2): the pi-weighted version of the
uniform prompt ensemble of ``evaluate.class_gaussians`` (uniform pi gives it
back exactly).

Paper hyperparameters (C.7): zero-shot alpha = 5, M = 5 nearest images per
class, K = 10 samples each, eps = 0.02; few-shot alpha = 2 with 100 // K
samples from each of the K labelled images.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax import plotting

from prolip_jax.losses import csd

Array = jax.Array
_LOG_2PI = math.log(2.0 * math.pi)

ZERO_SHOT_ALPHA = 5.0
FEW_SHOT_ALPHA = 2.0
EPS = 0.02
NEAREST_IMAGES = 5
SAMPLES_PER_IMAGE = 10
FEW_SHOT_TOTAL_SAMPLES = 100


def log_density(x: Array, mu: Array, var: Array) -> Array:
  """Diagonal Gaussian log-densities ``log f_n(x_j)``: ``(M, d)``, ``(N, d)``,
  ``(N, d)`` -> ``(M, N)`` float32 (expanded into matmuls, no ``(M, N, d)``)."""
  x, mu, var = (jnp.asarray(a, jnp.float32) for a in (x, mu, var))
  inv = 1.0 / var
  quad = ((x * x) @ inv.T - 2.0 * x @ (mu * inv).T
          + jnp.sum(mu * mu * inv, -1)[None, :])
  logdet = jnp.sum(jnp.log(var), -1)
  d = x.shape[-1]
  return -0.5 * (quad + logdet[None, :] + d * _LOG_2PI)


def _safe_log(p: Array) -> Array:
  return jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)


def log_posterior(pi: Array, log_f: Array, alpha) -> Array:
  """The MAP objective ``sum_j log sum_n pi_n f_n(x_j) + sum_n (alpha_n - 1)
  log pi_n`` (up to the Dirichlet normaliser). ``log_f``: ``(M, N)``."""
  alpha = jnp.broadcast_to(jnp.asarray(alpha, jnp.float32), pi.shape)
  lik = jnp.sum(jax.nn.logsumexp(_safe_log(pi)[None, :] + log_f, axis=1))
  prior = jnp.sum(jnp.where(alpha != 1.0, (alpha - 1.0) * _safe_log(pi), 0.0))
  return lik + prior


def em_step(pi: Array, log_f: Array, alpha: Array) -> Array:
  """One E + M step of Algorithm 1 for one class."""
  log_r = _safe_log(pi)[None, :] + log_f
  gamma = jax.nn.softmax(log_r, axis=1)  # (M, N) responsibilities
  n_eff = jnp.sum(gamma, axis=0)
  num = jnp.maximum(n_eff + alpha - 1.0, 0.0)
  return num / jnp.sum(num)


def em(log_f: Array, pi0: Array, alpha, max_iters: int = 1000,
       tol: float = 1e-7) -> tuple[Array, Array]:
  """Runs ``em_step`` from ``pi0`` until ``max |delta pi| < tol``.

  Returns ``(pi (N,), iterations)``.
  """
  alpha = jnp.broadcast_to(jnp.asarray(alpha, jnp.float32), pi0.shape)

  def cond(state):
    _, delta, i = state
    return (i < max_iters) & (delta >= tol)

  def body(state):
    pi, _, i = state
    new = em_step(pi, log_f, alpha)
    return new, jnp.max(jnp.abs(new - pi)), i + 1

  pi, _, iters = jax.lax.while_loop(
      cond, body, (jnp.asarray(pi0, jnp.float32), jnp.inf, 0))
  return pi, iters


def initial_weights(prompt_logvar: Array) -> Array:
  """Normalised ``1 / tr(Sigma_n)`` over the prompt axis: ``(..., N, d)`` ->
  ``(..., N)``."""
  inv_tr = 1.0 / jnp.sum(jnp.exp(jnp.asarray(prompt_logvar, jnp.float32)),
                         -1)
  return inv_tr / jnp.sum(inv_tr, -1, keepdims=True)


@dataclasses.dataclass
class BPRWResult:
  """``pi``: ``(C, N)`` learned prompt weights; ``pi_init``: the 1/tr(Sigma)
  start; ``mu``/``var``: ``(C, d)`` re-weighted class Gaussians;
  ``iterations``: ``(C,)`` EM steps; ``log_posterior``: ``(C,)`` final MAP
  objective."""
  pi: np.ndarray
  pi_init: np.ndarray
  mu: np.ndarray
  var: np.ndarray
  iterations: np.ndarray
  log_posterior: np.ndarray


def reweighted_classifier(prompt_mu, prompt_logvar, pi
                          ) -> tuple[np.ndarray, np.ndarray]:
  """``Z_new = sum_n pi_n Z_n``: (mu ``(C, d)``, sigma^2 ``(C, d)``)."""
  pi = np.asarray(pi, np.float64)
  mu = np.einsum('cn,cnd->cd', pi, np.asarray(prompt_mu, np.float64))
  var = np.einsum('cn,cnd->cd', pi,
                  np.exp(np.asarray(prompt_logvar, np.float64)))
  return mu.astype(np.float32), var.astype(np.float32)


@jax.jit
def _bprw_all(prompt_mu, prompt_logvar, observations, alpha, eps, max_iters,
              tol):
  def one(args):
    mu, logvar, x = args
    var = jnp.exp(logvar) + eps
    log_f = log_density(x, mu, var)
    pi0 = initial_weights(logvar)
    pi, iters = em(log_f, pi0, alpha, max_iters, tol)
    return pi, pi0, iters, log_posterior(pi, log_f, alpha)
  # lax.map, not vmap: one class's (M', N) matrices at a time.
  return jax.lax.map(one, (prompt_mu, prompt_logvar, observations))


def bprw(prompt_mu, prompt_logvar, observations, alpha=ZERO_SHOT_ALPHA,
         eps: float = EPS, max_iters: int = 1000, tol: float = 1e-7
         ) -> BPRWResult:
  """Algorithm 1 for every class.

  Args:
    prompt_mu, prompt_logvar: ``(C, N, d)`` prompt embeddings per class.
    observations: ``(C, M', d)`` points per class (``sample_observations``).
    alpha: Dirichlet concentration, scalar or ``(N,)``.
    eps: added to every prompt variance inside the densities.
    max_iters, tol: EM stops at ``max |delta pi| < tol``.

  Returns:
    ``BPRWResult``.
  """
  prompt_mu = jnp.asarray(prompt_mu, jnp.float32)
  prompt_logvar = jnp.asarray(prompt_logvar, jnp.float32)
  observations = jnp.asarray(observations, jnp.float32)
  if not (prompt_mu.ndim == 3 and prompt_mu.shape == prompt_logvar.shape
          and observations.ndim == 3
          and observations.shape[0] == prompt_mu.shape[0]
          and observations.shape[2] == prompt_mu.shape[2]):
    raise ValueError(f'shapes: prompts {prompt_mu.shape} / '
                     f'{prompt_logvar.shape}, observations '
                     f'{observations.shape}; want (C, N, d), (C, M, d)')
  alpha = jnp.broadcast_to(jnp.asarray(alpha, jnp.float32),
                           (prompt_mu.shape[1],))
  pi, pi0, iters, lp = jax.device_get(_bprw_all(
      prompt_mu, prompt_logvar, observations, alpha, jnp.float32(eps),
      jnp.int32(max_iters), jnp.float32(tol)))
  mu, var = reweighted_classifier(prompt_mu, prompt_logvar, pi)
  return BPRWResult(np.asarray(pi), np.asarray(pi0), mu, var,
                    np.asarray(iters), np.asarray(lp))


def sample_observations(img_mu, img_logvar, index, samples_per_image: int,
                        seed: int = 0) -> np.ndarray:
  """K points from each chosen image Gaussian.

  Args:
    img_mu, img_logvar: ``(n, d)`` image embeddings.
    index: ``(C, M)`` images chosen for each class.
    samples_per_image: K.

  Returns:
    ``(C, M * K, d)`` float32 samples mu + sigma * N(0, I).
  """
  index = np.asarray(index)
  mu = np.asarray(img_mu, np.float32)[index]  # (C, M, d)
  std = np.exp(0.5 * np.asarray(img_logvar, np.float32))[index]
  rng = np.random.default_rng(seed)
  noise = rng.standard_normal(mu.shape[:2] + (samples_per_image,)
                              + mu.shape[2:]).astype(np.float32)
  x = mu[:, :, None] + std[:, :, None] * noise
  return x.reshape(x.shape[0], -1, x.shape[-1])


def nearest_images(cls_mu, cls_var, img_mu, img_logvar, m: int) -> np.ndarray:
  """``(C, m)`` indices of the images at the smallest CSD to each class's
  prompt-ensemble Gaussian (zero-shot observations, C.7)."""
  d = np.asarray(csd(cls_mu, jnp.log(jnp.asarray(cls_var)), img_mu,
                     img_logvar))
  return np.argsort(d, axis=1, kind='stable')[:, :m]


def few_shot_indices(labels, num_classes: int, shots: int, seed: int = 0
                     ) -> np.ndarray:
  """``(C, shots)`` random labelled images of each class (without
  replacement)."""
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  out = []
  for c in range(num_classes):
    idx = np.flatnonzero(labels == c)
    if len(idx) < shots:
      raise ValueError(f'class {c} has {len(idx)} images, fewer than '
                       f'{shots} shots')
    out.append(np.sort(rng.choice(idx, shots, replace=False)))
  return np.stack(out)


def zero_shot_bprw(prompt_mu, prompt_logvar, img_mu, img_logvar,
                   alpha: float = ZERO_SHOT_ALPHA, eps: float = EPS,
                   m: int = NEAREST_IMAGES, k: int = SAMPLES_PER_IMAGE,
                   seed: int = 0, **em_kw) -> tuple[BPRWResult, np.ndarray]:
  """BPRW without labels: the ``m`` images nearest (CSD) to each class's
  uniform prompt ensemble, ``k`` samples each. Returns (result, ``(C, m)``
  chosen image indices)."""
  cls_mu = np.mean(np.asarray(prompt_mu), 1)
  cls_var = np.mean(np.exp(np.asarray(prompt_logvar)), 1)
  index = nearest_images(cls_mu, cls_var, img_mu, img_logvar, m)
  obs = sample_observations(img_mu, img_logvar, index, k, seed)
  return bprw(prompt_mu, prompt_logvar, obs, alpha, eps, **em_kw), index


def few_shot_bprw(prompt_mu, prompt_logvar, img_mu, img_logvar, labels,
                  shots: int, alpha: float = FEW_SHOT_ALPHA, eps: float = EPS,
                  total_samples: int = FEW_SHOT_TOTAL_SAMPLES,
                  seed: int = 0, **em_kw) -> tuple[BPRWResult, np.ndarray]:
  """BPRW with ``shots`` labelled images per class, ``total_samples //
  shots`` samples from each. Returns (result, ``(C, shots)`` indices)."""
  num_classes = np.asarray(prompt_mu).shape[0]
  index = few_shot_indices(labels, num_classes, shots, seed)
  obs = sample_observations(img_mu, img_logvar, index,
                            max(1, total_samples // shots), seed)
  return bprw(prompt_mu, prompt_logvar, obs, alpha, eps, **em_kw), index


@plotting.styled
def fig_weights(pis, class_names, templates):
  """Heat maps of learned weights, classes x prompts: ``pis`` is one ``(C,
  N)`` array or a dict title -> array; one map and one colour bar per entry
  (``2 * len(pis)`` axes), stacked, the prompts labelled under the last."""
  plt = plotting.pyplot()
  if not isinstance(pis, dict):
    pis = {'BPRW weights': pis}
  n = len(pis)
  first = np.asarray(next(iter(pis.values())))
  c, p = first.shape
  fig, axes = plt.subplots(n, 1, squeeze=False, sharex=True, figsize=(
      2.2 + 0.5 * p, n * (0.6 + 0.25 * c) + 1.6))
  for i, (ax, (title, pi)) in enumerate(zip(axes[:, 0], pis.items())):
    pi = np.asarray(pi)
    im = ax.imshow(pi, cmap='magma', vmin=0, aspect='auto')
    ax.set_yticks(range(pi.shape[0]))
    ax.set_yticklabels(class_names)
    ax.set_xticks(range(pi.shape[1]))
    if i == n - 1:
      ax.set_xticklabels([t.replace('{}', '[c]') for t in templates],
                         rotation=35, ha='right', rotation_mode='anchor')
    ax.set_title(f'{title}: weight π of each prompt per class')
    fig.colorbar(im, ax=ax, fraction=0.05, label='π')
  return fig


def entropy(pi) -> np.ndarray:
  """Entropy (nats) of each row of ``pi`` (uniform over N: log N)."""
  pi = np.asarray(pi, np.float64)
  return -np.sum(np.where(pi > 0, pi * np.log(np.where(pi > 0, pi, 1)), 0), -1)


def summarize(result: BPRWResult) -> dict:
  """Max weight and entropy statistics (C.7, Fig. C.6)."""
  return {'max_pi_mean': float(result.pi.max(1).mean()),
          'entropy_mean': float(entropy(result.pi).mean()),
          'entropy_uniform': float(np.log(result.pi.shape[1])),
          'em_iterations_max': int(result.iterations.max())}
