"""Every figure is readable at its saved size: text >= 8 pt, log axes with
>= 4 labelled ticks, no text overlapping other text or another axes."""

import itertools
import types

import numpy as np
import pytest

from prolip_jax import plotting
from prolip_jax.applications import bprw
from prolip_jax.applications import filtering
from prolip_jax.applications import traversal
from prolip_jax.evaluation import uncertainty as U

matplotlib = pytest.importorskip('matplotlib')


@pytest.mark.parametrize('lo, hi', [
    (0.15, 0.28), (2.0e-3, 3.1e-3), (1e-5, 1e-1), (1e-10, 1e3), (0.9, 1.2),
    (3e-4, 5e-3), (0.23, 0.245)])
def test_log_ticks_label_at_least_four_round_values_in_view(lo, hi):
  ticks = plotting.log_ticks_in(lo, hi)
  assert 4 <= len(ticks) <= 8, ticks
  assert np.all(np.diff(ticks) > 0)
  assert ticks[0] >= lo * (1 - 1e-9) and ticks[-1] <= hi * (1 + 1e-9)
  # Round values: a mantissa with at most three significant digits.
  for t in ticks:
    mantissa = t / 10.0**np.floor(np.log10(t))
    assert abs(mantissa * 100 - round(mantissa * 100)) < 1e-6, t


def test_tick_labels_are_short():
  assert plotting._label(0.22) == '0.22'  # pylint: disable=protected-access
  assert plotting._label(0.00258) == '0.00258'  # pylint: disable=protected-access
  assert plotting._label(1e-5) == '$10^{-5}$'  # pylint: disable=protected-access
  assert plotting._label(2e-5) == r'$2\times10^{-5}$'  # pylint: disable=protected-access
  # Enough digits to tell neighbours apart on a narrow axis.
  assert plotting.tick_labels([0.23, 0.2301, 0.2302]) == [
      '0.23', '0.2301', '0.2302']


def _figures():
  """Every figure the library draws, on data shaped like the digits run
  (sigma^2 within one decade, the digits' 10 classes and prompts)."""
  rng = np.random.default_rng(0)
  s_img = rng.uniform(0.12, 0.19, 300)
  s_txt = rng.uniform(0.15, 0.29, 400)
  levels = np.sort(rng.uniform(0.15, 0.29, (100, 4)), 1)[:, ::-1]
  order = U.hierarchy_order(levels)
  views = ['image, 75% patches dropped', 'image, 25% centre occluded',
           'text, 75% tokens masked', 'text, 1 attribute in name',
           'text, 2 attributes in 1 attribute',
           'text, 3 attributes in 2 attributes']
  tests = {v: {'h': rng.normal(size=200) * 10, 'positive_fraction': 0.5}
           for v in views}
  images = rng.integers(0, 255, (20, 28, 28), dtype=np.uint8)
  templates = ['a photo of the number {}.', 'a handwritten {}.',
               'the digit {}.', 'a drawing of a {}.', '{}',
               'the handwritten digit {}', 'a thin {}', 'a thick {}',
               'a wide handwritten {}', 'a narrow handwritten {}']
  classes = ['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven',
             'eight', 'nine']
  pis = {'zero-shot BPRW': rng.dirichlet(np.ones(10), 10),
         '5-shot BPRW': rng.dirichlet(np.ones(10), 10)}
  run = types.SimpleNamespace(steps=rng.integers(0, 50, (30, 51)))
  null = types.SimpleNamespace(steps=rng.integers(0, 50, (30, 51)))
  return {
      'sigma2_hist': U.fig_sigma2_hist(s_img, s_txt),
      'sigma2_vs_length': U.fig_sigma2_vs_length(
          rng.integers(2, 20, 400), s_txt, -0.14),
      'sigma2_by_level': U.fig_sigma2_by_level(
          levels, ['name', '1 attribute', '2 attributes', '3 attributes'],
          np.array(order['pairwise'])),
      'inclusion_hist': U.fig_inclusion_hist(tests),
      'uncertain_images': U.fig_extreme_images(
          images, rng.uniform(0.1, 0.2, 20), np.arange(8), np.arange(8, 16)),
      'bprw_weights': bprw.fig_weights(pis, classes, templates),
      'traversal': traversal.fig_traversal(
          run, rng.uniform(0.2, 0.27, 50), rng.integers(0, 4, 50),
          'inclusion-based [ROOT]', {'empty-caption [ROOT]': null}),
      'filtering_scores': filtering.fig_scores(
          rng.normal(size=300), 0.0, rng.random(300) < 0.2),
  }


