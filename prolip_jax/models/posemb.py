"""The image tower's position embeddings at another resolution.

A ViT's ``positional_embedding`` holds one row per token: the special
tokens' rows first ([CLS], then [UNC] when ``use_unc``; the same layout with
``release_compat``), then one row per patch of the ``(gh, gw)`` grid in
row-major order. Another image size (same patch size) is another grid; the
patch rows are resampled as an image of ``width`` channels, the special rows
kept as they are: big_vision's ``resample_posemb`` ("high-res
fine-tuning"), which zooms the grid with ``scipy.ndimage.zoom(order=1)``.

The convention is big_vision's: bilinear with the corner patches of both
grids aligned (``scipy.ndimage.zoom``'s default ``grid_mode=False``,
``torch.nn.functional.interpolate(mode='bilinear', align_corners=True)``)
and no anti-aliasing when the grid shrinks. ``align_corners=False`` gives
the half-pixel convention (torch's ``align_corners=False``, and
``jax.image.resize(..., 'bilinear', antialias=False)``) instead.
Computed in float64 with numpy, returned in the input's dtype.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from prolip_jax.models.prolip import ModelConfig

# The image tower's parameter the grid lives in (params['visual'][...]).
TOWER = 'visual'
PARAM = 'positional_embedding'


def patch_grid(config: ModelConfig) -> tuple[int, int]:
  """``(gh, gw)``: the patch grid of ``config``'s square images."""
  n = config.vision.image_size // config.vision.patch_size
  return n, n


def n_special(config: ModelConfig) -> int:
  """Rows before the patch rows: [CLS] and, with ``use_unc``, [UNC]."""
  return 2 if config.use_unc else 1


def _interp_matrix(n_in: int, n_out: int, align_corners: bool) -> np.ndarray:
  """``(n_out, n_in)`` float64 weights of 1-D linear interpolation.

  Output sample ``i`` reads the input at ``i * (n_in - 1) / (n_out - 1)``
  (``align_corners``; 0 when ``n_out == 1``) or at ``(i + 0.5) * n_in /
  n_out - 0.5`` clamped to ``[0, n_in - 1]``, between its two neighbours.
  """
  i = np.arange(n_out, dtype=np.float64)
  if align_corners:
    src = i * ((n_in - 1) / (n_out - 1)) if n_out > 1 else np.zeros(n_out)
  else:
    src = (i + 0.5) * (n_in / n_out) - 0.5
  src = np.clip(src, 0.0, n_in - 1)
  lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
  hi = np.minimum(lo + 1, n_in - 1)
  frac = src - lo
  m = np.zeros((n_out, n_in), np.float64)
  np.add.at(m, (np.arange(n_out), lo), 1.0 - frac)
  np.add.at(m, (np.arange(n_out), hi), frac)
  return m


def resample_patch_posemb(posemb: Any, old_grid: tuple[int, int],
                          new_grid: tuple[int, int], num_special: int,
                          align_corners: bool = True) -> np.ndarray:
  """Position embeddings of an ``old_grid`` ViT for a ``new_grid`` one.

  Args:
    posemb: ``(num_special + gh * gw, width)``: the special tokens' rows,
      then the patches' in row-major ``(gh, gw)`` order.
    old_grid: ``(gh, gw)`` patches of ``posemb``.
    new_grid: ``(nh, nw)`` patches wanted.
    num_special: rows before the patch rows (kept unchanged).
    align_corners: big_vision's convention (True, see the module
      docstring) or the half-pixel one (False).
  Returns:
    ``(num_special + nh * nw, width)`` numpy array in ``posemb``'s dtype:
    the special rows as given, the ``(gh, gw, width)`` grid resized
    bilinearly (separably, without anti-aliasing) to ``(nh, nw, width)``.
    ``posemb`` itself (as numpy) when the grids are equal.
  Raises:
    ValueError: ``posemb`` has not ``num_special + gh * gw`` rows, or a
      grid is empty.
  """
  posemb = np.asarray(posemb)
  (gh, gw), (nh, nw) = tuple(old_grid), tuple(new_grid)
  if min(gh, gw, nh, nw) < 1:
    raise ValueError(f'empty patch grid: {old_grid} -> {new_grid}')
  if posemb.ndim != 2 or posemb.shape[0] != num_special + gh * gw:
    raise ValueError(
        f'position embeddings of shape {posemb.shape} are not '
        f'{num_special} special rows and a {gh}x{gw} patch grid')
  if (gh, gw) == (nh, nw):
    return posemb
  grid = posemb[num_special:].astype(np.float64).reshape(gh, gw, -1)
  rows = _interp_matrix(gh, nh, align_corners)
  cols = _interp_matrix(gw, nw, align_corners)
  grid = np.einsum('ah,bw,hwc->abc', rows, cols, grid)
  out = np.concatenate([posemb[:num_special].astype(np.float64),
                        grid.reshape(nh * nw, -1)])
  return out.astype(posemb.dtype)


def resample_image_posemb(params: Mapping[str, Any], stored: ModelConfig,
                          target: ModelConfig
                          ) -> tuple[dict[str, Any], Optional[str]]:
  """``params`` of the model ``stored`` made to fit ``target``'s patch grid.

  Only ``params['visual']['positional_embedding']`` changes (it lives
  outside the transformer's blocks, so scanned and unrolled towers are
  alike); the other arrays are shared, not copied.

  Args:
    params: the parameter tree (nested mappings) of a ``stored`` model.
    stored: the model config ``params`` were made for.
    target: the same model at another ``vision.image_size``.
  Returns:
    ``(params, note)``: a new tree with the resampled ``(n_special + nh *
    nw, width)`` embeddings and the one-line note saying so, or
    ``(params, None)`` when the grids are equal.
  Raises:
    ValueError: the two configs differ in patch size or in the special
      tokens (not a resolution change), or the embeddings do not fit
      ``stored``.
  """
  if (stored.vision.patch_size != target.vision.patch_size
      or stored.use_unc != target.use_unc):
    raise ValueError(
        'only the image size may differ when the position embeddings are '
        f'resampled: patch size {stored.vision.patch_size} -> '
        f'{target.vision.patch_size}, use_unc {stored.use_unc} -> '
        f'{target.use_unc}')
  old, new = patch_grid(stored), patch_grid(target)
  if old == new:
    return dict(params), None
  visual = dict(params[TOWER])
  visual[PARAM] = resample_patch_posemb(visual[PARAM], old, new,
                                        n_special(stored))
  note = (f'resampled the image position embeddings from {old[0]}x{old[1]} '
          f'to {new[0]}x{new[1]} patches (bilinear)')
  return dict(params, **{TOWER: visual}), note
