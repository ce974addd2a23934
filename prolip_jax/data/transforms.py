"""Image transforms on the host (numpy + Pillow), run inside Grain workers.

Training views follow the paper's B.1 recipe: random resized crop with scale
(0.8, 1.0), colour jitter (brightness, contrast, saturation, hue) =
(0.32, 0.32, 0.32, 0.08) applied with probability 0.8, random grayscale with
probability 0.2. Each view also returns its augmentation parameters as an
``AUG_DIM``-vector (layout in ``AUG_FIELDS``, declared by the head that
embeds it, ``models/heads.py``) so objectives that condition on them
(UniCLIP) can. Outputs stay uint8; normalisation happens on device.

The crop is resized by ``resized_crop``: Pillow's antialiased bicubic
(``resized_crop_pil``) computed with OpenCV, about 3x faster per view and
within a stated bound of Pillow's pixels (see ``resized_crop``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from PIL import Image
from PIL import ImageEnhance

from prolip_jax.models.heads import AUG_DIM

try:
  import cv2
except ImportError:  # optional speed-up: Pillow resizes every crop then
  cv2 = None
else:
  cv2.setNumThreads(1)  # one Grain worker = one core; no thread pool per view


@dataclasses.dataclass(frozen=True)
class AugmentConfig:
  """Training augmentation of paper B.1 (torchvision's parameter meanings)."""
  crop_scale: tuple[float, float] = (0.8, 1.0)
  crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
  jitter: tuple[float, float, float, float] = (0.32, 0.32, 0.32, 0.08)
  jitter_prob: float = 0.8
  grayscale_prob: float = 0.2
  # Draw the colour jitter and grayscale here but apply them on the
  # accelerator (prolip_jax/data/color.py): same random numbers, same crops.
  color_on_device: bool = False


def identity_aug_vector() -> np.ndarray:
  """The parameter vector of an un-augmented view (full crop, no jitter)."""
  v = np.zeros(AUG_DIM, np.float32)
  v[2:8] = (1.0, 1.0, 1.0, 1.0, 1.0, 0.0)
  return v


def _to_pil(image) -> Image.Image:
  """A PIL image as it is (any mode); an array as an RGB image."""
  if isinstance(image, Image.Image):
    return image
  if image.ndim == 2:
    image = np.repeat(image[..., None], 3, -1)
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, -1)
  return Image.fromarray(np.asarray(image, np.uint8)[..., :3])


def _rgb_array(img: Image.Image) -> np.ndarray:
  """(h, w, 3) uint8; a PIL image in another mode is converted last, as
  open_clip's transform does (``convert('RGB')`` after the crop)."""
  return np.asarray(img if img.mode == 'RGB' else img.convert('RGB'),
                    np.uint8)


def random_resized_crop_box(rng: np.random.Generator, width: int, height: int,
                            scale, ratio) -> tuple[int, int, int, int]:
  """(left, top, w, h) as torchvision's RandomResizedCrop draws it."""
  area = width * height
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target = area * rng.uniform(*scale)
    aspect = math.exp(rng.uniform(*log_ratio))
    w = int(round(math.sqrt(target * aspect)))
    h = int(round(math.sqrt(target / aspect)))
    if 0 < w <= width and 0 < h <= height:
      return int(rng.integers(0, width - w + 1)), int(
          rng.integers(0, height - h + 1)), w, h
  # Fallback: central crop clamped to the ratio range.
  in_ratio = width / height
  if in_ratio < ratio[0]:
    w, h = width, int(round(width / ratio[0]))
  elif in_ratio > ratio[1]:
    h, w = height, int(round(height * ratio[1]))
  else:
    w, h = width, height
  return (width - w) // 2, (height - h) // 2, w, h


def resized_crop_pil(image: np.ndarray, box: tuple[int, int, int, int],
                     size: int) -> np.ndarray:
  """The ``(left, top, w, h)`` crop of an ``(H, W, 3)`` uint8 image resized
  to ``(size, size, 3)`` by Pillow's bicubic (antialiased when shrinking:
  the cubic kernel is stretched by the scale factor): the reference."""
  left, top, w, h = box
  img = Image.fromarray(image).resize((size, size), Image.BICUBIC,
                                      box=(left, top, left + w, top + h))
  return np.asarray(img, np.uint8)


def _pil_cubic(x: np.ndarray) -> np.ndarray:
  """Pillow's bicubic kernel (Keys, a = -0.5) at ``x``."""
  a, x = -0.5, np.abs(x)
  return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                  np.where(x < 2, ((x - 5) * x + 8) * x * a - 4 * a, 0.0))