def _texts(fig):
  """Every text drawn: tick labels only of ticks inside the view (matplotlib
  keeps, undrawn, the labels of ticks just outside)."""
  renderer = fig.canvas.get_renderer()
  ticklabels, drawn = set(), []
  for ax in fig.axes:
    for axis in (ax.xaxis, ax.yaxis):
      lo, hi = sorted(axis.get_view_interval())
      for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        labels = (tick.label1, tick.label2)
        ticklabels.update(labels)
        if lo - 1e-12 <= tick.get_loc() <= hi + 1e-12:
          drawn += [l for l in labels if l.get_visible()]
  texts = [t for t in fig.findobj(matplotlib.text.Text)
           if t not in ticklabels and t.get_visible()] + drawn
  out = []
  for t in texts:
    if t.get_text().strip():
      box = t.get_window_extent(renderer)
      if box.width > 0 and box.height > 0:
        out.append((t, box))
  return out


@pytest.mark.slow  # draws eight figures: about 10 s on an idle 2-core CPU
def test_every_figure_is_readable_at_its_saved_size():
  for name, fig in _figures().items():
    fig.set_dpi(plotting.DPI)
    fig.canvas.draw()
    texts = _texts(fig)
    for t, _ in texts:
      assert t.get_fontsize() >= 8, (name, t.get_text(), t.get_fontsize())
    for ax in fig.axes:
      for axis, scale in ((ax.xaxis, ax.get_xscale()),
                          (ax.yaxis, ax.get_yscale())):
        if scale != 'log':
          continue
        lo, hi = sorted(axis.get_view_interval())
        labelled = [t for t in axis.get_majorticklabels()
                    if t.get_text() and lo <= t.get_position()[
                        0 if axis is ax.xaxis else 1] <= hi]
        assert len(labelled) >= 4, (name, [t.get_text() for t in labelled])
    # No two texts overlap (a pixel of slack for touching boxes).
    for (a, box_a), (b, box_b) in itertools.combinations(texts, 2):
      if a.get_rotation() == b.get_rotation() and a.get_rotation() % 90:
        # Parallel slanted labels (boxes overlap, letters need not): the
        # gap across the writing direction must exceed the font height.
        theta = np.deg2rad(a.get_rotation())
        pa = a.get_transform().transform(a.get_position())
        pb = b.get_transform().transform(b.get_position())
        gap = abs((pb - pa) @ np.array([np.sin(theta), -np.cos(theta)]))
        assert gap >= a.get_fontsize() * plotting.DPI / 72, (
            name, a.get_text(), b.get_text())
        continue
      assert not box_a.shrunk(0.98, 0.9).overlaps(box_b.shrunk(0.98, 0.9)), (
          name, a.get_text(), b.get_text())
    # No text over the plotting area of an axes it does not belong to
    # (e.g. an image's value over the image above it).
    renderer = fig.canvas.get_renderer()
    for t, box in texts:
      for ax in fig.axes:
        if t.axes is ax:
          continue
        area = ax.get_window_extent(renderer)
        assert not box.shrunk(0.98, 0.9).overlaps(area), (name, t.get_text())
    plotting.pyplot().close(fig)


def test_saved_figures_mark_log_axes_and_name_their_source(tmp_path):
  plt = plotting.pyplot()
  fig, (a, b) = plt.subplots(1, 2)
  a.plot([1, 2, 3], [1e-4, 1e-3, 1e-2])
  plotting.log_axis(a, 'y')
  a.set_ylabel('sigma^2')  # set after the scale, as the figures do
  a.set_xlabel('step')
  b.plot([1, 2], [3, 4])
  b.set_ylabel('count')
  path = plotting.save(fig, str(tmp_path / 'f.png'),
                       source='prolip_emoji, step 1500')
  assert (tmp_path / 'f.png').stat().st_size > 0 and path.endswith('f.png')
  assert a.get_ylabel() == 'sigma^2 (log scale)'
  assert a.get_xlabel() == 'step' and b.get_ylabel() == 'count'
  assert [t.get_text() for t in fig.texts] == ['prolip_emoji, step 1500']


@pytest.mark.parametrize('x', [2.58e-3, 3.7e-4, 1e-3, 0.731, 42.1, 9.999e-3,
                               0.01, -2.5e-5, 12345.6, 7.0e-11])
def test_one_number_format_keeps_three_significant_digits(x):
  from prolip_jax.evaluation.report import number
  text = number(x)
  # Reads back as the value to three significant digits, and small values
  # are scientific with an unpadded exponent (2.58e-3, never 0.00258 or
  # 2.58e-03).
  assert float(text) == pytest.approx(float(f'{x:.3g}'), rel=1e-12)
  if abs(x) < 0.01:
    mantissa, exponent = text.split('e')
    assert len(mantissa.lstrip('-').replace('.', '')) == 3
    assert not exponent.lstrip('-').startswith('0')
  else:
    assert 'e' not in text or abs(x) >= 1e4


def test_one_number_format_passes_a_skipped_steps_values_through():
  from prolip_jax.evaluation.report import number
  assert [number(x) for x in (float('nan'), float('inf'), -float('inf'),
                              None)] == ['nan', 'inf', '-inf', 'n/a']
