"""The uncertainty toolkit: what the learned sigma^2 says (paper 4.3, C.4-C.6).

Every embedding is a diagonal Gaussian ``(mu, logvar)``; its uncertainty is
``sigma^2 = tr(Sigma) = sum_d exp(logvar_d)`` (paper 4.3, written sigma_v^2 for
images and sigma_t^2 for texts). Functions here are pure NumPy/JAX on
embeddings, so they work on any model's output:

* ``sigma2``, ``spearman``: the per-sample uncertainty and the rank
  correlation used for sigma_t^2 vs caption length (Fig. 6).
* ``hierarchy_order``: the C.6 metric (eq. C.1), the fraction of adjacent
  hierarchy levels whose sigma^2 decreases from general to specific, plus the
  level-vs-level matrix of Fig. C.4.
* ``inclusion_test``: H(original ⊂ partial view) per sample and the fraction
  that is positive (Fig. 8).
* ``extremes``: indices of the most and least uncertain samples (Fig. 4).
* partial views: ``occlude_center`` (zeroed centre square),
  ``keep_indices_for`` (token drop through the model's ``keep_indices``) and
  ``mask_tokens`` (text tokens replaced by [MASK]).
* changes of drawing style: ``restyle`` (blur, line weight, hue), for the
  check that an image drawn another way does not look more certain.
* figures (``fig_*``): matplotlib figures (Agg backend) for the report; the
  caller saves them with ``save_figure``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from prolip_jax import errors
from prolip_jax import plotting
from prolip_jax.evaluation.report import number
from prolip_jax.losses import inclusion_hypothesis


# ---------------------------------------------------------------------------
# Metrics.


def sigma2(logvar) -> np.ndarray:
  """``tr(Sigma) = sum_d exp(logvar_d)``: ``(..., d)`` -> ``(...)`` float64."""
  return np.exp(np.asarray(logvar, np.float64)).sum(-1)


def rankdata(x) -> np.ndarray:
  """Ranks 1..n with ties given their average rank (as ``scipy``'s default)."""
  x = np.asarray(x, np.float64)
  order = np.argsort(x, kind='mergesort')
  xs = x[order]
  ranks = np.empty(len(x), np.float64)
  # Boundaries of runs of equal values in the sorted array.
  starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
  ends = np.r_[starts[1:], len(x)]
  for s, e in zip(starts, ends):
    ranks[order[s:e]] = 0.5 * (s + e - 1) + 1.0
  return ranks


def spearman(x, y) -> float:
  """Spearman rank correlation: Pearson correlation of average ranks.

  NaN when either input is constant (no ranking to correlate).
  """
  rx, ry = rankdata(x), rankdata(y)
  if len(rx) != len(ry):
    raise ValueError(f'lengths differ: {len(rx)} vs {len(ry)}')
  rx, ry = rx - rx.mean(), ry - ry.mean()
  denom = np.sqrt((rx**2).sum() * (ry**2).sum())
  return float((rx * ry).sum() / denom) if denom > 0 else float('nan')


def hierarchy_order(sig2_levels) -> dict:
  """How consistently sigma^2 decreases from general to specific (C.6).

  Args:
    sig2_levels: ``(n, L)`` sigma^2 of each sample's L hierarchy levels,
      column 0 the most general.

  Returns:
    ``adjacent_decreasing``: eq. C.1, the fraction of the ``n * (L - 1)``
    adjacent pairs (level i, level i+1) with sigma^2_i > sigma^2_{i+1};
    ``adjacent_by_level``: the same per adjacent pair of levels (L - 1);
    ``pairwise``: ``(L, L)`` matrix, entry (i, j) the fraction of samples with
    sigma^2_i > sigma^2_j (Fig. C.4); ``mean_by_level``: mean sigma^2 per
    level; ``chain_decreasing``: fraction of samples whose sigma^2 decreases
    strictly along all L levels; ``spearman_level``: Spearman correlation of
    the level index (0 = most general) with sigma^2 over all ``n * L``
    values (negative when specific captions are more certain).
  """
  s = np.asarray(sig2_levels, np.float64)
  if s.ndim != 2 or s.shape[1] < 2:
    raise ValueError(f'need (n, L >= 2) values, got shape {s.shape}')
  dec = s[:, :-1] > s[:, 1:]
  pairwise = (s[:, :, None] > s[:, None, :]).mean(0)
  level = np.broadcast_to(np.arange(s.shape[1]), s.shape)
  return {
      'adjacent_decreasing': float(dec.mean()),
      'adjacent_by_level': dec.mean(0).tolist(),
      'pairwise': pairwise.tolist(),
      'mean_by_level': s.mean(0).tolist(),
      'chain_decreasing': float(dec.all(1).mean()),
      'spearman_level': spearman(level.ravel(), s.ravel()),
  }


def inclusion_test(orig: tuple, view: tuple, eps: float = 0.0) -> dict:
  """H(orig ⊂ view) (eq. 4) for row-aligned pairs and its positive fraction.

  A partial view (masked text, occluded image) should be more uncertain and
  cover the original: H(orig ⊂ view) > 0. H is antisymmetric, so
  H(view ⊂ orig) is its negation.

  Args:
    orig, view: ``(mu, logvar)`` pairs, each ``(n, d)``.
    eps: stability exponent of eq. 3 (0: the plain measure).

  Returns:
    ``h``: ``(n,)`` float64 values; ``positive_fraction``; ``sigma2_orig``,
    ``sigma2_view``: mean sigma^2 of both; ``view_more_uncertain``: fraction
    with sigma^2(view) > sigma^2(orig).
  """
  h = np.asarray(inclusion_hypothesis(orig[0], orig[1], view[0], view[1],
                                      eps=eps), np.float64)
  s_o, s_v = sigma2(orig[1]), sigma2(view[1])
  return {'h': h, 'positive_fraction': float((h > 0).mean()),
          'sigma2_orig': float(s_o.mean()), 'sigma2_view': float(s_v.mean()),
          'view_more_uncertain': float((s_v > s_o).mean())}


def extremes(values, k: int) -> tuple[np.ndarray, np.ndarray]:
  """``(most, least)``: indices of the k largest (descending) and k smallest
  (ascending) values; ties keep input order."""
  values = np.asarray(values)
  order = np.argsort(values, kind='stable')
  k = min(k, len(values))
  return order[::-1][:k] if k else order[:0], order[:k]


def summary_stats(x) -> dict:
  x = np.asarray(x, np.float64)
  return {'mean': float(x.mean()), 'median': float(np.median(x)),
          'min': float(x.min()), 'max': float(x.max()),
          'std': float(x.std())}


# ---------------------------------------------------------------------------
# Partial views.


def occlude_center(images: np.ndarray, fraction: float, value: int = 0
                   ) -> np.ndarray:
  """Sets a centred square covering ``fraction`` of each image's area to
  ``value`` (paper C.8 "center occlusion"). ``images``: ``(n, h, w, c)``."""
  images = np.array(images, copy=True)
  if not 0 <= fraction <= 1:
    raise ValueError(f'fraction must be in [0, 1], got {fraction}')
  h, w = images.shape[1:3]
  sh = int(round(h * np.sqrt(fraction)))
  sw = int(round(w * np.sqrt(fraction)))
  top, left = (h - sh) // 2, (w - sw) // 2
  images[:, top:top + sh, left:left + sw] = value
  return images


STYLE_KINDS = ('blur', 'thicken', 'hue')


def kind_and_value(spec: str) -> tuple[str, float]:
  """``'blur:1.5'`` -> ``('blur', 1.5)``, the value NaN where it is not a
  number; the callers check both and name the spec in their error."""
  kind, _, val = spec.partition(':')
  try:
    return kind, float(val)
  except ValueError:
    return kind, float('nan')


def parse_style(spec: str) -> tuple[str, float]:
  """``'blur:1.5'`` -> ``('blur', 1.5)``; a bad spec raises ``ConfigError``
  naming it (see ``restyle``)."""
  kind, v = kind_and_value(spec)
  if kind not in STYLE_KINDS or not np.isfinite(v) or v < 0 or (
      kind == 'thicken' and (v != int(v) or int(v) % 2 == 0)):
    raise errors.ConfigError(
        f"style view must be 'blur:SIGMA', 'thicken:ODD_SIZE' or "
        f"'hue:FRACTION', got {spec!r}")
  return kind, v


def restyle(images: np.ndarray, spec: str) -> np.ndarray:
  """The same pictures drawn in another style, content kept.

  ``spec``: ``'blur:R'`` (Gaussian blur of standard deviation R pixels),
  ``'thicken:K'`` (every stroke spread by a K x K rank filter: the darkest
  value in the window on a light background, the lightest on a dark one,
  the background read from the image border) or ``'hue:F'`` (hue rotated by
  the fraction F of the colour circle; grey pixels stay grey).
  ``images``: ``(n, h, w, 3)`` uint8 -> the same shape and dtype.
  """
  from PIL import Image, ImageFilter  # pylint: disable=g-import-not-at-top
  kind, v = parse_style(spec)
  images = np.asarray(images)
  if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
    raise ValueError(f'restyle needs (n, h, w, 3) uint8 images, got '
                     f'{images.shape} {images.dtype}')
  out = np.empty_like(images)
  for i, im in enumerate(images):
    pil = Image.fromarray(im)
    if kind == 'blur':
      pil = pil.filter(ImageFilter.GaussianBlur(v))
    elif kind == 'thicken':
      border = np.concatenate([im[0], im[-1], im[:, 0], im[:, -1]])
      light = border.mean() > 127
      size = int(v)
      pil = pil.filter(ImageFilter.MinFilter(size) if light
                       else ImageFilter.MaxFilter(size))
    else:
      hsv = np.array(pil.convert('HSV'))
      hsv[..., 0] = (hsv[..., 0].astype(np.int32) + int(round(v * 256))) % 256
      pil = Image.fromarray(hsv, 'HSV').convert('RGB')
    out[i] = np.asarray(pil)
  return out


def keep_indices_for(n: int, num_patches: int, keep_ratio: float,
                     seed: int = 0) -> np.ndarray:
  """``(n, n_keep)`` sorted random patch indices for token drop (as in
  training's ``masking.random_keep_indices``), deterministic in ``seed``."""
  n_keep = max(1, int(round(num_patches * keep_ratio)))
  rng = np.random.default_rng(seed)
  keep = np.argsort(rng.random((n, num_patches)), axis=1)[:, :n_keep]
  return np.sort(keep, axis=1).astype(np.int32)


def mask_tokens(tokens: np.ndarray, prob: float, mask_id: int, pad_id: int,
                seed: int = 0, eos_id: Optional[int] = None,
                at_least_one: bool = True) -> np.ndarray:
  """Replaces each real token (not pad, not EOS) by ``mask_id`` with
  probability ``prob``; ``at_least_one`` masks one token of every caption
  that drew none, so every masked caption differs from its original."""
  tokens = np.array(tokens, copy=True)
  rng = np.random.default_rng(seed)
  real = tokens != pad_id
  if eos_id is not None and eos_id >= 0:
    real &= tokens != eos_id
  replace = (rng.random(tokens.shape) < prob) & real
  if at_least_one:
    for i in np.flatnonzero(~replace.any(1) & real.any(1)):
      replace[i, rng.choice(np.flatnonzero(real[i]))] = True
  tokens[replace] = mask_id
  return tokens


def num_tokens(tokens: np.ndarray, pad_id: int) -> np.ndarray:
  """Caption length in tokens (everything but padding, EOS included)."""
  return (np.asarray(tokens) != pad_id).sum(1)


# ---------------------------------------------------------------------------
# Figures. Each ``fig_*`` returns a matplotlib Figure with a known number of
# axes (documented), drawn with the Agg backend.


def _log_bins(*arrays, n=40):
  vals = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
  vals = vals[vals > 0]
  lo, hi = vals.min(), vals.max()
  if hi <= lo:
    hi = lo * 1.01
  return np.geomspace(lo / 1.05, hi * 1.05, n)


@plotting.styled
def fig_sigma2_hist(sig2_img, sig2_txt, title: str = ''):
  """Fig. 5: histograms of sigma^2 for images and texts (1 axis, log x)."""
  plt = plotting.pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.6))
  bins = _log_bins(sig2_img, sig2_txt)
  ax.hist(sig2_img, bins=bins, alpha=0.6, label=f'images (n={len(sig2_img)})',
          color='tab:blue', density=True)
  ax.hist(sig2_txt, bins=bins, alpha=0.6, label=f'texts (n={len(sig2_txt)})',
          color='tab:orange', density=True)
  ax.set_xlim(bins[0], bins[-1])
  plotting.log_axis(ax, 'x')
  ax.set_xlabel(r'$\sigma^2 = \mathrm{tr}(\Sigma)$')
  ax.set_ylabel('density')
  ax.set_title(title or r'$\sigma_v^2$ of images vs $\sigma_t^2$ of texts')
  ax.legend()
  return fig


