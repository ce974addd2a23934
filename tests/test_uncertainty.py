"""Uncertainty toolkit: each metric against an independent computation."""

import numpy as np
import pytest
from PIL import Image
from scipy import stats

from prolip_jax.evaluation import uncertainty as U


def _png_ok(path):
  with Image.open(path) as im:
    im.verify()
  with Image.open(path) as im:
    assert im.format == 'PNG'
    assert im.size[0] > 0 and im.size[1] > 0


def test_sigma2_is_trace_of_covariance():
  rng = np.random.default_rng(0)
  lv = rng.normal(-3, 1, (5, 7))
  want = [sum(np.exp(v) for v in row) for row in lv]
  np.testing.assert_allclose(U.sigma2(lv), want, rtol=1e-12)


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_rankdata_and_spearman_match_scipy(seed):
  rng = np.random.default_rng(seed)
  # Integer-valued x (caption lengths: many ties) and continuous y.
  x = rng.integers(1, 8, 60)
  y = rng.normal(size=60) - 0.1 * x
  np.testing.assert_allclose(U.rankdata(x), stats.rankdata(x))
  np.testing.assert_allclose(U.spearman(x, y), stats.spearmanr(x, y)[0],
                             rtol=1e-10)
  # Ties on both sides.
  y2 = np.round(y, 0)
  np.testing.assert_allclose(U.spearman(x, y2), stats.spearmanr(x, y2)[0],
                             rtol=1e-10)


def test_spearman_of_constant_input_is_nan():
  assert np.isnan(U.spearman([1, 1, 1], [1, 2, 3]))


def test_hierarchy_order_matches_loop():
  rng = np.random.default_rng(0)
  s = rng.random((40, 4))
  s[:10] = np.sort(s[:10], axis=1)[:, ::-1]  # perfectly ordered rows
  out = U.hierarchy_order(s)
  hits = total = 0
  per = [0] * 3
  for row in s:
    for i in range(3):
      hits += row[i] > row[i + 1]
      per[i] += row[i] > row[i + 1]
      total += 1
  assert out['adjacent_decreasing'] == pytest.approx(hits / total)
  np.testing.assert_allclose(out['adjacent_by_level'], np.array(per) / 40)
  for i in range(4):
    for j in range(4):
      want = np.mean([row[i] > row[j] for row in s])
      assert out['pairwise'][i][j] == pytest.approx(want)
  np.testing.assert_allclose(out['mean_by_level'], s.mean(0))
  chains = [all(row[i] > row[i + 1] for i in range(3)) for row in s]
  assert out['chain_decreasing'] == pytest.approx(np.mean(chains))
  assert out['chain_decreasing'] >= 0.25  # the 10 sorted rows at least
  scipy_stats = pytest.importorskip('scipy.stats')
  want = scipy_stats.spearmanr(np.tile(np.arange(4), 40), s.ravel())[0]
  assert out['spearman_level'] == pytest.approx(want)
  # Strictly decreasing rows: rank correlation -1 with the level.
  ordered = U.hierarchy_order(np.sort(s, 1)[:, ::-1])
  assert ordered['chain_decreasing'] == 1.0
  assert ordered['spearman_level'] < -0.5


def _inc_printed(mu1, s1, mu2, s2):
  """Eq. 3 as printed, per dimension, from its A, B, C definition."""
  i1, i2 = 1 / s1, 1 / s2
  a = i1 + i2 / 2
  b = 2 * mu1 * i1 + mu2 * i2
  c = mu1**2 * i1 + mu2**2 * i2 / 2
  return -2 * np.log(s1) - np.log(s2) - 0.5 * np.log(a) + b**2 / (4 * a) - c


