"""Released checkpoints end to end (#15): text cleaning, tokenizer.json,
Hugging Face snapshots (local and ``hf-hub:`` through the offline cache),
the release preset and fine-tuning from a snapshot.

References are independent implementations: open_clip's cleaning functions
and its ``HFTokenizer`` (the release's tokenizer class), transformers'
``AutoTokenizer``, open_clip's torchvision eval transform and the project's
PyTorch reference model. Nothing is downloaded.
"""

import dataclasses
import importlib.util
import json
import math
import os
import random
import types

import numpy as np
import pytest

from prolip_jax.data import text_clean
from prolip_jax.data import tokenizer
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import tokenizer_from_config
from prolip_jax.data.tokenizer import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK_REPO = 'test-org/tiny-siglip-tok'
MODEL_REPO = 'test-org/tiny-prolip-b16'
REVISION = 'a' * 40

_WORDS = ['photo', 'Dog', 'cat', 'a', 'of', 'the', 'BIG', 'big_cat', 'café',
          'naïve', 'über', '日本', 'Zürich', 'rock-n-roll', "dog's", 'x-ray',
          'e-mail', 'USA', 'C++', '3.14', '$5', '50%', 'émoji', '🙂', 'Ångström']
_PUNCT = ['.', '!', '?', ',', ';', ':', '...', '"', "'", '(', ')', '[', ']',
          '_', '-', '/', '#', '@', '&', '*']
_ENTITIES = ['&amp;', '&lt;b&gt;', '&amp;amp;', '&quot;', '&#39;', '&eacute;',
             '&nbsp;']
_MOJIBAKE = ['cafÃ©', 'donâ€™t', 'â€œquotedâ€\x9d']
_SPACES = [' ', '  ', '\t', '\n', ' \u00a0 ', '\u3000']


def _strings(n=300, seed=0):
  """Captions with punctuation, capitals, unicode, HTML entities, mojibake,
  odd whitespace, empty ones and over-long ones."""
  rng = random.Random(seed)
  out = ['', ' ', 'A photo of a Dog!', '&lt;b&gt;Bold&lt;/b&gt; &amp; co.',
         'A_photo_of_a_big_cat.', '  many   spaces\there  ',
         ' '.join(['a photo of the big dog'] * 30)]
  pools = [_WORDS] * 6 + [_PUNCT, _ENTITIES, _MOJIBAKE]
  while len(out) < n:
    parts = []
    for _ in range(rng.choice([1, 3, 6, 12, 40])):
      parts.append(rng.choice(rng.choice(pools)))
      parts.append(rng.choice(_SPACES) if rng.random() < 0.7 else '')
    text = ''.join(parts)
    out.append(text.upper() if rng.random() < 0.1 else text)
  return out


# ----------------------------------------------------------------------------
# Cleaning


@pytest.mark.parametrize('mode', ['whitespace', 'lower', 'canonicalize'])
def test_clean_matches_open_clip(mode):
  oc_tok = pytest.importorskip('open_clip.tokenizer')
  ref = oc_tok.get_clean_fn(mode)
  texts = _strings()
  got = [text_clean.clean(t, mode) for t in texts]
  assert got == [ref(t) for t in texts]
  assert text_clean.clean('A_photo of a Dog!', 'canonicalize') == (
      'a photo of a dog')


def test_clean_none_and_unknown():
  texts = _strings(50)
  assert [text_clean.clean(t, 'none') for t in texts] == texts
  with pytest.raises(ValueError, match='tokenizer.clean must be one of'):
    text_clean.get_clean_fn('canonicalise')


# ----------------------------------------------------------------------------
# Tokenizers


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory):
  """A T5/SigLIP-style tokenizer: a sentencepiece Unigram model (pad 0, eos
  </s> 1, unk 2, [MASK] 3) and its tokenizer.json made by transformers' own
  T5 converter (4 <extra_id_N> tokens, '</s>' appended by the post-processor,
  pad token '</s>' as SigLIP's), as a Hugging Face tokenizer directory."""
  pytest.importorskip('google.protobuf')
  pytest.importorskip('transformers')
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from transformers.convert_slow_tokenizer import T5Converter  # pylint: disable=g-import-not-at-top
  d = tmp_path_factory.mktemp('tok')
  corpus = [text_clean.clean(t, 'canonicalize') or 'a' for t in _strings(
      400, seed=1)] + _strings(200, seed=2)
  spm_path = str(d / 'spm.model')
  train_tokenizer(corpus, spm_path, 200)
  sp = spm.SentencePieceProcessor(model_file=spm_path)
  stub = types.SimpleNamespace(vocab_file=spm_path, _extra_ids=4,
                               convert_tokens_to_ids=sp.piece_to_id)
  T5Converter(stub).converted().save(str(d / 'tokenizer.json'))
  (d / 'tokenizer_config.json').write_text(json.dumps({
      'tokenizer_class': 'T5Tokenizer', 'pad_token': '</s>',
      'eos_token': '</s>', 'unk_token': '<unk>', 'extra_ids': 4}))
  return d


