"""ProLIP's probabilistic objectives as pure functions of arrays.

Notation follows the ProLIP paper (Chun et al., ICLR 2025). Every embedding is a
diagonal Gaussian N(mu, diag(sigma^2)) given as ``mu`` (L2-normalised) and
``logvar = log sigma^2``, both shaped ``(batch, dim)``. Arithmetic runs in
at least float32 (``compute_dtype``): bf16 and float16 inputs are promoted,
because bf16 variances around exp(-10) lose every significant digit; float64
inputs (under ``jax_enable_x64``) stay float64. Nothing is ever downcast;
where a docstring below says float32, float64 inputs give float64.

Each loss that couples the pairs of a batch has a dense form (one device
holds the batch) and a blockwise form (``*_blockwise``: called inside
``shard_map`` on a device's local shard, it returns the loss of the global
batch, identical on every device and equal to the dense form on the gathered
batch up to summation order). The blockwise forms run on the device ring of
``prolip_jax.losses.ring`` and reuse the dense functions on local blocks:

  ppcl_loss_blockwise   == ppcl_loss    (eq. 2, logits of appendix A.1)
  prolip_loss_blockwise == prolip_loss  (eq. 6)

The dense function is each loss's one entry: given ``axis_name`` (inside
``shard_map``) it runs the blockwise form, so a caller that may or may not
split its batch passes its ``axis_name`` (None: one device) and never
chooses between the two.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp

from prolip_jax.config.paper import ALPHA1
from prolip_jax.config.paper import ALPHA2
from prolip_jax.config.paper import BETA
from prolip_jax.config.paper import INCLUSION_C
from prolip_jax.config.paper import INCLUSION_EPS
from prolip_jax.losses import ring

Array = jax.Array

_LOG2 = math.log(2.0)
# log of the constant factor of  ∫ p1(x)^2 p2(x) dx  for 1-D Gaussians:
# 1 / (2π sqrt(2π)) * sqrt(π)  ->  -log(2π) - log(2)/2.
_LOG_INCLUSION_CONST = -math.log(2.0 * math.pi) - 0.5 * _LOG2

# Keyword defaults: the paper's B.1 recipe, ALPHA1, ALPHA2, BETA (eq. 6
# weights), INCLUSION_C and INCLUSION_EPS, imported above from
# prolip_jax.config.paper (the run's declared loss.* defaults read them too).
# Explosion guards of the release: a term above these is dropped for the step.
VIB_GUARD = 1e4
INCLUSION_GUARD = 1e5


def compute_dtype(*xs) -> jnp.dtype:
  """The arithmetic dtype of the loss modules for inputs ``xs``.

  ``jnp.promote_types`` of float32 and every array's dtype: float32 for
  bf16, float16, float32 (and integer or boolean) inputs, float64 when an
  input is float64 (only possible under ``jax_enable_x64``). Python numbers
  and lists carry no dtype of their own and count as float32.
  """
  dtype = jnp.dtype(jnp.float32)
  for x in xs:
    if hasattr(x, 'dtype'):
      dtype = jnp.promote_types(dtype, x.dtype)
  # A NumPy float64 array without x64 is computed in float32, as JAX would
  # store it (and without asarray's truncation warning).
  return jax.dtypes.canonicalize_dtype(dtype)


def to_compute_dtype(*xs) -> tuple[Array, ...]:
  """Each argument as an array of ``compute_dtype(*xs)``: promoted, never
  downcast, so a float64 caller gets float64 arithmetic."""
  dtype = compute_dtype(*xs)
  return tuple(jnp.asarray(x, dtype) for x in xs)


def csd(mu1: Array, logvar1: Array, mu2: Array, logvar2: Array) -> Array:
  """Closed-form sampled distance between every pair (paper eq. 1).

  d(Z1, Z2) = E||Z1 - Z2||^2 = ||mu1 - mu2||^2 + tr(Sigma1) + tr(Sigma2).

  Args:
    mu1, logvar1: ``(n, d)`` first set of Gaussians.
    mu2, logvar2: ``(m, d)`` second set.

  Returns:
    ``(n, m)`` float32 matrix of distances.
  """
  mu1, logvar1, mu2, logvar2 = to_compute_dtype(mu1, logvar1, mu2, logvar2)
  sq = (jnp.sum(mu1**2, -1)[:, None] + jnp.sum(mu2**2, -1)[None, :]
        - 2.0 * mu1 @ mu2.T)
  tr1 = jnp.sum(jnp.exp(logvar1), -1)
  tr2 = jnp.sum(jnp.exp(logvar2), -1)
  return sq + tr1[:, None] + tr2[None, :]


def ppcl_logits(mu_img: Array, logvar_img: Array, mu_txt: Array,
                logvar_txt: Array, scale: Array, bias: Array) -> Array:
  """Logits of the probabilistic pairwise contrastive loss (eq. 2, A.1).

  logit_ij = a * (mu_i^T mu_j - 1/2 tr(Sigma_i + Sigma_j)) + b, i.e. the
  cosine similarity with the squared L2 distance replaced by CSD (appendix A.4).

  Args:
    mu_img, logvar_img: ``(n, d)``.
    mu_txt, logvar_txt: ``(m, d)``.
    scale: the scalar ``a`` itself (the model stores ``log a``).
    bias: the scalar ``b``.

  Returns:
    ``(n, m)`` float32 logits.
  """
  mu_img, logvar_img, mu_txt, logvar_txt = to_compute_dtype(
      mu_img, logvar_img, mu_txt, logvar_txt)
  half_tr_img = 0.5 * jnp.sum(jnp.exp(logvar_img), -1)
  half_tr_txt = 0.5 * jnp.sum(jnp.exp(logvar_txt), -1)
  sim = mu_img @ mu_txt.T - half_tr_img[:, None] - half_tr_txt[None, :]
  return scale * sim + bias


def sigmoid_pairwise_loss_sum(logits: Array, positives_on_diagonal: bool = True
                              ) -> Array:
  """Sum over all pairs of ``-log sigmoid(y_ij * logit_ij)``.

  ``y_ij`` is +1 on the diagonal when ``positives_on_diagonal`` and -1
  elsewhere; a block of logits that holds no positives (an off-diagonal block
  of the blockwise ring) passes ``positives_on_diagonal=False``.
  """
  n, m = logits.shape
  if positives_on_diagonal:
    labels = 2.0 * jnp.eye(n, m, dtype=logits.dtype) - 1.0
  else:
    labels = -jnp.ones_like(logits)
  return -jnp.sum(jax.nn.log_sigmoid(labels * logits))


def sigmoid_pairwise_loss_blockwise(logits_fn: Callable[[Any, Any], Array],
                                    img: Any, txt: Any,
                                    axis_name: ring.AxisName) -> Array:
  """Global ``sigmoid_pairwise_loss_sum / B`` from local row-aligned blocks.

  Call inside ``shard_map``. ``img`` and ``txt`` are this device's blocks,
  pytrees of ``(b_local, ...)`` arrays (e.g. ``(mu, logvar)``); the text
  blocks travel the bidirectional ring (``ring.ring_sum``) and
  ``logits_fn(img, txt_block)`` scores one ``(b_local, b_local)`` block at a
  time, the own block's diagonal being the positives. Returns the sum over
  all B x B pairs of ``-log sigmoid(y_ij * logit_ij)`` divided by B (per
  image, as ``ppcl_loss``), identical on every device.
  """
  axis_name = ring.hashable_axis(axis_name)
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

  local = ring.ring_sum(block, txt, axis_name)
  return jax.lax.psum(local, axis_name) / (b_img * ring.axis_size(axis_name))


def ppcl_loss(mu_img: Array, logvar_img: Array, mu_txt: Array,
              logvar_txt: Array, scale: Array, bias: Array, *,
              axis_name: Optional[ring.AxisName] = None) -> Array:
  """Probabilistic pairwise contrastive loss, PPCL (paper eq. 2).

  Sigmoid loss over all image-text pairs of the batch with CSD-based logits
  (``ppcl_logits``); pair (i, i) is positive, every other pair negative.
  Normalisation follows SigLIP and the release: the sum over all n*n pairs is
  divided by the number of images n, i.e. the loss is per image.

  Args:
    mu_img, logvar_img, mu_txt, logvar_txt: ``(n, d)``; row i of the images is
      paired with row i of the texts.
    scale: ``a`` (positive, init 10). bias: ``b`` (init -10).
    axis_name: None for the batch on one device; inside ``shard_map``, the
      mesh axis name(s) the batch is sharded over: the arrays are then local
      shards and the result is ``ppcl_loss_blockwise``'s global loss.

  Returns:
    scalar float32 loss.
  """
  if axis_name is not None:
    return ppcl_loss_blockwise(mu_img, logvar_img, mu_txt, logvar_txt, scale,
                               bias, axis_name)
  logits = ppcl_logits(mu_img, logvar_img, mu_txt, logvar_txt, scale, bias)
  return sigmoid_pairwise_loss_sum(logits) / logits.shape[0]


def ppcl_loss_blockwise(mu_img: Array, logvar_img: Array, mu_txt: Array,
                        logvar_txt: Array, scale: Array, bias: Array,
                        axis_name: ring.AxisName) -> Array:
  """PPCL (eq. 2) of the global batch, from this device's shard.

  Call inside ``shard_map``. Equals ``ppcl_loss`` on the batch gathered over
  ``axis_name``: ``-(1/B) sum_{i,j} log sigmoid(y_ij * logit_ij)`` with the
  CSD logits ``a * (mu_i^T mu_j - 1/2 tr(Sigma_i + Sigma_j)) + b`` of
  ``ppcl_logits`` (appendix A.1), pair (i, i) positive.

  ``mu_txt`` and ``logvar_txt`` travel the bidirectional device ring
  (``ring.ring_sum``) in their input dtype; logits are float32 and at most
  one ``b_local x b_local`` block of them is alive per device (forward and
  backward), against ``b_local x B`` for the all-gather form.

  Args:
    mu_img, logvar_img, mu_txt, logvar_txt: ``(b_local, d)`` local shards;
      local row i of the images pairs with local row i of the texts.
    scale: ``a`` itself (not its log), a scalar replicated over the axis.
    bias: ``b``, a replicated scalar.
    axis_name: mesh axis name, or tuple of names, the batch is sharded over.

  Returns:
    scalar float32 loss of the global batch, the same on every device.
  """
  return sigmoid_pairwise_loss_blockwise(
      lambda img, txt: ppcl_logits(img[0], img[1], txt[0], txt[1], scale,
                                   bias),
      (mu_img, logvar_img), (mu_txt, logvar_txt), axis_name)


def log_inclusion(mu1: Array, logvar1: Array, mu2: Array, logvar2: Array,
                  eps: float = 0.0) -> Array:
  """Log inclusion measure inc(Z1, Z2) per dimension, as eq. 3 is printed.

  inc = -2 log s1 - log s2 - 1/2 log A + B^2 / (4A) - C with s = sigma^2,
  A = i1 + i2/2, B = 2 mu1 i1 + mu2 i2, C = mu1^2 i1 + mu2^2 i2 / 2 and
  i = exp(eps) / sigma^2 (the paper's stability trick of section 3.3: eps < 0
  makes every Gaussian look exp(-eps) times wider inside A, B, C).

  This is the *printed* form: its prefactor doubles the log-variance terms of
  the true log ∫p1^2 p2 (see ``log_inclusion_exact``). It is what ProLIP trains
  with. It is evaluated in the algebraically equal, cancellation-free form
  B^2/(4A) - C = -exp(eps) (mu1 - mu2)^2 / (s1 + 2 s2) and
  log A = eps + log(1/s1 + 1/(2 s2)), so gradients stay finite for sigma^2
  from 1e-8 to 1e3 in float32.

  Args:
    mu1, logvar1, mu2, logvar2: arrays of one broadcastable shape
      ``(..., d)``.
    eps: the log of the multiplier on 1/sigma^2 (paper: -20 in training, -100
      recommended for new work, 0 for the plain measure).

  Returns:
    float32 array of the broadcast shape: one value per dimension.
  """
  mu1, logvar1, mu2, logvar2 = to_compute_dtype(mu1, logvar1, mu2, logvar2)
  log_a = eps + jnp.logaddexp(-logvar1, -logvar2 - _LOG2)
  quad = (mu1 - mu2)**2 * jnp.exp(eps - jnp.logaddexp(logvar1,
                                                      logvar2 + _LOG2))
  return -2.0 * logvar1 - logvar2 - 0.5 * log_a - quad


def log_inclusion_exact(mu1: Array, logvar1: Array, mu2: Array,
                        logvar2: Array) -> Array:
  """Exact per-dimension log ∫ p1(x)^2 p2(x) dx with all constants (app. A.5).

  Prefactor -log s1 - 1/2 log s2 (not eq. 3's doubled -2 log s1 - log s2), plus
  the constant -log(2π) - log(2)/2 that eq. 3 omits and no stability trick. Use
  it for analysis; training uses ``log_inclusion``.

  Args:
    mu1, logvar1, mu2, logvar2: broadcastable ``(..., d)``.

  Returns:
    float32 array, one value per dimension; summing over d gives the log of
    the d-dimensional integral for diagonal Gaussians.
  """
  mu1, logvar1, mu2, logvar2 = to_compute_dtype(mu1, logvar1, mu2, logvar2)
  log_a = jnp.logaddexp(-logvar1, -logvar2 - _LOG2)
  quad = (mu1 - mu2)**2 * jnp.exp(-jnp.logaddexp(logvar1, logvar2 + _LOG2))
  return (-logvar1 - 0.5 * logvar2 - 0.5 * log_a - quad
          + _LOG_INCLUSION_CONST)


def inclusion_hypothesis(mu1: Array, logvar1: Array, mu2: Array,
                         logvar2: Array, eps: float = 0.0,
                         per_dimension: bool = False) -> Array:
  """Inclusion hypothesis H(Z1 ⊂ Z2) = inc(Z1, Z2) - inc(Z2, Z1) (eq. 4).

  Positive when Z1 is included in Z2 (Z2 wider and covering Z1's mass).

  Args:
    mu1, logvar1, mu2, logvar2: broadcastable ``(..., d)``.
    eps: stability exponent passed to ``log_inclusion``.
    per_dimension: return ``(..., d)`` per-dimension values (what the loss
      uses) instead of their sum over the last axis ``(...)``.

  Returns:
    float32 array.
  """
  h = (log_inclusion(mu1, logvar1, mu2, logvar2, eps)
       - log_inclusion(mu2, logvar2, mu1, logvar1, eps))
  return h if per_dimension else jnp.sum(h, -1)


def inclusion_loss(mu1: Array, logvar1: Array, mu2: Array, logvar2: Array,
                   c: float = INCLUSION_C, eps: float = INCLUSION_EPS) -> Array:
  """Inclusion loss L_inclusion(Z1 ⊂ Z2) (eq. 5).

  -log sigmoid(c * H) with H per dimension (``inclusion_hypothesis(...,
  per_dimension=True)``), averaged over the batch and the dimensions as in the
  release. Defaults c = 1000, eps = -20 are the paper's training values; the
  paper recommends c = 10, eps = -100 for new work.

  Args:
    mu1, logvar1: ``(n, d)`` the Gaussians that should be included.
    mu2, logvar2: ``(n, d)`` the including Gaussians, row-aligned.

  Returns:
    scalar float32 loss.
  """
  h = inclusion_hypothesis(mu1, logvar1, mu2, logvar2, eps,
                           per_dimension=True)
  return jnp.mean(-jax.nn.log_sigmoid(c * h))


def vib_loss(mu: Array, logvar: Array, release_quirk: bool = False) -> Array:
  """Variational information bottleneck, KL(N(mu, sigma^2) || N(0, 1)) (eq. A.2).

  -1/2 (1 + log s - mu^2 - s) per element, averaged over batch and dimensions.

  Args:
    mu, logvar: ``(n, d)``.
    release_quirk: reproduce the public release, which evaluates the formula
      with log sigma = logvar / 2 in place of log sigma^2 (also inside
      sigma^2 = exp(.)). Off by default: the paper's KL.

  Returns:
    scalar float32 loss.
  """
  mu, logvar = to_compute_dtype(mu, logvar)
  lv = 0.5 * logvar if release_quirk else logvar
  return jnp.mean(-0.5 * (1.0 + lv - mu**2 - jnp.exp(lv)))


class GaussianBatch(NamedTuple):
  """Means and log-variances of a batch of Gaussian embeddings, ``(n, d)``."""
  mu: Array
  logvar: Array


def prolip_regularizers(img: GaussianBatch, txt: GaussianBatch,
                        img_masked: Optional[GaussianBatch] = None,
                        txt_masked: Optional[GaussianBatch] = None, *,
                        c: float = INCLUSION_C, eps: float = INCLUSION_EPS,
                        vib_release_quirk: bool = False) -> dict[str, Array]:
  """The per-sample terms of eq. 6, each a mean over its local samples.

  Returns a dict with ``inclusion_img_txt`` (Z_v ⊂ Z_t, row-aligned pairs),
  ``inclusion_masked_img`` / ``inclusion_masked_txt`` (Z ⊂ Z_masked, the
  masked copies being of the first ``n_masked`` rows) and ``vib_img`` /
  ``vib_txt``. Masked terms are absent when no masked copies are given.
  Unweighted; ``combine_prolip_terms`` applies eq. 6's weights.
  """
  terms = {
      'inclusion_img_txt': inclusion_loss(img.mu, img.logvar, txt.mu,
                                          txt.logvar, c, eps),
      'vib_img': vib_loss(img.mu, img.logvar, vib_release_quirk),
      'vib_txt': vib_loss(txt.mu, txt.logvar, vib_release_quirk),
  }
  for name, full, masked in (('img', img, img_masked),
                             ('txt', txt, txt_masked)):
    if masked is not None:
      n = masked.mu.shape[0]
      terms[f'inclusion_masked_{name}'] = inclusion_loss(
          full.mu[:n], full.logvar[:n], masked.mu, masked.logvar, c, eps)
  return terms


def combine_prolip_terms(terms: Mapping[str, Array], *, alpha1: float = ALPHA1,
                         alpha2: float = ALPHA2, beta: float = BETA,
                         guard: bool = True) -> tuple[Array, dict[str, Array]]:
  """Weighted sum of eq. 6 from already-reduced terms.

  ``terms`` holds ``ppcl`` plus the output of ``prolip_regularizers`` (already
  averaged over the whole batch when sharded). With ``guard`` the release's
  explosion guards apply: a VIB term above 1e4 or an inclusion term whose
  magnitude exceeds 1e5 is dropped for this step, and ``guard_dropped`` counts
  how many were. A non-finite term is kept (the total is then non-finite and
  the train step skips the update), as in the release.

  Returns:
    ``(total, metrics)`` where metrics holds every term and the total.
  """
  weights = {'ppcl': 1.0, 'inclusion_img_txt': alpha1,
             'inclusion_masked_img': alpha2, 'inclusion_masked_txt': alpha2,
             'vib_img': beta, 'vib_txt': beta}
  total = jnp.zeros((), jnp.float32)
  dropped = jnp.zeros((), jnp.int32)
  for name, value in terms.items():
    if name not in weights:
      raise KeyError(f'unknown ProLIP loss term {name!r}')
    # As the release's `if term > limit`: a NaN passes the guard, so the
    # total shows it and the train step skips the update; PPCL itself is
    # never dropped.
    keep = jnp.asarray(True)
    if guard and name.startswith('vib'):
      keep = ~(value > VIB_GUARD)
    elif guard and name.startswith('inclusion'):
      keep = ~(jnp.abs(value) > INCLUSION_GUARD)
    total = total + jnp.where(keep, weights[name] * value, 0.0)
    dropped = dropped + (~keep).astype(jnp.int32)
  metrics = dict(terms)
  metrics['loss'] = total
  if guard:
    metrics['guard_dropped'] = dropped
  return total, metrics


def prolip_loss(img: GaussianBatch, txt: GaussianBatch, scale: Array,
                bias: Array, img_masked: Optional[GaussianBatch] = None,
                txt_masked: Optional[GaussianBatch] = None, *,
                alpha1: float = ALPHA1, alpha2: float = ALPHA2,
                beta: float = BETA, c: float = INCLUSION_C,
                eps: float = INCLUSION_EPS, vib_release_quirk: bool = False,
                guard: bool = True, axis_name: Optional[ring.AxisName] = None
                ) -> tuple[Array, dict[str, Array]]:
  """The full ProLIP objective of eq. 6 (its blockwise form with ``axis_name``).

  L = PPCL(v, t) + alpha1 * L_inc(v ⊂ t)
      + alpha2 * [L_inc(v ⊂ v_masked) + L_inc(t ⊂ t_masked)]
      + beta * [VIB(v) + VIB(t)].

  Each term is a mean over its samples (PPCL per image as in SigLIP; the others
  over batch and dimensions), as in the release, rather than eq. 6's raw sums.

  Args:
    img, txt: ``GaussianBatch`` of ``(n, d)``, row-aligned pairs.
    scale, bias: the PPCL scalars ``a`` (not its log) and ``b``.
    img_masked, txt_masked: optional ``(n_masked, d)`` embeddings of masked
      copies of the first ``n_masked`` images / texts.
    alpha1, alpha2, beta: eq. 6 weights (defaults from paper B.1).
    c, eps: inclusion-loss sharpness and stability exponent.
    vib_release_quirk: see ``vib_loss``.
    guard: drop exploding terms for the step as the release does.
    axis_name: None for the batch on one device; inside ``shard_map``, the
      mesh axis name(s) the batch is sharded over: the arrays are then local
      shards and the result is ``prolip_loss_blockwise``'s (see its
      masked-copy convention).

  Returns:
    ``(total, metrics)``; metrics holds every unweighted term and ``loss``.
  """
  if axis_name is not None:
    return prolip_loss_blockwise(
        img, txt, scale, bias, img_masked, txt_masked, axis_name=axis_name,
        alpha1=alpha1, alpha2=alpha2, beta=beta, c=c, eps=eps,
        vib_release_quirk=vib_release_quirk, guard=guard)
  terms = {'ppcl': ppcl_loss(img.mu, img.logvar, txt.mu, txt.logvar, scale,
                             bias)}
  terms.update(prolip_regularizers(img, txt, img_masked, txt_masked, c=c,
                                   eps=eps,
                                   vib_release_quirk=vib_release_quirk))
  return combine_prolip_terms(terms, alpha1=alpha1, alpha2=alpha2, beta=beta,
                              guard=guard)


def prolip_loss_blockwise(img: GaussianBatch, txt: GaussianBatch,
                          scale: Array, bias: Array,
                          img_masked: Optional[GaussianBatch] = None,
                          txt_masked: Optional[GaussianBatch] = None, *,
                          axis_name: ring.AxisName, alpha1: float = ALPHA1,
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
  axis_name = ring.hashable_axis(axis_name)
  terms = {'ppcl': ppcl_loss_blockwise(img.mu, img.logvar, txt.mu,
                                       txt.logvar, scale, bias, axis_name)}
  local = prolip_regularizers(img, txt, img_masked, txt_masked, c=c, eps=eps,
                              vib_release_quirk=vib_release_quirk)
  terms.update(jax.lax.pmean(local, axis_name))
  return combine_prolip_terms(terms, alpha1=alpha1, alpha2=alpha2, beta=beta,
                              guard=guard)