def test_inclusion_test_matches_eq3_and_sign():
  rng = np.random.default_rng(0)
  n, d = 20, 6
  mu = rng.normal(size=(n, d))
  lv = rng.normal(-2, 0.3, (n, d))
  # Views: same centre, four times the variance -> include the original.
  view_mu = mu + 0.01 * rng.normal(size=(n, d))
  view_lv = lv + np.log(4.0)
  out = U.inclusion_test((mu, lv), (view_mu, view_lv))
  s1, s2 = np.exp(lv), np.exp(view_lv)
  want = (_inc_printed(mu, s1, view_mu, s2)
          - _inc_printed(view_mu, s2, mu, s1)).sum(1)
  np.testing.assert_allclose(out['h'], want, rtol=1e-4, atol=1e-3)
  assert out['positive_fraction'] == 1.0
  assert out['view_more_uncertain'] == 1.0
  rev = U.inclusion_test((view_mu, view_lv), (mu, lv))
  assert rev['positive_fraction'] == 0.0
  np.testing.assert_allclose(rev['h'], -out['h'], rtol=1e-5, atol=1e-3)


def test_extremes():
  v = np.array([3.0, 1.0, 4.0, 1.5, 9.0, 2.0])
  most, least = U.extremes(v, 2)
  assert most.tolist() == [4, 2]
  assert least.tolist() == [1, 3]
  most, least = U.extremes(v, 10)
  assert len(most) == len(least) == 6


def test_occlude_center_zeroes_the_requested_area():
  img = np.full((3, 20, 20, 3), 255, np.uint8)
  out = U.occlude_center(img, 0.25)
  zero = (out == 0).all(-1)
  assert zero[0].sum() == 100  # a 10x10 centre square
  assert zero[0, 5:15, 5:15].all()
  assert (img == 255).all()  # input untouched


def _strokes(light_background: bool) -> np.ndarray:
  """Two (24, 24, 3) line drawings: ink 0 on 255 or 255 on 0."""
  rng = np.random.default_rng(0)
  img = np.full((2, 24, 24, 3), 255 if light_background else 0, np.uint8)
  ink = 0 if light_background else 255
  img[:, 6:18, 11:13] = ink  # a vertical stroke
  img[:, 8:10, 4:20] = ink  # a horizontal one
  img[1, rng.integers(4, 20, 12), rng.integers(4, 20, 12)] = ink
  return img


@pytest.mark.parametrize('light', [True, False])
def test_restyle_thicken_is_a_grey_erosion_or_dilation(light):
  ndimage = pytest.importorskip('scipy.ndimage')
  img = _strokes(light)
  out = U.restyle(img, 'thicken:3')
  spread = ndimage.grey_erosion if light else ndimage.grey_dilation
  want = np.stack([spread(im, size=(3, 3, 1)) for im in img])
  np.testing.assert_array_equal(out[:, 1:-1, 1:-1], want[:, 1:-1, 1:-1])
  ink = 0 if light else 255
  assert (out == ink).sum() > (img == ink).sum()  # strokes got wider


def test_restyle_blur_is_a_gaussian_filter():
  ndimage = pytest.importorskip('scipy.ndimage')
  img = _strokes(True)
  out = U.restyle(img, 'blur:1.5').astype(np.float64)
  want = np.stack([ndimage.gaussian_filter(im.astype(np.float64),
                                           sigma=(1.5, 1.5, 0))
                   for im in img])
  # PIL approximates the Gaussian with box blurs: close, not equal.
  inner = (slice(None), slice(4, -4), slice(4, -4))
  assert np.abs(out[inner] - want[inner]).mean() < 3.0
  assert np.abs(out[inner] - want[inner]).max() < 25.0
  assert np.abs(out - img).max() > 100  # it does blur


def test_restyle_hue_rotates_colours_and_keeps_grey():
  import colorsys  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  img = rng.integers(0, 256, (2, 8, 8, 3)).astype(np.uint8)
  img[0, 0] = 128  # a grey row stays grey
  out = U.restyle(img, 'hue:0.5')
  for y, x in [(1, 2), (3, 5), (6, 7), (7, 0)]:
    r, g, b = img[1, y, x] / 255.0
    h, s, v = colorsys.rgb_to_hsv(r, g, b)
    want = np.array(colorsys.hsv_to_rgb((h + 0.5) % 1.0, s, v)) * 255
    np.testing.assert_allclose(out[1, y, x], want, atol=6)
  np.testing.assert_array_equal(out[0, 0], img[0, 0])
  # No rotation: only the 8-bit HSV round trip's rounding is left.
  np.testing.assert_allclose(U.restyle(img, 'hue:0'), img, atol=8)