def _auto_ids(directory, texts, length):
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
  tok = AutoTokenizer.from_pretrained(str(directory))
  return tok(texts, padding='max_length', truncation=True,
             max_length=length).input_ids


@pytest.mark.parametrize('clean', ['none', 'canonicalize'])
def test_tokenizer_json_matches_transformers(tok_dir, clean):
  length = 24
  texts = _strings()
  ref_texts = texts if clean == 'none' else [
      text_clean.clean(t, clean) for t in texts]
  want = np.asarray(_auto_ids(tok_dir, ref_texts, length))
  tok = Tokenizer(str(tok_dir / 'tokenizer.json'), length, clean=clean)
  assert (tok.pad_id, tok.eos_id, tok.vocab_size) == (1, 1, sp_size(tok_dir)
                                                     + 4)
  got = tok(texts)
  np.testing.assert_array_equal(got, want)
  # The test strings exercise truncation (EOS = 1 kept last) and padding.
  long_rows = [i for i, t in enumerate(ref_texts) if len(t) > 200]
  assert long_rows and (want[long_rows, -1] == 1).all()
  assert (want[long_rows, :-1] != 1).all()
  assert ((want == 1).sum(1) > 1).any()  # padded rows
  # The same vocabulary as a sentencepiece .model gives the same ids with
  # keep_eos (EOS kept on truncation, as Hugging Face tokenizers do).
  sp_tok = Tokenizer(str(tok_dir / 'spm.model'), length, pad_id=1,
                     clean=clean, keep_eos=True)
  np.testing.assert_array_equal(sp_tok(texts), want)
  # A short list is encoded text by text (tokenizer._BATCH_ENCODE_MIN), a
  # long one in one batch call: the same ids either way.
  assert len(texts) >= tokenizer._BATCH_ENCODE_MIN
  np.testing.assert_array_equal(sp_tok(texts[:3]), want[:3])
  np.testing.assert_array_equal(
      np.concatenate([sp_tok(t) for t in texts]), want)


def sp_size(tok_dir):
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  return spm.SentencePieceProcessor(
      model_file=str(tok_dir / 'spm.model')).get_piece_size()


def test_release_tokenizer_class_gives_the_same_ids(tok_dir):
  """open_clip's HFTokenizer (what the release builds) on the same dir."""
  oc_tok = pytest.importorskip('open_clip.tokenizer')
  texts = _strings(200, seed=3)
  ref = oc_tok.HFTokenizer(str(tok_dir), context_length=20,
                           clean='canonicalize')
  tok = Tokenizer(str(tok_dir / 'tokenizer.json'), 20, clean='canonicalize')
  np.testing.assert_array_equal(tok(texts), ref(texts).numpy())


def test_sentencepiece_default_truncation_unchanged(tok_dir):
  """Without keep_eos an over-long caption is cut after its pieces + EOS
  (the project's historical behaviour, kept for existing configs)."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  sp = spm.SentencePieceProcessor(model_file=str(tok_dir / 'spm.model'))
  text = ' '.join(['a photo of the big dog'] * 10)
  tok = Tokenizer(str(tok_dir / 'spm.model'), 8, pad_id=0)
  np.testing.assert_array_equal(tok(text)[0], sp.encode(text)[:8])
  short = 'a dog'
  np.testing.assert_array_equal(
      tok(short)[0, :len(sp.encode(short)) + 1], sp.encode(short) + [1])


def test_tokenizer_from_config_reads_the_tokenizer_keys(tok_dir):
  """What training and ``prolip_jax.load`` build from a run config: -1 is
  the file's own pad id / [MASK]; a stored config without the keys (an older
  version's) reads their declared defaults; a given pad id wins."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from prolip_jax.config import presets  # pylint: disable=g-import-not-at-top
  path = str(tok_dir / 'spm.model')
  sp = spm.SentencePieceProcessor(model_file=path)
  text = ' '.join(['A Photo of the BIG dog'] * 5)
  old = tokenizer_from_config(path, {}, 8)
  assert (old.pad_id, old.mask_id, old.clean, old.keep_eos) == (
      sp.pad_id(), sp.piece_to_id('[MASK]'), 'none', False)
  np.testing.assert_array_equal(old(text)[0], sp.encode(text)[:8])
  cfg = presets.base_config()
  cfg.tokenizer.update(pad_id=5, mask_id=7, clean='lower', keep_eos=True)
  tok = tokenizer_from_config(path, cfg, 8)
  assert (tok.pad_id, tok.mask_id) == (5, 7)
  np.testing.assert_array_equal(
      tok(text)[0], sp.encode(text.lower())[:7] + [sp.eos_id()])
  n = len(sp.encode('a dog')) + 1
  assert list(tok('A  Dog')[0, n:]) == [5] * (8 - n)
  assert tokenizer_from_config(path, cfg, 8, pad_id=0).pad_id == 0