@plotting.styled
def fig_sigma2_vs_length(lengths, sig2_txt, rho: float):
  """Fig. 6: sigma_t^2 against caption length in tokens (1 axis): every
  caption as a point, the median per length as a line."""
  plt = plotting.pyplot()
  lengths = np.asarray(lengths)
  sig2_txt = np.asarray(sig2_txt)
  fig, ax = plt.subplots(figsize=(6, 3.6))
  jitter = np.random.default_rng(0).uniform(-0.2, 0.2, len(lengths))
  ax.scatter(lengths + jitter, sig2_txt, s=6, alpha=0.4, color='tab:orange',
             label='captions')
  uniq = np.unique(lengths)
  med = [np.median(sig2_txt[lengths == u]) for u in uniq]
  ax.plot(uniq, med, color='black', marker='o', ms=3, label='median')
  plotting.log_axis(ax, 'y')
  ax.set_xlabel('caption length (tokens)')
  ax.set_ylabel(r'$\sigma_t^2$')
  ax.set_title(rf'$\sigma_t^2$ vs length (Spearman $\rho$ = {rho:.3f})')
  ax.legend()
  return fig


@plotting.styled
def fig_sigma2_by_level(sig2_levels, level_names: Sequence[str],
                        pairwise: Optional[np.ndarray] = None):
  """Fig. 7 (+ C.4): sigma_t^2 per hierarchy level as box plots (axis 1) and
  the level-vs-level fraction matrix (axis 2 and its colour bar: 3 axes when
  ``pairwise`` is given, else 1). Level i is labelled ``Li`` with its name
  from ``level_names`` under it."""
  plt = plotting.pyplot()
  s = np.asarray(sig2_levels)
  L = s.shape[1]
  ncols = 2 if pairwise is not None else 1
  fig, axes = plt.subplots(1, ncols, figsize=(4.6 * ncols, 4.0),
                           squeeze=False,
                           width_ratios=[1.25, 1][:ncols])
  ax = axes[0, 0]
  ax.boxplot([s[:, i] for i in range(L)], showfliers=False)
  plotting.log_axis(ax, 'y')
  ax.set_xticks(range(1, L + 1))
  ax.set_xticklabels([f'L{i}\n{_wrap(n, 12)}'
                      for i, n in enumerate(level_names)])
  ax.set_xlabel('hierarchy level (L0 = most general)')
  ax.set_ylabel(r'$\sigma_t^2$')
  ax.set_title(r'$\sigma_t^2$ by caption level')
  if pairwise is not None:
    ax2 = axes[0, 1]
    im = ax2.imshow(np.asarray(pairwise), vmin=0, vmax=1, cmap='viridis')
    for i in range(L):
      for j in range(L):
        if i != j:
          ax2.text(j, i, f'{pairwise[i][j]:.2f}', ha='center', va='center',
                   color='white' if pairwise[i][j] < 0.6 else 'black',
                   fontsize=plotting.SMALLEST_FONT_PT)
    ax2.set_xticks(range(L))
    ax2.set_yticks(range(L))
    ax2.set_xticklabels([f'L{i}' for i in range(L)])
    ax2.set_yticklabels([f'L{i}' for i in range(L)])
    ax2.set_xlabel('column level')
    ax2.set_ylabel('row level')
    ax2.set_title(r'P($\sigma^2_{row} > \sigma^2_{col}$)')
    fig.colorbar(im, ax=ax2, fraction=0.046)
  return fig