@pytest.mark.parametrize('spec', ['blur', 'blur:-1', 'thicken:2',
                                  'thicken:2.5', 'sepia:1', 'hue:x'])
def test_restyle_bad_spec_is_a_config_error(spec):
  from prolip_jax import errors  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.ConfigError, match='style view must be'):
    U.restyle(np.zeros((1, 4, 4, 3), np.uint8), spec)


def test_keep_indices_sorted_unique_and_deterministic():
  k = U.keep_indices_for(4, 16, 0.25, seed=3)
  assert k.shape == (4, 4)
  for row in k:
    assert list(row) == sorted(set(row.tolist()))
    assert row.min() >= 0 and row.max() < 16
  np.testing.assert_array_equal(k, U.keep_indices_for(4, 16, 0.25, seed=3))


def test_mask_tokens():
  pad, eos, mask = 0, 1, 3
  tokens = np.array([[5, 6, 7, 8, eos, pad, pad],
                     [9, eos, pad, pad, pad, pad, pad],
                     [5, 6, 7, 8, 9, 10, eos]])
  out = U.mask_tokens(tokens, 0.5, mask, pad, seed=0, eos_id=eos)
  assert ((out == pad) == (tokens == pad)).all()
  assert ((out == eos) == (tokens == eos)).all()
  assert ((out != tokens).sum(1) >= 1).all()  # every caption changed
  assert set(out[out != tokens].tolist()) == {mask}
  big = np.tile(np.r_[np.arange(10, 40), eos], (200, 1))
  frac = (U.mask_tokens(big, 0.75, mask, pad, eos_id=eos) == mask).mean()
  assert frac == pytest.approx(0.75 * 30 / 31, abs=0.02)
  assert U.num_tokens(tokens, pad).tolist() == [5, 2, 7]


def test_figures_have_expected_axes_and_are_valid_pngs(tmp_path):
  rng = np.random.default_rng(0)
  s_img = rng.lognormal(-6, 0.3, 50)
  s_txt = rng.lognormal(-5, 0.5, 40)
  lengths = rng.integers(2, 20, 40)
  levels = rng.lognormal(-5, 0.3, (30, 4))
  order = U.hierarchy_order(levels)
  h = {'a': {'h': rng.normal(size=30), 'positive_fraction': 0.5},
       'b': {'h': rng.normal(size=30) + 1, 'positive_fraction': 0.8},
       'c': {'h': rng.normal(size=30) - 1, 'positive_fraction': 0.2}}
  images = rng.integers(0, 255, (50, 12, 12, 3), dtype=np.uint8)
  most, least = U.extremes(s_img, 5)
  figs = {
      'hist': (U.fig_sigma2_hist(s_img, s_txt), 1),
      'length': (U.fig_sigma2_vs_length(lengths, s_txt, 0.1), 1),
      'levels': (U.fig_sigma2_by_level(levels, ['a', 'b', 'c', 'd'],
                                       np.array(order['pairwise'])), 3),
      'levels_only': (U.fig_sigma2_by_level(levels, ['a', 'b', 'c', 'd']), 1),
      'inclusion': (U.fig_inclusion_hist(h), 3),
      'inclusion2': (U.fig_inclusion_hist(dict(list(h.items())[:2])), 2),
      'images': (U.fig_extreme_images(images, s_img, most, least), 10),
  }
  for name, (fig, n_axes) in figs.items():
    assert len(fig.axes) == n_axes, name
    path = U.save_figure(fig, str(tmp_path / f'{name}.png'))
    _png_ok(path)


def test_save_figure_closes_the_figure(tmp_path):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig = U.fig_sigma2_hist(np.ones(3) * 1e-3, np.ones(3) * 2e-3)
  before = len(plt.get_fignums())
  U.save_figure(fig, str(tmp_path / 'x.png'))
  assert len(plt.get_fignums()) == before - 1