def test_tokenizer_json_pickles_and_detects_content(tok_dir, tmp_path):
  import pickle  # pylint: disable=g-import-not-at-top
  # A tokenizer.json copied to WORKDIR/tokenizer.model still opens as one.
  copy = tmp_path / 'tokenizer.model'
  copy.write_bytes((tok_dir / 'tokenizer.json').read_bytes())
  tok = Tokenizer(str(copy), 16, pad_id=1, mask_id=3, clean='canonicalize')
  assert tok.kind == 'tokenizer.json'
  texts = _strings(40, seed=4)
  again = pickle.loads(pickle.dumps(tok))
  np.testing.assert_array_equal(again(texts), tok(texts))
  np.testing.assert_array_equal(
      tok(texts), np.asarray(_auto_ids(tok_dir, [text_clean.clean(
          t, 'canonicalize') for t in texts], 16)))
  with pytest.raises(ValueError, match='names no pad token'):
    Tokenizer(str(copy), 16)


# ----------------------------------------------------------------------------
# Snapshots in the release layout


def _release_json(family):
  """A release-schema config.json (no prolip_jax key) of a tiny model of
  each shape family of the release's five configs."""
  vision = {'image_size': 32, 'layers': 2, 'width': 64, 'head_width': 16,
            'patch_size': 16, 'embed_unc': True, 'init_unc_bias': -10.0}
  text = {'context_length': 16, 'vocab_size': 256,
          'hf_tokenizer_name': TOK_REPO, 'width': 48, 'heads': 4,
          'layers': 2, 'no_causal_mask': True, 'proj_bias': True,
          'pool_type': 'last', 'embed_cls': True, 'embed_unc': True,
          'norm_kwargs': {'eps': 1e-6}, 'init_unc_bias': -10.0}
  cfg = {'embed_dim': 32, 'init_logit_bias': -10.0, 'vision_cfg': vision,
         'text_cfg': text}
  if family == 'B-16-long':  # ViT-B-16 with the longer text context
    text['context_length'] = 40
  elif family == 'SO400M-14':  # patch 14, mlp_ratio 3.7362, one width
    vision.update(image_size=28, patch_size=14, width=48, head_width=12,
                  mlp_ratio=3.7362)
    text.update(width=48, heads=4, mlp_ratio=3.7362)
    cfg['embed_dim'] = 48
  elif family == 'H-14-quickgelu':  # patch 14, QuickGELU in both towers
    vision.update(image_size=28, patch_size=14)
    text.update(width=32, heads=4)
    cfg['quick_gelu'] = True
  return cfg


def _expected_model(family):
  """The ModelConfig each family must parse to, written out by hand."""
  from prolip_jax.models import ModelConfig, TextConfig, VisionConfig  # pylint: disable=g-import-not-at-top
  v = VisionConfig(image_size=32, patch_size=16, width=64, layers=2, heads=4)
  t = TextConfig(vocab_size=256, context_length=16, width=48, layers=2,
                 heads=4, ln_eps=1e-6, pad_id=1, proj_bias=True, pool='cls',
                 causal=False)
  embed = 32
  if family == 'B-16-long':
    t = dataclasses.replace(t, context_length=40)
  elif family == 'SO400M-14':
    v = dataclasses.replace(v, image_size=28, patch_size=14, width=48,
                            heads=4, mlp_ratio=3.7362)
    t = dataclasses.replace(t, width=48, mlp_ratio=3.7362)
    embed = 48
  elif family == 'H-14-quickgelu':
    v = dataclasses.replace(v, image_size=28, patch_size=14,
                            act='quick_gelu')
    t = dataclasses.replace(t, width=32, act='quick_gelu')
  return ModelConfig(embed_dim=embed, vision=v, text=t, use_unc=True,
                     release_compat=True)


def _write_snapshot(directory, family, seed=0):
  """config.json + model.safetensors of a randomly initialised reference
  model (every tensor random: wrong transposes cannot hide)."""
  import torch  # pylint: disable=g-import-not-at-top
  from safetensors.torch import save_file  # pylint: disable=g-import-not-at-top
  from prolip_jax.interop import torch_reference  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  model = torch_reference.build(_expected_model(family))
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      parts = name.split('.')
      if len(parts) > 1 and parts[-2].startswith('ln') and parts[-1] == (
          'weight'):
        p.copy_(1 + 0.1 * noise)
      elif 'uncertainty' in name and name.endswith('bias'):
        p.copy_(-3 + 0.1 * noise)
      elif p.ndim >= 2:
        p.copy_(noise * p.shape[-1] ** -0.5)
      else:
        p.copy_(0.1 * noise)
    model.logit_scale.fill_(math.log(10.0))
  sd = {k: v.contiguous() for k, v in model.state_dict().items()}
  save_file(sd, os.path.join(directory, 'model.safetensors'),
            metadata={'format': 'pt'})
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(_release_json(family), f)
  return model.eval()


