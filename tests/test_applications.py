"""BPRW, inclusion traversal and filtering against independent computations."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from PIL import Image

from prolip_jax.applications import bprw
from prolip_jax.applications import filtering
from prolip_jax.applications import traversal
from prolip_jax.evaluation import metrics as eval_metrics

import support


# ---------------------------------------------------------------------------
# BPRW.


def _mixture(rng, pi, means, var, m):
  comp = rng.choice(len(pi), size=m, p=pi)
  return (means[comp] + np.sqrt(var[comp]) * rng.standard_normal(
      (m, means.shape[1]))).astype(np.float32)


def test_log_density_matches_scipy():
  from scipy import stats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 3))
  mu = rng.normal(size=(4, 3))
  var = rng.uniform(0.2, 2.0, (4, 3))
  got = np.asarray(bprw.log_density(x, mu, var))
  for j in range(5):
    for n in range(4):
      want = stats.multivariate_normal(mu[n], np.diag(var[n])).logpdf(x[j])
      assert got[j, n] == pytest.approx(want, rel=1e-4)


def test_em_recovers_generating_prompt_weights():
  """Two classes, four 'prompts' each; observations drawn from the mixture
  with known weights; alpha = 1 (flat prior) -> maximum likelihood."""
  rng = np.random.default_rng(0)
  d, m = 6, 6000
  true_pi = np.array([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
  mus, lvs, obs = [], [], []
  for c in range(2):
    means = 2.0 * np.eye(4, d) + rng.normal(0, 0.1, (4, d))
    var = rng.uniform(0.3, 0.6, (4, d))
    mus.append(means)
    lvs.append(np.log(var))
    obs.append(_mixture(rng, true_pi[c], means, var, m))
  res = bprw.bprw(np.stack(mus), np.stack(lvs), np.stack(obs), alpha=1.0,
                  eps=0.0, max_iters=5000, tol=1e-8)
  np.testing.assert_allclose(res.pi, true_pi, atol=0.03)
  np.testing.assert_allclose(res.pi.sum(1), 1.0, rtol=1e-5)
  # Initial weights: normalised 1 / tr(Sigma).
  inv = 1.0 / np.exp(np.stack(lvs)).sum(-1)
  np.testing.assert_allclose(res.pi_init, inv / inv.sum(1, keepdims=True),
                             rtol=1e-5)


@pytest.mark.parametrize('alpha', [2.0, 5.0])
def test_em_fixed_point_is_the_map_found_by_optax(alpha):
  """EM's fixed point maximises log p(X|pi) + (alpha-1) sum log pi; the same
  objective maximised directly over softmax logits with Adam agrees."""
  rng = np.random.default_rng(1)
  d, n, m, eps = 5, 4, 40, 0.02
  means = rng.normal(0, 1.0, (n, d))
  lv = np.log(rng.uniform(0.2, 0.8, (n, d)))
  x = _mixture(rng, np.array([0.6, 0.25, 0.1, 0.05]), means,
               np.exp(lv), m)
  res = bprw.bprw(means[None], lv[None], x[None], alpha=alpha, eps=eps,
                  max_iters=20000, tol=1e-9)
  pi_em = res.pi[0]

  # Independent: the objective written out directly (no bprw helpers).
  var = np.exp(lv) + eps
  log_f = jnp.asarray(
      -0.5 * (((x[:, None, :] - means[None]) ** 2 / var[None]).sum(-1)
              + np.log(2 * np.pi * var).sum(-1)[None]), jnp.float32)

  def neg_objective(theta):
    log_pi = jax.nn.log_softmax(theta)
    lik = jnp.sum(jax.nn.logsumexp(log_pi[None] + log_f, axis=1))
    return -(lik + (alpha - 1.0) * jnp.sum(log_pi))

  opt = optax.adam(0.05)
  theta = jnp.zeros(n)

  @jax.jit
  def run(theta):
    def step(carry, _):
      theta, state = carry
      g = jax.grad(neg_objective)(theta)
      upd, state = opt.update(g, state)
      return (optax.apply_updates(theta, upd), state), None
    (theta, _), _ = jax.lax.scan(step, (theta, opt.init(theta)), None,
                                 length=4000)
    return theta

  pi_opt = np.asarray(jax.nn.softmax(run(theta)))
  np.testing.assert_allclose(pi_em, pi_opt, atol=2e-3)
  # And the M-step closed form holds at the fixed point.
  gamma = np.asarray(jax.nn.softmax(np.log(pi_em)[None] + log_f, axis=1))
  nn_ = gamma.sum(0)
  np.testing.assert_allclose(pi_em, (nn_ + alpha - 1) / (m + n * (alpha - 1)),
                             atol=1e-4)
  assert res.log_posterior[0] >= float(-neg_objective(jnp.log(pi_opt))) - 1e-2


def test_em_never_decreases_the_map_objective():
  rng = np.random.default_rng(2)
  means = rng.normal(size=(5, 4))
  var = np.full((5, 4), 0.5)
  x = _mixture(rng, np.full(5, 0.2), means, var, 50)
  log_f = bprw.log_density(x, means, var)
  pi = jnp.asarray([0.6, 0.1, 0.1, 0.1, 0.1])
  alpha = jnp.full(5, 3.0)
  prev = -np.inf
  for _ in range(30):
    cur = float(bprw.log_posterior(pi, log_f, alpha))
    assert cur >= prev - 1e-3
    prev = cur
    pi = bprw.em_step(pi, log_f, alpha)


def test_uniform_weights_reproduce_the_prompt_ensemble():
  rng = np.random.default_rng(3)
  mu = rng.normal(size=(3, 4, 8)).astype(np.float32)
  lv = rng.normal(-3, 0.5, (3, 4, 8)).astype(np.float32)
  got_mu, got_var = bprw.reweighted_classifier(mu, lv, np.full((3, 4), 0.25))
  want_mu, want_var = eval_metrics.class_gaussians(mu, lv)
  np.testing.assert_allclose(got_mu, want_mu, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_var, want_var, rtol=1e-5)


def test_observation_helpers():
  rng = np.random.default_rng(4)
  img_mu = rng.normal(size=(30, 4)).astype(np.float32)
  img_lv = np.full((30, 4), np.log(0.01), np.float32)
  labels = np.repeat(np.arange(3), 10)
  idx = bprw.few_shot_indices(labels, 3, 4, seed=0)
  assert idx.shape == (3, 4)
  for c in range(3):
    assert (labels[idx[c]] == c).all() and len(set(idx[c])) == 4
  obs = bprw.sample_observations(img_mu, img_lv, idx, 500, seed=0)
  assert obs.shape == (3, 4 * 500, 4)
  first = obs[0, :500]
  np.testing.assert_allclose(first.mean(0), img_mu[idx[0, 0]], atol=0.02)
  np.testing.assert_allclose(first.std(0), 0.1, rtol=0.1)
  # Nearest images by CSD: brute force.
  cls_mu = rng.normal(size=(3, 4)).astype(np.float32)
  cls_var = np.full((3, 4), 0.05, np.float32)
  near = bprw.nearest_images(cls_mu, cls_var, img_mu, img_lv, 5)
  for c in range(3):
    d = [((cls_mu[c] - img_mu[i]) ** 2).sum() for i in range(30)]
    assert set(near[c]) == set(np.argsort(d)[:5])


def test_zero_and_few_shot_bprw_run_and_shift_weights():
  """Prompts 0 and 1 per class; the class's images sit on prompt 1's mean,
  so both modes move the weight onto prompt 1."""
  rng = np.random.default_rng(5)
  c, n, d = 3, 2, 8
  centres = 3.0 * np.eye(c, d)
  p_mu = np.stack([np.stack([centres[k] + 0.4 * np.eye(d)[c + 0],
                             centres[k] + 0.4 * np.eye(d)[c + 1]])
                   for k in range(c)]).astype(np.float32)
  p_lv = np.full((c, n, d), np.log(0.01), np.float32)
  labels = np.repeat(np.arange(c), 20)
  img_mu = (p_mu[labels, 1] + rng.normal(0, 0.05, (len(labels), d))
            ).astype(np.float32)
  img_lv = np.full_like(img_mu, np.log(1e-3))
  zs, index = bprw.zero_shot_bprw(p_mu, p_lv, img_mu, img_lv, m=5, k=10)
  assert index.shape == (c, 5)
  assert (labels[index] == np.arange(c)[:, None]).all()
  assert (zs.pi[:, 1] > 0.9).all()
  fs, idx = bprw.few_shot_bprw(p_mu, p_lv, img_mu, img_lv, labels, shots=4)
  assert idx.shape == (c, 4)
  assert (fs.pi[:, 1] > 0.9).all()
  s = bprw.summarize(fs)
  assert s['entropy_uniform'] == pytest.approx(np.log(2))
  fig = bprw.fig_weights({'zero-shot': zs.pi, 'few-shot': fs.pi},
                         ['a', 'b', 'c'], ['{}', 'a {}'])
  assert len(fig.axes) == 4


# ---------------------------------------------------------------------------
# Traversal.


def _g(x, y, v, d=4):
  mu = np.zeros(d, np.float32)
  mu[0], mu[1] = x, y
  return mu, np.full(d, np.log(v), np.float32)


NAMES = ['animal', 'dog', 'small dog', 'cat', 'small cat']


def _hierarchy():
  """A two-branch hierarchy in the first two dimensions: 'animal' (wide) at
  (1, 0); 'dog' at (2, 0) above 'small dog' (narrow) at (2.5, 0.5); 'cat' at
  (0, 2) above 'small cat' at (0.5, 2.5); "" at the origin."""
  caps = [_g(1, 0, 0.2), _g(2, 0, 0.05), _g(2.5, 0.5, 0.01), _g(0, 2, 0.05),
          _g(0.5, 2.5, 0.01)]
  db = (np.stack([c[0] for c in caps]), np.stack([c[1] for c in caps]))
  imgs = [_g(2.6, 0.55, 1e-3), _g(0.55, 2.6, 1e-3)]
  img = (np.stack([c[0] for c in imgs]), np.stack([c[1] for c in imgs]))
  return img, db, _g(0, 0, 0.1)


def _eq3(mu1, s1, mu2, s2):
  i1, i2 = 1 / s1, 1 / s2
  a = i1 + i2 / 2
  b = 2 * mu1 * i1 + mu2 * i2
  c = mu1**2 * i1 + mu2**2 * i2 / 2
  return (-2 * np.log(s1) - np.log(s2) - 0.5 * np.log(a) + b**2 / (4 * a)
          - c).sum(-1)


def test_traversal_on_a_hand_built_hierarchy():
  img, db, empty = _hierarchy()
  tr = traversal.traverse(img, db, empty, steps=50)
  assert tr.nearest.tolist() == [2, 4]  # small dog, small cat
  # The caption that includes 'small dog' most is its parent 'dog'.
  assert tr.root.tolist() == [1, 3]
  assert [[NAMES[i] for i in p] for p in tr.paths] == [
      ['animal', 'dog', 'small dog'], ['cat', 'small cat']]
  assert tr.steps.shape == (2, 50)
  m = traversal.traversal_metrics(tr, gt=[[0, 1, 2], [0, 3, 4]],
                                  gt_root=[0, 0])
  assert m['precision'] == pytest.approx(1.0)
  assert m['recall'] == pytest.approx((1 + 2 / 3) / 2)
  assert m['root_R@1'] == pytest.approx(0.5)
  assert m['path_length'] == pytest.approx(2.5)
  # "" alone as [ROOT]: both branches start at 'animal'.
  null = traversal.traverse(img, db, empty, steps=50, root='null')
  assert [[NAMES[i] for i in p] for p in null.paths] == [
      ['animal', 'dog', 'small dog'], ['animal', 'cat', 'small cat']]


def test_most_inclusive_matches_eq3_and_eq4_by_hand():
  _, db, _ = _hierarchy()
  mu, var = db[0].astype(np.float64), np.exp(db[1].astype(np.float64))
  for q in range(5):
    inc = np.array([_eq3(mu[q], var[q], mu[k], var[k]) for k in range(5)])
    h = np.array([_eq3(mu[q], var[q], mu[k], var[k])
                  - _eq3(mu[k], var[k], mu[q], var[q]) for k in range(5)])
    inc[q] = -np.inf
    assert traversal.most_inclusive(np.array([q]), db, score='measure')[0] \
        == np.argmax(inc)
    assert traversal.most_inclusive(np.array([q]), db,
                                    score='hypothesis')[0] == np.argmax(h)
  # The hypothesis prefers the wider caption of the *other* branch for
  # 'small dog' (its quadratic term grows with distance), which is why
  # 'measure' is the default.
  assert NAMES[traversal.most_inclusive(np.array([2]), db,
                                        score='hypothesis')[0]] == 'cat'


def test_traversal_figure_axes():
  img, db, empty = _hierarchy()
  tr = traversal.traverse(img, db, empty, steps=10)
  s2 = np.exp(db[1]).sum(1)
  assert len(traversal.fig_traversal(tr, s2).axes) == 1
  fig = traversal.fig_traversal(tr, s2, np.array([0, 1, 2, 1, 2]),
                                others={'null': tr})
  assert len(fig.axes) == 2


# ---------------------------------------------------------------------------
# Filtering.


def test_filtering_keeps_exactly_the_expected_keys(tmp_path):
  rng = np.random.default_rng(0)
  n, d = 10, 8
  img_mu = rng.normal(size=(n, d)).astype(np.float32)
  # Caption i sits at distance offset[i] from its image along one axis.
  offset = rng.permutation(n).astype(np.float32) * 0.1
  txt_mu = img_mu.copy()
  txt_mu[:, 0] += offset
  img_lv = np.full((n, d), np.log(1e-3), np.float32)
  txt_lv = np.full((n, d), np.log(1e-3), np.float32)
  keys = [f'rec{i}' for i in range(n)]
  scores = np.asarray(filtering.pair_scores(img_mu, img_lv, txt_mu, txt_lv))
  np.testing.assert_allclose(scores, -(offset**2 + 2 * d * 1e-3), rtol=1e-5)
  kept = filtering.select(keys, scores, 0.6)
  assert kept == [f'rec{i}' for i in np.argsort(offset)[:6]]
  # A sigma_t^2 penalty: make the two best pairs' captions very uncertain.
  best2 = np.argsort(offset)[:2]
  txt_lv2 = txt_lv.copy()
  txt_lv2[best2] = np.log(1.0)
  scores2 = np.asarray(filtering.pair_scores(img_mu, img_lv, txt_mu, txt_lv2,
                                             w_txt=1.0))
  kept2 = filtering.select(keys, scores2, 0.6)
  assert set(kept2) == {f'rec{i}' for i in np.argsort(offset)[2:8]}
  path = filtering.write_keys(str(tmp_path / 'kept.txt'), kept)
  assert open(path).read().split() == kept
  assert filtering.num_kept(10, 0.0) == 0 and filtering.num_kept(10, 1) == 10
  with pytest.raises(ValueError):
    filtering.num_kept(10, 1.5)


def test_select_from_score_files_merges_hosts(tmp_path):
  rng = np.random.default_rng(1)
  keys = [f'k{i:03d}' for i in range(50)]
  scores = rng.normal(size=50)
  want = filtering.select(keys, scores, 0.3)
  paths = [filtering.write_scores(str(tmp_path / f'scores-{p}.jsonl'),
                                  keys[p::3], scores[p::3]) for p in range(3)]
  got = filtering.select_from_score_files(paths, 0.3,
                                          str(tmp_path / 'kept.txt'))
  assert got == want
  assert open(tmp_path / 'kept.txt').read().split() == want


def _random_model(tmp_path):
  from prolip_jax.interop import load as load_lib  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / 'tok.model')
  cfg, params = support.tiny_random_model(16, path)
  tok = tok_lib.Tokenizer(path, cfg.text.context_length, pad_id=0)
  return load_lib.LoadedModel(cfg, params, tok, batch_size=16)


@pytest.mark.slow
def test_sharded_scoring_matches_unsharded_and_embeddings(tmp_path):
  from prolip_jax import sharding  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import digits  # pylint: disable=g-import-not-at-top
  model = _random_model(tmp_path)
  images, labels = digits.split('heldout')
  idx = np.arange(0, 1000, 50)  # 20 records, two of each class
  rgb = np.repeat(images[idx][..., None], 3, -1)
  caps = [c[4] for c in digits.captions_for(images[idx], labels[idx])]
  records = [{'image': rgb[i], 'caption': caps[i], 'key': f'r{i}'}
             for i in range(len(idx))]
  n_dev = len(jax.devices())
  mesh = sharding.make_mesh({'data': -1, 'fsdp': 1})
  keys, sharded = filtering.score_records(model, records, 2 * n_dev, mesh)
  _, plain = filtering.score_records(model, records, 8, None)
  assert keys == [f'r{i}' for i in range(len(idx))]
  np.testing.assert_allclose(sharded, plain, rtol=1e-4, atol=1e-5)
  # Independent: embed with the model's own encoders, CSD per pair by hand.
  v_mu, v_lv = model.encode_image(list(rgb))
  t_mu, t_lv = model.encode_text(caps)
  want = -(((v_mu - t_mu) ** 2).sum(1) + np.exp(v_lv).sum(1)
           + np.exp(t_lv).sum(1))
  np.testing.assert_allclose(plain, want, rtol=1e-4, atol=1e-5)
  # Two "hosts" (strided shares) cover every record exactly once.
  parts = [filtering.score_records(model, records, 8, None, process_index=p,
                                   process_count=2) for p in range(2)]
  merged = dict(zip(parts[0][0] + parts[1][0],
                    np.concatenate([parts[0][1], parts[1][1]])))
  assert sorted(merged) == sorted(keys)
  np.testing.assert_allclose([merged[k] for k in keys], plain, rtol=1e-5)
  fig = filtering.fig_scores(plain, float(np.median(plain)),
                             np.arange(len(plain)) % 2 == 0)
  assert len(fig.axes) == 1
  from prolip_jax.evaluation import uncertainty  # pylint: disable=g-import-not-at-top
  out = uncertainty.save_figure(fig, str(tmp_path / 'f.png'))
  with Image.open(out) as im:
    assert im.size[0] > 0
