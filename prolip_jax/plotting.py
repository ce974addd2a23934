"""The look of every figure the library draws, set in one place.

Figures are drawn with matplotlib's Agg backend (no display needed) inside
``style()``, whose rc settings give at least 8 pt text at the saved size
(``DPI``; the docs show the PNGs at that size) and constrained layout, so
labels of neighbouring axes do not overlap. ``log_axis`` puts a log axis with
at least four labelled ticks, whatever its range. ``save`` writes the PNG.

matplotlib is a runtime dependency of the figures only: importing this
module does not import it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterator

import numpy as np

# Saved resolution: a 6-inch-wide figure is 600 px, 1 pt = DPI / 72 px.
DPI = 100

# Sizes in points at DPI; the smallest text (ticks, legends, in-cell
# annotations) is 9 pt.
STYLE = {
    'font.size': 10,
    'axes.titlesize': 11,
    'axes.labelsize': 10,
    'xtick.labelsize': 9,
    'ytick.labelsize': 9,
    'legend.fontsize': 9,
    'legend.title_fontsize': 9,
    'figure.titlesize': 11,
    'figure.constrained_layout.use': True,
    # Room between neighbouring axes' tick labels (default 3 pt).
    'figure.constrained_layout.w_pad': 6 / 72,
    'figure.constrained_layout.h_pad': 6 / 72,
    'savefig.dpi': DPI,
}

SMALLEST_FONT_PT = 9


def pyplot():
  """``matplotlib.pyplot`` on the Agg backend (imported on first use)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg', force=False)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


@contextlib.contextmanager
def style() -> Iterator[None]:
  """rc settings of ``STYLE`` for the figures created inside (text sizes
  are fixed when a text is made, so figures must be built, not only saved,
  inside)."""
  with pyplot().rc_context(STYLE):
    yield


def styled(fn: Callable) -> Callable:
  """Decorator: builds ``fn``'s figure inside ``style()``."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    with style():
      return fn(*args, **kwargs)

  return wrapper


# Tick positions within a decade, coarse to fine; ``log_axis`` takes the
# first that labels at least ``min_labels`` ticks in view.
_SUBS = (
    (1.0,),
    (1.0, 3.0),
    (1.0, 2.0, 5.0),
    (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0),
    tuple(np.arange(1.0, 10.0, 0.5)),
    tuple(np.arange(1.0, 10.0, 0.2)),
    tuple(np.arange(1.0, 10.0, 0.1)),
)


def _label(value: float, _pos=None, digits: int = 3) -> str:
  """Tick text: at most ``digits`` significant digits, no trailing zeros."""
  if value == 0:
    return '0'
  exponent = int(np.floor(np.log10(abs(value))))
  if -3 <= exponent <= 3:
    return f'{value:.{digits}g}'
  mantissa = value / 10.0**exponent
  m = f'{mantissa:.{max(digits - 1, 1)}g}'
  return (rf'$10^{{{exponent}}}$' if m == '1' else
          rf'${m}\times10^{{{exponent}}}$')


def tick_labels(ticks) -> list[str]:
  """``_label`` of each tick with the fewest significant digits (3 or more)
  that keep neighbouring labels distinct."""
  for digits in range(3, 10):
    labels = [_label(t, digits=digits) for t in ticks]
    if len(set(labels)) == len(labels):
      return labels
  return labels


def log_ticks_in(lo: float, hi: float, min_labels: int = 4,
                 max_labels: int = 8) -> np.ndarray:
  """The labelled tick positions ``log_axis`` uses for a view ``[lo, hi]``
  (``0 < lo < hi``): the coarsest decade subdivision giving at least
  ``min_labels`` ticks, every other one dropped (keeping the rounder half)
  while over ``max_labels``."""
  # Positions computed here rather than by LogLocator, which switches to
  # linear ticks when a sub-decade view holds at most one of its ticks.
  decades = np.arange(np.floor(np.log10(lo)), np.ceil(np.log10(hi)) + 1)
  ticks = np.array([])
  for subs in _SUBS:
    stride = max(1, int(np.ceil(len(decades) / 10))) if len(subs) == 1 else 1
    ticks = np.unique(np.outer(10.0**decades[::stride], subs).ravel())
    ticks = ticks[(ticks >= lo * (1 - 1e-9)) & (ticks <= hi * (1 + 1e-9))]
    if len(ticks) >= min_labels:
      break
  if len(ticks) < min_labels:
    # Under ~10% of a decade the axis is linear to the eye: linear ticks.
    from matplotlib import ticker  # pylint: disable=g-import-not-at-top
    for nbins in range(min_labels, 13):
      ticks = np.asarray(ticker.MaxNLocator(
          nbins=nbins, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi))
      ticks = ticks[(ticks >= lo * (1 - 1e-9)) & (ticks <= hi * (1 + 1e-9))]
      if len(ticks) >= min_labels:
        break
  while len(ticks) > max_labels and len(ticks[::2]) >= min_labels:
    # Of the two halves, the one with the rounder values (shorter labels).
    halves = [h for h in (ticks[::2], ticks[1::2]) if len(h) >= min_labels]
    ticks = min(halves, key=lambda h: sum(len(_label(t)) for t in h))
  return ticks


def log_axis(ax, which: str = 'y', min_labels: int = 4) -> None:
  """Log scale on ``ax``'s ``which`` axis ('x' or 'y') with at least
  ``min_labels`` labelled ticks in the current view (finer subdivisions of
  a decade when the data span less than a few decades), labels like
  ``0.22`` or ``2×10⁻⁵``, unlabelled minor ticks. Call after plotting, when
  the view limits are known."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  axis = ax.yaxis if which == 'y' else ax.xaxis
  (ax.set_yscale if which == 'y' else ax.set_xscale)('log')
  lo, hi = sorted((ax.get_ylim() if which == 'y' else ax.get_xlim()))
  ticks = log_ticks_in(lo, hi, min_labels)
  axis.set_major_locator(ticker.FixedLocator(ticks))
  axis.set_major_formatter(ticker.FixedFormatter(tick_labels(ticks)))
  axis.set_minor_locator(ticker.LogLocator(base=10.0, subs='auto'))
  axis.set_minor_formatter(ticker.NullFormatter())


def mark_log_axes(fig) -> None:
  """Appends ' (log scale)' to the label of every log-scaled axis of
  ``fig`` that does not say so already."""
  for ax in fig.axes:
    for axis, scale in ((ax.xaxis, ax.get_xscale()),
                        (ax.yaxis, ax.get_yscale())):
      label = axis.get_label_text()
      if scale == 'log' and label and 'log' not in label.lower():
        axis.set_label_text(f'{label} (log scale)')


def save(fig, path: str, dpi: int = DPI, source: str | None = None) -> str:
  """Writes ``fig`` as a PNG at ``dpi`` and closes it; returns the path.

  Log axes are marked as such (``mark_log_axes``); ``source`` (the run and
  step, e.g. ``prolip_emoji, step 1500``) is printed small in the bottom
  right corner, so a figure that travels alone still says what it shows.
  """
  plt = pyplot()
  mark_log_axes(fig)
  if source:
    fig.text(0.995, 0.005, source, ha='right', va='bottom',
             fontsize=SMALLEST_FONT_PT, color='0.35')
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=dpi, format='png')
  plt.close(fig)
  return path