def _cache_repo(cache, repo, src_dir):
  """huggingface_hub's cache layout: models--O--N/{refs/main,
  snapshots/REV/FILE -> ../../blobs/HASH}."""
  import hashlib  # pylint: disable=g-import-not-at-top
  base = cache / ('models--' + repo.replace('/', '--'))
  snap = base / 'snapshots' / REVISION
  snap.mkdir(parents=True, exist_ok=True)
  (base / 'blobs').mkdir(exist_ok=True)
  for name in os.listdir(src_dir):
    if os.path.isfile(os.path.join(src_dir, name)):
      data = open(os.path.join(src_dir, name), 'rb').read()
      blob = hashlib.sha256(data).hexdigest()
      (base / 'blobs' / blob).write_bytes(data)
      os.symlink(os.path.join('..', '..', 'blobs', blob), snap / name)
  (base / 'refs').mkdir(exist_ok=True)
  (base / 'refs' / 'main').write_text(REVISION)
  return snap


@pytest.fixture(scope='module')
def hf_cache(tmp_path_factory, tok_dir):
  """An offline Hugging Face cache holding the tokenizer repo (tokenizer
  files only, as the release's separate timm/ViT-B-16-SigLIP)."""
  cache = tmp_path_factory.mktemp('hf_cache')
  src = tmp_path_factory.mktemp('tok_repo')
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (src / name).write_bytes((tok_dir / name).read_bytes())
  _cache_repo(cache, TOK_REPO, src)
  return cache


@pytest.fixture
def offline(hf_cache, monkeypatch):
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  monkeypatch.setenv('HF_HUB_CACHE', str(hf_cache))
  return hf_cache


def _images(seed=0):
  """uint8 images of several sizes and aspect ratios."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
          for h, w in ((45, 37), (28, 28), (61, 90), (33, 100))]


TEXTS = ['A photo of a Dog!', 'a_photo_of_a_BIG_cat...', '&lt;b&gt;Café&lt;/b&gt;',
         '', ' '.join(['x-ray of the dog'] * 20)]


def _openai_mean_std():
  """OpenAI CLIP's image mean and std as open_clip (the release) has them."""
  constants = pytest.importorskip('open_clip.constants')
  return constants.OPENAI_DATASET_MEAN, constants.OPENAI_DATASET_STD


def _release_reference(model, family, tok_dir, images, texts):
  """What the release computes: open_clip's HFTokenizer(clean='canonicalize')
  and eval image transform (arrays as RGB PIL images, PIL images as they
  are), then the PyTorch reference model."""
  import torch  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  open_clip = pytest.importorskip('open_clip')
  cfg = _release_json(family)
  ctx = cfg['text_cfg']['context_length']
  tokens = open_clip.tokenizer.HFTokenizer(
      str(tok_dir), context_length=ctx, clean='canonicalize')(texts)
  size = cfg['vision_cfg']['image_size']
  mean, std = _openai_mean_std()
  tf = open_clip.transform.image_transform(size, is_train=False,
                                           mean=mean, std=std)
  pixels = torch.stack([tf(x if isinstance(x, Image.Image)
                           else Image.fromarray(x)) for x in images])
  with torch.no_grad():
    img = [t.numpy() for t in model.encode_image(pixels)]
    txt = [t.numpy() for t in model.encode_text(tokens)]
  return tokens.numpy(), img, txt


# B-16 (the zero-shot check too) in the fast tier; the other geometries in
# the slow one.
@pytest.mark.parametrize('family', [
    'B-16', pytest.param('B-16-long', marks=pytest.mark.slow),
    pytest.param('SO400M-14', marks=pytest.mark.slow),
    pytest.param('H-14-quickgelu', marks=pytest.mark.slow)])
def test_release_snapshot_parity(family, tmp_path, tok_dir, offline):
  """load(snapshot dir) on raw strings and images == the release pipeline."""
  pytest.importorskip('torch')
  import prolip_jax  # pylint: disable=g-import-not-at-top
  from prolip_jax.interop import convert  # pylint: disable=g-import-not-at-top
  snap = tmp_path / 'snap'
  ref_model = _write_snapshot(str(snap), family, seed=len(family))
  assert convert.model_dict_from_json(_release_json(family)) == dict(
      dataclasses.asdict(_expected_model(family)),
      text=dict(dataclasses.asdict(_expected_model(family).text), pad_id=0))
  model = prolip_jax.load(str(snap))
  images = _images()
  tokens, (r_mu_i, r_lv_i), (r_mu_t, r_lv_t) = _release_reference(
      ref_model, family, tok_dir, images, TEXTS)
  np.testing.assert_array_equal(model.tokenizer(TEXTS), tokens)
  mu_i, lv_i = model.encode_image(images)
  mu_t, lv_t = model.encode_text(TEXTS)
  for got, want in ((mu_i, r_mu_i), (lv_i, r_lv_i), (mu_t, r_mu_t),
                    (lv_t, r_lv_t)):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  if family == 'B-16':
    # Zero-shot classes: the mean of the prompts' means and variances.
    names, templates = ['Dog', 'big_cat'], ['a photo of a {}.', 'a {}!']
    clf = model.zero_shot_classifier(names, templates)
    _, _, (p_mu, p_lv) = _release_reference(
        ref_model, family, tok_dir, images,
        [t.format(c) for c in names for t in templates])
    np.testing.assert_allclose(clf.mu, p_mu.reshape(2, 2, -1).mean(1),
                               atol=2e-5)
    np.testing.assert_allclose(clf.var, np.exp(p_lv).reshape(2, 2, -1).mean(1),
                               rtol=1e-4)


