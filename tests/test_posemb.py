"""The image position embeddings at another resolution (models/posemb.py).

References are independent implementations of the same bilinear resize:
PyTorch's ``F.interpolate(mode='bilinear', antialias=False)`` (both
``align_corners``), ``scipy.ndimage.zoom(order=1)`` as big_vision's
``resample_posemb`` calls it (and with ``grid_mode=True`` for the
half-pixel convention), and ``jax.image.scale_and_translate`` /
``jax.image.resize`` without anti-aliasing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import ndimage

from prolip_jax.models import ModelConfig
from prolip_jax.models import init_params
from prolip_jax.models import posemb
from prolip_jax.models import ProLIP
from prolip_jax.models import TextConfig
from prolip_jax.models import VisionConfig

WIDTH = 8
# (old grid, new grid): up, down, a non-integer factor, rectangular, 1x1.
GRIDS = [((14, 14), (16, 16)), ((14, 14), (24, 24)), ((16, 16), (14, 14)),
         ((24, 24), (14, 14)), ((2, 2), (3, 3)), ((4, 6), (7, 3)),
         ((3, 3), (1, 1)), ((1, 1), (3, 3))]


def _posemb(grid, n_special, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n_special + grid[0] * grid[1], WIDTH)).astype(
      np.float32)


def _torch_grid(x, new, align_corners):
  torch = pytest.importorskip('torch')
  t = torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1)[None]
  out = torch.nn.functional.interpolate(
      t, size=tuple(new), mode='bilinear', align_corners=align_corners,
      antialias=False)
  return out[0].permute(1, 2, 0).numpy()


def _scipy_grid(x, new, align_corners):
  zoom = (new[0] / x.shape[0], new[1] / x.shape[1], 1)
  if align_corners:  # big_vision's call
    return ndimage.zoom(x.astype(np.float64), zoom, order=1)
  return ndimage.zoom(x.astype(np.float64), zoom, order=1, grid_mode=True,
                      mode='nearest')


def _jax_grid(x, new, align_corners):
  shape = (new[0], new[1], x.shape[2])
  x = jnp.asarray(x, jnp.float32)
  if not align_corners:
    return np.asarray(jax.image.resize(x, shape, 'bilinear',
                                       antialias=False))
  # Corners aligned: output i samples input i * (n - 1) / (m - 1).
  scale = [(m - 1) / (n - 1) if n > 1 and m > 1 else 1.0
           for n, m in zip(x.shape[:2], new)]
  if 1 in new or 1 in x.shape[:2]:
    pytest.skip('a 1-wide grid has no corner-aligned scale')
  scale = jnp.asarray(scale + [1.0], jnp.float32)
  return np.asarray(jax.image.scale_and_translate(
      x, shape, (0, 1, 2), scale, 0.5 - 0.5 * scale, 'linear',
      antialias=False))


@pytest.mark.parametrize('align_corners', [True, False])
@pytest.mark.parametrize('old,new', GRIDS)
@pytest.mark.parametrize('reference', [
    pytest.param('torch', marks=pytest.mark.torch), 'scipy', 'jax'])
def test_resample_equals_independent_bilinear(old, new, align_corners,
                                              reference):
  """The patch rows equal each reference (float32 rounding), the special
  rows are the input's bit for bit, the shape is the new grid's."""
  n_special = 2
  x = _posemb(old, n_special)
  out = posemb.resample_patch_posemb(x, old, new, n_special, align_corners)
  assert out.shape == (n_special + new[0] * new[1], WIDTH)
  assert out.dtype == np.float32
  np.testing.assert_array_equal(out[:n_special], x[:n_special])
  grid = x[n_special:].reshape(old[0], old[1], WIDTH)
  fn = {'torch': _torch_grid, 'scipy': _scipy_grid,
        'jax': _jax_grid}[reference]
  ref = fn(grid, new, align_corners)
  assert ref.shape[:2] == tuple(new)
  np.testing.assert_allclose(out[n_special:], ref.reshape(-1, WIDTH),
                             atol=1e-5, rtol=0)


def test_default_is_big_vision_corner_aligned_and_differs_from_half_pixel():
  """The default (align_corners=True) is scipy.ndimage.zoom(order=1) as
  big_vision calls it; the half-pixel convention gives other values."""
  x = _posemb((14, 14), 1, seed=3)
  out = posemb.resample_patch_posemb(x, (14, 14), (16, 16), 1)
  ref = ndimage.zoom(x[1:].reshape(14, 14, WIDTH).astype(np.float64),
                     (16 / 14, 16 / 14, 1), order=1)
  np.testing.assert_allclose(out[1:], ref.reshape(-1, WIDTH), atol=1e-5)
  half = posemb.resample_patch_posemb(x, (14, 14), (16, 16), 1,
                                      align_corners=False)
  assert np.abs(half - out).max() > 0.05
  # Corner patches are kept exactly in the corner-aligned convention.
  np.testing.assert_allclose(out[1], x[1], atol=1e-6)
  np.testing.assert_allclose(out[-1], x[-1], atol=1e-6)


def test_equal_grids_are_the_identity_and_bad_shapes_are_refused():
  x = _posemb((3, 3), 2)
  assert posemb.resample_patch_posemb(x, (3, 3), (3, 3), 2) is x
  with pytest.raises(ValueError, match='2 special rows and a 4x4'):
    posemb.resample_patch_posemb(x, (4, 4), (5, 5), 2)
  with pytest.raises(ValueError, match='empty patch grid'):
    posemb.resample_patch_posemb(x, (3, 3), (0, 3), 2)


def _tiny(image_size, use_unc=True, scan=False, patch_size=8):
  return ModelConfig(
      embed_dim=8, use_unc=use_unc, scan=scan,
      vision=VisionConfig(image_size=image_size, patch_size=patch_size,
                          width=16, layers=2, heads=2),
      text=TextConfig(vocab_size=32, context_length=8, width=16, layers=1,
                      heads=2))


@pytest.mark.parametrize('scan', [False, True])
@pytest.mark.parametrize('use_unc', [True, False])
def test_params_tree_resampled_in_place_of_the_posemb_only(scan, use_unc):
  """Only visual/positional_embedding changes (scanned or unrolled blocks:
  it lives outside them); the new tree runs at the new size; the note
  names both grids."""
  old_cfg, new_cfg = _tiny(32, use_unc, scan), _tiny(48, use_unc, scan)
  params = jax.tree.map(np.asarray, init_params(old_cfg,
                                                jax.random.PRNGKey(0)))
  new, note = posemb.resample_image_posemb(params, old_cfg, new_cfg)
  assert note == ('resampled the image position embeddings from 4x4 to '
                  '6x6 patches (bilinear)')
  want = jax.tree.map(np.shape, jax.eval_shape(
      lambda rng: init_params(new_cfg, rng), jax.random.PRNGKey(1)))
  assert jax.tree.map(np.shape, new) == want
  n_special = 2 if use_unc else 1
  np.testing.assert_array_equal(
      new['visual']['positional_embedding'],
      posemb.resample_patch_posemb(params['visual']['positional_embedding'],
                                   (4, 4), (6, 6), n_special))
  flat_old = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, leaf in jax.tree_util.tree_flatten_with_path(new)[0]:
    if jax.tree_util.keystr(path) != "['visual']['positional_embedding']":
      assert leaf is flat_old[path]
  mu, _ = ProLIP(new_cfg).apply({'params': new},
                                jnp.zeros((2, 48, 48, 3)),
                                method=ProLIP.encode_image)
  assert mu.shape == (2, 8) and np.isfinite(np.asarray(mu)).all()


def test_same_grid_no_note_and_other_changes_refused():
  cfg = _tiny(32)
  params = jax.tree.map(np.asarray, init_params(cfg, jax.random.PRNGKey(0)))
  same, note = posemb.resample_image_posemb(
      params, cfg, dataclasses.replace(cfg, compute_dtype='bfloat16'))
  assert note is None and same['visual'] is params['visual']
  with pytest.raises(ValueError, match='patch size 8 -> 16'):
    posemb.resample_image_posemb(params, cfg, _tiny(64, patch_size=16))