def _wrap(text: str, width: int) -> str:
  import textwrap  # pylint: disable=g-import-not-at-top
  return '\n'.join(textwrap.wrap(str(text), width)) or str(text)


@plotting.styled
def fig_inclusion_hist(tests: dict[str, dict], eps: float = 0.0):
  """Fig. 8: histograms of H(orig ⊂ view), one axis per view in ``tests``
  (name -> ``inclusion_test`` output); positive = the view includes the
  original. Values are sign-preserving log-scaled: sign(H) log10(1 + |H|)."""
  plt = plotting.pyplot()
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  n = len(tests)
  ncols = min(n, 3)
  nrows = -(-n // ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(3.3 * ncols, 2.9 * nrows),
                           squeeze=False)
  for ax, (name, t) in zip(axes.ravel(), tests.items()):
    h = np.asarray(t['h'])
    v = np.sign(h) * np.log10(1.0 + np.abs(h))
    lim = max(np.abs(v).max(), 1e-3) * 1.05
    bins = np.linspace(-lim, lim, 41)
    ax.hist(v[h > 0], bins=bins, color='tab:purple', alpha=0.8,
            label=f'H>0: {t["positive_fraction"]:.1%}')
    ax.hist(v[h <= 0], bins=bins, color='tab:gray', alpha=0.8, label='H≤0')
    ax.axvline(0, color='black', lw=0.8)
    ax.set_title(_wrap(f'H(orig ⊂ {name})', 34))
    ax.set_xlabel(r'sign(H) $\log_{10}$(1+|H|)' + (f', eps={eps:g}'
                                                    if eps else ''))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(5))
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom for the legend
    ax.legend(loc='upper center', ncols=2, columnspacing=1.0,
              handlelength=1.2)
  for ax in axes.ravel()[n:]:
    fig.delaxes(ax)
  return fig