# ----------------------------------------------------------------------------
# The release's image order: resized and cropped in the stored mode, RGB last


MODES = ('1', 'P', 'LA', 'CMYK', 'RGB', 'L', 'RGBA')


def _mode_file(mode, w, h, seed=0):
  """A ``w`` x ``h`` image encoded in PIL ``mode`` (PNG; CMYK as a JPEG, as
  such files occur in ImageNet): colour ramps plus noise and, for LA/RGBA,
  a random alpha, so that resampling in the stored mode shows."""
  import io  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  yy, xx = np.mgrid[0:h, 0:w]
  ramps = np.stack([xx * 255 // (w - 1), yy * 255 // (h - 1),
                    (xx + yy) * 255 // (w + h - 2)], -1)
  rgb = np.clip(ramps + rng.integers(-60, 61, ramps.shape), 0, 255)
  img = Image.fromarray(rgb.astype(np.uint8))
  alpha = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8))
  if mode == 'P':
    img = img.quantize(48)
  elif mode in ('LA', 'RGBA'):
    img = img.convert(mode[:-1])
    img.putalpha(alpha)
  else:
    img = img.convert(mode)  # '1' dithers
  buf = io.BytesIO()
  img.save(buf, 'JPEG' if mode == 'CMYK' else 'PNG', quality=95)
  with Image.open(io.BytesIO(buf.getvalue())) as check:
    assert check.mode == mode
  return buf.getvalue()


def _open_clip_pixels(size, pil_images):
  """uint8 ``(n, size, size, 3)`` from open_clip's own eval transform (the
  release's: torchvision Resize, CenterCrop, convert('RGB'), ToTensor),
  normalised with mean 0 and std 1 so the pixels come back exactly."""
  open_clip = pytest.importorskip('open_clip')
  tf = open_clip.transform.image_transform(size, is_train=False,
                                           mean=(0.0,) * 3, std=(1.0,) * 3)
  return np.stack([np.rint(tf(img).numpy().transpose(1, 2, 0) * 255)
                   .astype(np.uint8) for img in pil_images])


@pytest.mark.parametrize('size,w,h', [(32, 77, 51), (32, 45, 97),
                                      (224, 301, 227), (224, 151, 233)])
def test_release_image_order_gives_open_clip_pixels(size, w, h, tmp_path):
  """Files, bytes and PIL images of every common mode, in the release's
  order, give exactly the pixels of open_clip's eval transform; the RGB-first
  order (our models') agrees only where the mode does not matter."""
  pytest.importorskip('torch')
  import io  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from prolip_jax.embedding import as_uint8_image  # pylint: disable=g-import-not-at-top
  files = {m: _mode_file(m, w, h, seed=i) for i, m in enumerate(MODES)}
  want = dict(zip(MODES, _open_clip_pixels(
      size, [Image.open(io.BytesIO(files[m])) for m in MODES])))
  for mode, data in files.items():
    path = tmp_path / f'{mode}.img'
    path.write_bytes(data)
    inputs = [data, as_uint8_image(str(path), keep_mode=True),
              as_uint8_image(Image.open(str(path)), keep_mode=True)]
    got = pipeline.eval_images(inputs, size, 'release', 'release')
    for g in got:
      np.testing.assert_array_equal(g, want[mode], err_msg=mode)
    rgb_first = pipeline.eval_images([data], size, 'release', 'rgb_first')[0]
    diff = np.abs(rgb_first.astype(int) - want[mode]).max()
    if mode in ('RGB', 'L'):
      assert diff == 0, mode
    elif mode in ('1', 'P', 'LA', 'RGBA'):
      assert diff > 0, mode  # the order matters for these (CMYK: may not)
  # An evaluation set of those files, batched in the release's order.
  from prolip_jax.data import eval_data  # pylint: disable=g-import-not-at-top
  zs = eval_data.ZeroShotDataset([str(tmp_path / f'{m}.img') for m in MODES],
                                 np.zeros(len(MODES)), ('x',), ('{}',))
  (views, _), = zs.batches(len(MODES), size, view='release', order='release')
  np.testing.assert_array_equal(views, np.stack([want[m] for m in MODES]))