@functools.lru_cache(maxsize=4096)
def _prefilter(crop_side: int, size: int) -> np.ndarray:
  """The 1-D antialiasing kernel for shrinking ``crop_side`` pixels to
  ``size``: Pillow's cubic kernel stretched by the factor, sampled at whole
  pixels and normalised to sum 1, ``(2r + 1,)`` float32."""
  factor = crop_side / size
  r = int(math.ceil(2 * factor)) - 1
  k = _pil_cubic(np.arange(-r, r + 1) / factor)
  return (k / k.sum()).astype(np.float32)


def resized_crop(image: np.ndarray, box: tuple[int, int, int, int],
                 size: int) -> np.ndarray:
  """``resized_crop_pil``'s ``(size, size, 3)`` uint8 view, computed faster.

  Pillow shrinks by weighting each output pixel's input pixels with the
  cubic kernel stretched by the scale factor f (antialiasing). Here the
  crop and a margin are filtered once with that stretched kernel sampled at
  whole pixels (``cv2.sepFilter2D``, uint8 in and out, as Pillow rounds
  between its passes) and then sampled at Pillow's output centres by
  OpenCV's bicubic (``cv2.resize``, same pixel-centre convention). The
  pixels differ from Pillow's by the interpolation of the filtered image
  (OpenCV's cubic has a = -0.75, Pillow's -0.5) and the image edges
  (reflected here, renormalised by Pillow): on photos about 0.35 levels of
  255 on average, under 0.75 in every view, 99.9% of pixels within 6
  levels, the rest (hard edges) within 24 (``tests/test_fast_input.py``).
  Crops smaller than ``size`` on a side (enlarged), non-RGB arrays, or no
  OpenCV: Pillow itself.
  """
  w, h = box[2:]
  if (cv2 is None or w < size or h < size or image.dtype != np.uint8 or
      image.ndim != 3 or image.shape[2] != 3):
    return resized_crop_pil(image, box, size)
  return cv2.resize(prefiltered_crop(image, box, size), (size, size),
                    interpolation=cv2.INTER_CUBIC)


def prefiltered_crop(image: np.ndarray, box: tuple[int, int, int, int],
                     size: int) -> np.ndarray:
  """The ``(left, top, w, h)`` crop ``(h, w, 3)`` uint8 of an ``(H, W, 3)``
  uint8 image filtered with Pillow's cubic kernel stretched for shrinking
  it to ``size`` (``_prefilter``; needs OpenCV): ``resized_crop`` samples
  it at Pillow's output centres."""
  left, top, w, h = box
  kx, ky = _prefilter(w, size), _prefilter(h, size)
  height, width = image.shape[:2]
  # The filter reads r pixels past the crop, the cubic 2 filtered ones.
  mx, my = len(kx) // 2 + 2, len(ky) // 2 + 2
  x0, y0 = max(left - mx, 0), max(top - my, 0)
  x1, y1 = min(left + w + mx, width), min(top + h + my, height)
  region = cv2.sepFilter2D(image[y0:y1, x0:x1], -1, kx, ky,
                           borderType=cv2.BORDER_REFLECT_101)
  return region[top - y0:top - y0 + h, left - x0:left - x0 + w]


def _shift_hue(img: Image.Image, shift: float) -> Image.Image:
  h, s, v = img.convert('HSV').split()
  h = np.asarray(h, np.uint8)
  h = ((h.astype(np.int32) + int(round(shift * 255))) % 256).astype(np.uint8)
  return Image.merge('HSV', (Image.fromarray(h), s, v)).convert('RGB')


def train_view(image: np.ndarray, size: int, rng: np.random.Generator,
               cfg: AugmentConfig = AugmentConfig()
               ) -> tuple[np.ndarray, np.ndarray]:
  """One augmented ``(size, size, 3)`` uint8 view and its parameter vector."""
  view, aug, _ = train_view_and_order(image, size, rng, cfg)
  return view, aug


@dataclasses.dataclass(frozen=True)
class ViewDraw:
  """What a training view draws from its RNG, before any pixel: the crop
  box ``(left, top, w, h)``, the ``(AUG_DIM,)`` vector, the ``(4,)`` jitter
  order, whether the view is turned grey and the jitter's factors as drawn
  (float64; none when the view is not jittered)."""
  box: tuple[int, int, int, int]
  aug: np.ndarray
  order: np.ndarray
  gray: bool
  factors: tuple[float, ...] = ()

  @property
  def jitter(self) -> bool:
    """Whether the view is jittered (its factors were drawn)."""
    return bool(self.factors)