@plotting.styled
def fig_extreme_images(images, sig2, most, least):
  """Fig. 4 (images): the most (top row) and least (bottom row) uncertain
  images with their sigma_v^2 (``2 * k`` axes, k = len(most))."""
  plt = plotting.pyplot()
  k = max(len(most), len(least))
  fig, axes = plt.subplots(2, k, figsize=(1.05 * k + 0.6, 3.0),
                           squeeze=False)
  fig.get_layout_engine().set(h_pad=0.08, hspace=0.08)
  for row, (idx, label) in enumerate(((most, 'most'), (least, 'least'))):
    for col in range(k):
      ax = axes[row, col]
      ax.set_xticks([])
      ax.set_yticks([])
      if col < len(idx):
        img = np.asarray(images[idx[col]])
        ax.imshow(img, cmap='gray' if img.ndim == 2 else None)
        ax.set_title(number(sig2[idx[col]]),
                     fontsize=plotting.SMALLEST_FONT_PT)
      if col == 0:
        ax.set_ylabel(f'{label}\nuncertain')
  fig.suptitle(r'held-out images by $\sigma_v^2$ (value above each image)')
  return fig


def save_figure(fig, path: str, dpi: int = plotting.DPI) -> str:
  """Writes ``fig`` as a PNG at ``dpi`` (``plotting.save``) and closes it;
  returns the path."""
  return plotting.save(fig, path, dpi)