def test_release_snapshot_scores_mode_files_as_the_release(tmp_path, tok_dir,
                                                            offline):
  """load(release snapshot).encode_image(paths) == the release pipeline
  (open_clip transform + reference model) on 1-bit, palette, LA, CMYK, RGB,
  L and RGBA files; converting to RGB first would not be."""
  pytest.importorskip('torch')
  from PIL import Image  # pylint: disable=g-import-not-at-top
  import prolip_jax  # pylint: disable=g-import-not-at-top
  ref_model = _write_snapshot(str(tmp_path / 'snap'), 'B-16', seed=3)
  model = prolip_jax.load(str(tmp_path / 'snap'))
  assert model.image_order == 'release'
  paths = []
  for i, mode in enumerate(MODES):
    paths.append(str(tmp_path / f'{i}.img'))
    with open(paths[-1], 'wb') as f:
      f.write(_mode_file(mode, 53 + 6 * i, 71 - 4 * i, seed=i))
  _, (r_mu, r_lv), _ = _release_reference(
      ref_model, 'B-16', tok_dir, [Image.open(p) for p in paths], TEXTS[:1])
  mu, lv = model.encode_image(paths)
  np.testing.assert_allclose(mu, r_mu, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(lv, r_lv, atol=2e-5, rtol=1e-5)
  model.image_order = 'rgb_first'
  mu_rgb, _ = model.encode_image(paths)
  assert np.abs(mu_rgb[0] - r_mu[0]).max() > 1e-3  # the 1-bit file


def test_release_preset_settings(tmp_path, offline, tok_dir):
  pytest.importorskip('torch')
  from prolip_jax.interop import hub  # pylint: disable=g-import-not-at-top
  snap = tmp_path / 'snap'
  _write_snapshot(str(snap), 'B-16')
  s = hub.snapshot_settings(hub.resolve(str(snap)))
  assert s.release and s.model['release_compat']
  assert (s.clean, s.keep_eos, s.image_view, s.image_order) == (
      'canonicalize', True, 'release', 'release')
  assert s.context_length == 16 and s.model['text']['pad_id'] == 1
  assert s.pad_id == 1  # '</s>', the tokenizer's pad token (SigLIP's)
  # [MASK]: the highest <extra_id_N>, the first id after the pieces (32000
  # = <extra_id_99> for SigLIP's 32,000 pieces + 100 extra ids).
  assert s.mask_id == sp_size(tok_dir)
  assert (s.mean, s.std) == _openai_mean_std()
  assert os.path.dirname(s.tokenizer_path).endswith(REVISION)
  # The vocabulary's sentencepiece file instead: same settings and ids.
  s2 = hub.snapshot_settings(str(snap), tokenizer=str(tok_dir / 'spm.model'))
  assert (s2.pad_id, s2.mask_id, s2.keep_eos) == (1, sp_size(tok_dir), True)
  texts = _strings(100, seed=5)
  np.testing.assert_array_equal(s2.tokenizer()(texts), s.tokenizer()(texts))


def test_hf_hub_from_offline_cache_and_errors(tmp_path, offline, tok_dir):
  pytest.importorskip('torch')
  import prolip_jax  # pylint: disable=g-import-not-at-top
  from prolip_jax.interop import hub  # pylint: disable=g-import-not-at-top
  src = tmp_path / 'src'
  _write_snapshot(str(src), 'B-16', seed=5)
  _cache_repo(offline, MODEL_REPO, src)
  a = prolip_jax.load(f'hf-hub:{MODEL_REPO}')
  b = prolip_jax.load(str(src))
  for x, y in zip(a.encode_text(TEXTS), b.encode_text(TEXTS)):
    np.testing.assert_array_equal(x, y)
  assert a.image_view == 'release' and a.image_order == 'release'

  with pytest.raises(hub.SnapshotError, match='not in the cache.*HF_HUB_OFFLINE'
                     ) as e:
    prolip_jax.load('hf-hub:test-org/not-cached')
  assert str(offline) in str(e.value)
  with pytest.raises(hub.SnapshotError, match='not a valid Hugging Face repo'):
    prolip_jax.load('hf-hub:bad//repo id')
  with pytest.raises(hub.SnapshotError, match='no such snapshot directory') as e:
    hub.resolve(str(tmp_path / 'missing'))
  assert str(tmp_path / 'missing') in str(e.value)
  with pytest.raises(FileNotFoundError, match=str(tmp_path / 'missing')):
    prolip_jax.load(str(tmp_path / 'missing'))
  (tmp_path / 'no_weights').mkdir()
  (tmp_path / 'no_weights' / 'config.json').write_text('{}')
  with pytest.raises(hub.SnapshotError, match='has no model.safetensors'):
    prolip_jax.load(str(tmp_path / 'no_weights'))
  # The tokenizer repo named in config.json is not cached either.
  cfg = json.loads((src / 'config.json').read_text())
  cfg['text_cfg']['hf_tokenizer_name'] = 'test-org/absent-tok'
  (src / 'config.json').write_text(json.dumps(cfg))
  with pytest.raises(hub.SnapshotError, match='absent-tok.*not in the cache'):
    prolip_jax.load(str(src))
  # ... unless a tokenizer is given (Hub repo or directory), or the snapshot
  # holds its own tokenizer files.
  want = b.tokenizer(TEXTS)
  for tok in (f'hf-hub:{TOK_REPO}', str(tok_dir)):
    np.testing.assert_array_equal(
        prolip_jax.load(str(src), tokenizer=tok).tokenizer(TEXTS), want)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (src / name).write_bytes((tok_dir / name).read_bytes())
  own = prolip_jax.load(str(src))
  assert own.tokenizer.model_path == str(src / 'tokenizer.json')
  np.testing.assert_array_equal(own.tokenizer(TEXTS), want)


# ----------------------------------------------------------------------------
# Fine-tuning from a snapshot


def _load_module(relpath, name):
  spec = importlib.util.spec_from_file_location(name,
                                                os.path.join(ROOT, relpath))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_finetune_from_snapshot_export_and_reload(tmp_path, offline):
  """init_from a release-layout snapshot -> 3 steps -> export
  --hub_compatible -> load: finite, changed, and the reference agrees."""
  pytest.importorskip('torch')
  import prolip_jax  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from prolip_jax.config import presets
  from prolip_jax.interop import torch_reference
  from prolip_jax.storage import checkpoint
  from prolip_jax.training import train
  # pylint: enable=g-import-not-at-top
  snap = tmp_path / 'snap'
  _write_snapshot(str(snap), 'B-16', seed=7)
  cfg = presets.load_config_file(os.path.join(ROOT, 'configs',
                                              'prolip_micro.py'))
  cfg.init_from = str(snap)
  cfg.total_steps = 3
  cfg.mesh.num_devices = 1
  cfg.checkpoint_every_steps = 3
  cfg.optim.lr = 1e-3
  cfg.lock()  # as main.py's config flag
  workdir = str(tmp_path / 'wd')
  summary = train.train_and_evaluate(cfg, workdir)
  assert summary['step'] == 3
  assert cfg.tokenizer.clean == 'canonicalize' and cfg.model.release_compat
  _, meta = checkpoint.load_params(workdir)
  assert meta['config']['tokenizer']['keep_eos'] is True

  out = tmp_path / 'export'
  _load_module('tools/export_pytorch.py', 'export_pytorch').export(
      workdir, str(out), hub_compatible=True)
  assert {'config.json', 'model.safetensors', 'tokenizer.json',
          'prolip_jax.json'} <= set(os.listdir(out))
  assert 'prolip_jax' not in json.loads((out / 'config.json').read_text())
  before = prolip_jax.load(str(snap))
  after = prolip_jax.load(str(out))
  assert after.image_view == 'release' and after.tokenizer.clean == (
      'canonicalize')
  assert after.image_order == 'release' == prolip_jax.load(workdir).image_order
  np.testing.assert_array_equal(after.tokenizer(TEXTS),
                                before.tokenizer(TEXTS))
  images = _images(1)
  new = after.encode_text(TEXTS) + after.encode_image(images)
  old = before.encode_text(TEXTS) + before.encode_image(images)
  assert all(np.isfinite(x).all() for x in new)
  assert not np.allclose(new[0], old[0], atol=1e-4)
  # Pushed to the Hub unchanged and loaded back through the cache.
  _cache_repo(offline, 'test-org/finetuned', str(out))
  via_hub = prolip_jax.load('hf-hub:test-org/finetuned').encode_text(TEXTS)
  np.testing.assert_array_equal(via_hub[0], new[0])
  # The workdir itself loads with the same settings and outputs.
  from_wd = prolip_jax.load(workdir).encode_text(TEXTS)
  np.testing.assert_allclose(from_wd[0], new[0], atol=1e-6)
  # The exported weights in the PyTorch reference (release forward).
  ref = torch_reference.load(str(out))
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    mu, _ = ref.encode_text(torch.from_numpy(
        after.tokenizer(TEXTS).astype(np.int64)))
  np.testing.assert_allclose(mu.numpy(), new[0], atol=2e-5)


def _micro_args(workdir, repo, *extra):
  """``prolip_jax.main`` arguments: the micro config from the snapshot
  cached as ``hf-hub:repo``, ``extra`` after them."""
  return ['--config', os.path.join(ROOT, 'configs', 'prolip_micro.py'),
          '--workdir', str(workdir), f'--config.init_from=hf-hub:{repo}',
          '--config.mesh.num_devices=1', *extra]


@pytest.mark.slow
def test_finetune_at_another_image_size_resamples_the_posemb(tmp_path,
                                                             offline):
  """init_from a 32 px (2x2 patches) snapshot with init_image_size=48 (3x3)
  through the command line: one note line, the run's model is 48 px, the
  step-0 checkpoint holds the snapshot's weights with the patch rows of the
  position embeddings resized as PyTorch's bilinear interpolate
  (align_corners=True, big_vision's convention) and the [CLS]/[UNC] rows as
  they were; 2 steps train."""
  torch = pytest.importorskip('torch')
  from support import run_main as _run  # pylint: disable=g-import-not-at-top
  from prolip_jax.storage import checkpoint  # pylint: disable=g-import-not-at-top
  ref = _write_snapshot(str(tmp_path / 'snap'), 'B-16', seed=5)
  _cache_repo(offline, 'test-org/posemb-ft', str(tmp_path / 'snap'))
  workdir = tmp_path / 'wd'
  code, out, err = _run(*_micro_args(
      workdir, 'test-org/posemb-ft', '--config.init_image_size=48', '--config.total_steps=2',
      '--config.checkpoint_every_steps=2'))
  assert code == 0, err[-2000:]
  notes = [l for l in (out + err).splitlines() if 'position embeddings' in l]
  assert notes == ['note: resampled the image position embeddings from 2x2 '
                   'to 3x3 patches (bilinear)']
  params, meta = checkpoint.load_params(str(workdir), step=0)
  assert meta['model']['vision']['image_size'] == 48
  assert meta['config']['model']['vision']['image_size'] == 48
  sd = {k: v.detach() for k, v in ref.state_dict().items()}
  pos = sd['visual.positional_embedding']  # (2 + 4, 64): [CLS], [UNC], grid
  grid = pos[2:].reshape(2, 2, -1).permute(2, 0, 1)[None]
  want = torch.nn.functional.interpolate(
      grid, size=(3, 3), mode='bilinear', align_corners=True,
      antialias=False)[0].permute(1, 2, 0).reshape(9, -1)
  got = np.asarray(params['visual']['positional_embedding'])
  assert got.shape == (11, 64)
  np.testing.assert_array_equal(got[:2], pos[:2].numpy())
  np.testing.assert_allclose(got[2:], want.numpy(), atol=1e-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(params['visual']['class_embedding']),
                                sd['visual.class_embedding'].numpy())
  last, meta = checkpoint.load_params(str(workdir))
  assert meta['step'] == 2
  assert np.isfinite(np.asarray(last['visual']['positional_embedding'])).all()
  # A workdir loads at another size too (3x3 -> 2x2, corner-aligned).
  import prolip_jax  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import posemb  # pylint: disable=g-import-not-at-top
  small = prolip_jax.load(str(workdir), step=0, image_size=32)
  assert small.config.vision.image_size == 32
  np.testing.assert_array_equal(
      small.params['visual']['positional_embedding'],
      posemb.resample_patch_posemb(got, (3, 3), (2, 2), 2))
  assert np.isfinite(small.encode_image(_images(2))[0]).all()


def test_load_at_another_image_size(tmp_path, offline, capsys):
  """load(snapshot, image_size=48): the model embeds 48 px images with the
  position embeddings resampled (the one note line), everything else as
  loaded at 32 px; a size that is no multiple of the patch is refused."""
  pytest.importorskip('torch')
  import prolip_jax  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import posemb  # pylint: disable=g-import-not-at-top
  snap = str(tmp_path / 'snap')
  _write_snapshot(snap, 'B-16', seed=2)
  base = prolip_jax.load(snap)
  capsys.readouterr()
  big = prolip_jax.load(snap, image_size=48)
  assert capsys.readouterr().out.splitlines() == [
      'note: resampled the image position embeddings from 2x2 to 3x3 '
      'patches (bilinear)']
  assert big.config.vision.image_size == 48
  assert big.preprocess_images(_images(0)).shape[1:] == (48, 48, 3)
  np.testing.assert_array_equal(
      big.params['visual']['positional_embedding'],
      posemb.resample_patch_posemb(
          base.params['visual']['positional_embedding'], (2, 2), (3, 3), 2))
  np.testing.assert_array_equal(big.params['visual']['proj']['kernel'],
                                base.params['visual']['proj']['kernel'])
  mu, logvar = big.encode_image(_images(0))
  assert np.isfinite(mu).all() and np.isfinite(logvar).all()
  np.testing.assert_array_equal(big.encode_text(TEXTS)[0],
                                base.encode_text(TEXTS)[0])
  with pytest.raises(ValueError, match='image_size=40 is not a positive '
                     "multiple of the model's patch size 16"):
    prolip_jax.load(snap, image_size=40)


def test_init_image_size_errors_are_one_line(tmp_path, offline):
  """Not a multiple of the snapshot's patch size, or without init_from: one
  ``error:`` line and status 2 before anything is written or trained."""
  pytest.importorskip('torch')
  from support import run_main as _run  # pylint: disable=g-import-not-at-top
  _write_snapshot(str(tmp_path / 'snap'), 'B-16', seed=5)
  _cache_repo(offline, 'test-org/posemb-errors', str(tmp_path / 'snap'))
  code, _, err = _run(*_micro_args(tmp_path / 'wd', 'test-org/posemb-errors',
                                   '--config.init_image_size=40'))
  assert code == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and (
      "init_image_size=40 is not a multiple of the snapshot's patch size 16 "
      '(e.g. 32 or 48)') in lines[0], err
  code, _, err = _run('--config', os.path.join(ROOT, 'configs',
                                               'prolip_micro.py'),
                      '--workdir', str(tmp_path / 'wd2'),
                      '--config.init_image_size=48')
  assert code == 2 and 'init_image_size applies to init_from only' in err


def test_existing_configs_keep_the_old_text_and_image_path():
  """New settings default to the old behaviour in every shipped config
  (the tiny demos' numbers cannot change); only the fine-tune config names
  init_from (empty until set on the command line)."""
  from prolip_jax.config import presets  # pylint: disable=g-import-not-at-top
  names = sorted(f for f in os.listdir(os.path.join(ROOT, 'configs'))
                 if f.endswith('.py'))
  assert 'prolip_b16_finetune.py' in names
  for name in names:
    c = presets.load_config_file(os.path.join(ROOT, 'configs', name))
    assert (c.tokenizer.clean, c.tokenizer.keep_eos, c.data.eval_view,
            c.data.eval_image_order, c.init_from) == (
                'none', False, 'default', 'rgb_first', ''), name