def draw_view(rng: np.random.Generator, width: int, height: int,
              cfg: AugmentConfig = AugmentConfig()) -> ViewDraw:
  """The random numbers of one view of a ``width`` x ``height`` image, in
  the order ``train_view_and_order`` has always drawn them (crop box, then
  the jitter's coin, factors and order, then the grayscale coin): the one
  source of the augmentation distribution of the host path and of the DALI
  path (``data/dali_decode.py``), which never sees the pixels."""
  order = np.arange(4, dtype=np.int8)
  aug = identity_aug_vector()
  left, top, w, h = random_resized_crop_box(rng, width, height,
                                            cfg.crop_scale, cfg.crop_ratio)
  aug[0:4] = (left / max(1, width), top / max(1, height), w / max(1, width),
              h / max(1, height))
  factors = ()
  if rng.uniform() < cfg.jitter_prob:
    b, c, s, hue = cfg.jitter
    factors = (rng.uniform(max(0, 1 - b), 1 + b),
               rng.uniform(max(0, 1 - c), 1 + c),
               rng.uniform(max(0, 1 - s), 1 + s), rng.uniform(-hue, hue))
    aug[4:8] = factors
    order = rng.permutation(4).astype(np.int8)  # torchvision: random order
  gray = bool(rng.uniform() < cfg.grayscale_prob)
  if gray:
    aug[10] = 1.0
  return ViewDraw((left, top, w, h), aug, order, gray, factors)


def train_view_and_order(image: np.ndarray, size: int,
                         rng: np.random.Generator,
                         cfg: AugmentConfig = AugmentConfig()
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``train_view`` plus the ``(4,)`` order of the jitter operations (0
  brightness, 1 contrast, 2 saturation, 3 hue). With
  ``cfg.color_on_device`` the view is only cropped: the jitter and
  grayscale drawn (same random numbers) are left to ``color.color_jitter``.
  """
  image = np.asarray(_to_pil(image).convert('RGB'), np.uint8) if (
      isinstance(image, Image.Image) or image.ndim != 3 or
      image.shape[2] != 3) else image
  d = draw_view(rng, image.shape[1], image.shape[0], cfg)
  view = resized_crop(image, d.box, size)
  if d.jitter and not cfg.color_on_device:
    ops = [lambda im, f: ImageEnhance.Brightness(im).enhance(f),
           lambda im, f: ImageEnhance.Contrast(im).enhance(f),
           lambda im, f: ImageEnhance.Color(im).enhance(f), _shift_hue]
    img = Image.fromarray(view)
    for k in d.order:
      img = ops[k](img, d.factors[k])
    view = np.asarray(img, np.uint8)
  if d.gray and not cfg.color_on_device:
    view = np.asarray(Image.fromarray(view).convert('L').convert('RGB'),
                      np.uint8)
  return view, d.aug, d.order


def eval_view(image, size: int) -> np.ndarray:
  """Resize the shorter side to ``size`` and centre-crop, ``(size, size, 3)``.

  ``image``: an ``(h, w, 3)`` uint8 array, or a PIL image in any mode
  (resized and cropped in that mode, converted to RGB last: see
  ``pipeline.eval_images``'s ``order``).
  """
  img = _to_pil(image)
  scale = size / min(img.width, img.height)
  w = max(size, int(round(img.width * scale)))
  h = max(size, int(round(img.height * scale)))
  img = img.resize((w, h), Image.BICUBIC)
  left, top = (w - size) // 2, (h - size) // 2
  return _rgb_array(img.crop((left, top, left + size, top + size)))


def release_eval_view(image, size: int) -> np.ndarray:
  """The release's (open_clip's) eval transform, pixel for pixel.

  torchvision ``Resize(size, BICUBIC)`` on the PIL image (shorter side to
  ``size``, longer side ``int(size * long / short)``, truncated) then
  ``CenterCrop(size)`` (offsets ``int(round((d - size) / 2))``). Differs from
  ``eval_view`` only in those roundings. A PIL image is resized and cropped
  in its own mode (Pillow resizes '1' and 'P' images with nearest
  neighbour, 'LA'/'RGBA' with premultiplied alpha) and converted to RGB
  after the crop, as open_clip does.
  """
  img = _to_pil(image)
  w, h = img.width, img.height
  short, long = min(w, h), max(w, h)
  new_long = int(size * long / short)
  new_w, new_h = (size, new_long) if w <= h else (new_long, size)
  if (new_w, new_h) != (w, h):
    img = img.resize((new_w, new_h), Image.BICUBIC)
  left = int(round((new_w - size) / 2.0))
  top = int(round((new_h - size) / 2.0))
  return _rgb_array(img.crop((left, top, left + size, top + size)))


EVAL_VIEWS = {'default': eval_view, 'release': release_eval_view}
