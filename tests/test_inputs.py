"""Inputs of a loaded model and loads that go wrong (issue 31).

* One image passed without a list is refused (it used to embed as one image
  per row); an ``(N, H, W, C)`` batch array is a batch.
* 16-bit images (PNG files, PIL 'I;16'/'I;16B'/'I' images, uint16 arrays,
  encoded bytes) become 8 bits by ``value >> 8`` in every form, as Pillow
  itself reduces 16-bit RGB PNGs; expected pixels are computed here with
  numpy from the 16-bit values, and the PNGs are encoded here byte by byte.
* Every per-item mistake (undecodable bytes, a missing file, a caption that
  is not text) is one ``UserError`` line naming the item's index.
* A snapshot without a manifest whose ``model.safetensors`` is truncated or
  whose ``config.json`` is no model config is one line, also from the
  ``prolip_jax.evaluate`` command line; one with a manifest is caught by it.
* ``load`` refuses finite weights whose embeddings of a probe are not
  finite.
* A checkpoint rotated away while ``load`` reads it (a run training with
  ``keep_checkpoints=1``) is read again at the newest step, never reported
  as unreadable.
"""

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from PIL import Image

import prolip_jax
from prolip_jax import embedding
from prolip_jax import errors
from prolip_jax import evaluate
from prolip_jax.config import presets
from prolip_jax.data import image_decode
from prolip_jax.data.tokenizer import file_sha256
from prolip_jax.data.tokenizer import Tokenizer
from prolip_jax.data.tokenizer import train_tokenizer
from prolip_jax.interop import convert
from prolip_jax.interop import hub
from prolip_jax.interop import load as load_lib
from prolip_jax.interop import manifest
from prolip_jax.storage import checkpoint

# The tiny model of the user-error tests (pad 0, eos 1, unk 2, [MASK] 3) and
# its random parameters.
from support import TINY
from support import tiny_params
from support import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def tok_path(tmp_path_factory):
  """A small sentencepiece model (trained in a few milliseconds)."""
  words = ['red', 'green', 'blue', 'cat', 'dog', 'bird', 'a', 'photo', 'of',
           'the', 'small', 'large', 'one', 'two', 'seven', 'digit']
  rng = np.random.default_rng(0)
  corpus = [' '.join(words[j] for j in rng.integers(0, 16, 6))
            for _ in range(300)]
  return train_tokenizer(
      corpus, str(tmp_path_factory.mktemp('tok') / 'tok.model'), 60)


@pytest.fixture(scope='module')
def params():
  return tiny_params()


@pytest.fixture(scope='module')
def model(params, tok_path):
  """TINY built in-process (our eval transform, RGB first)."""
  return load_lib.LoadedModel(TINY, params, Tokenizer(tok_path, 12))


@pytest.fixture(scope='module')
def release_model(params, tok_path):
  """TINY with the release's eval transform (resize in the stored mode)."""
  return load_lib.LoadedModel(TINY, params, Tokenizer(tok_path, 12),
                               image_view='release', image_order='release')


def _one_line_user_error(excinfo):
  e = excinfo.value
  assert isinstance(e, errors.UserError), type(e)
  assert '\n' not in str(e), str(e)
  return str(e)


# ----------------------------------------------------------------------------
# 1. One image without a list


def _rng_images(n=3, h=20, w=24, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3),
                                              dtype=np.uint8)


@pytest.mark.parametrize('single', [
    'hw3', 'hw', 'jax_hw3', 'pil', 'path', 'bytes'])
def test_one_image_without_a_list_is_refused(model, tmp_path, single):
  x = _rng_images(1)[0]
  Image.fromarray(x).save(tmp_path / 'x.png')
  given = {'hw3': x, 'hw': x[:, :, 0], 'jax_hw3': jnp.asarray(x),
           'pil': Image.fromarray(x), 'path': str(tmp_path / 'x.png'),
           'bytes': (tmp_path / 'x.png').read_bytes()}[single]
  # Class Gaussians given directly: no text tower needed here.
  rng = np.random.default_rng(1)
  clf = load_lib.ZeroShotClassifier(
      model, ['cat', 'dog'], rng.standard_normal((2, TINY.embed_dim)),
      np.exp(rng.standard_normal((2, TINY.embed_dim))))
  for fn in (model.encode_image, model.preprocess_images, clf.scores,
             clf.predict):
    with pytest.raises(embedding.InputError) as e:
      fn(given)
    assert 'wrap it in a list' in _one_line_user_error(e)
  # In a list it is one image, the same whatever its form.
  mu, _ = model.encode_image([given])
  assert mu.shape == (1, TINY.embed_dim)
  want = x if single != 'hw' else np.repeat(x[:, :, :1], 3, -1)
  np.testing.assert_array_equal(mu, model.encode_image([want])[0])
  assert clf.predict([given]).shape == (1,)


def test_a_4d_array_is_a_batch_of_images(model):
  batch = _rng_images(3)
  one_by_one = np.concatenate([model.encode_image([x])[0] for x in batch])
  for given in (batch, jnp.asarray(batch), list(batch)):
    np.testing.assert_array_equal(model.encode_image(given)[0], one_by_one)
  with pytest.raises(embedding.InputError, match='5-D array'):
    model.encode_image(batch[None])


# ----------------------------------------------------------------------------
# 2. 16-bit images


def _png16(a):
  """PNG bytes of a uint16 ``(h, w)`` or ``(h, w, 2|3|4)`` array, 16 bits a
  channel (grey, grey+alpha, RGB, RGBA), written here byte by byte."""
  a = np.asarray(a, np.uint16)
  color_type = 0 if a.ndim == 2 else {2: 4, 3: 2, 4: 6}[a.shape[-1]]
  h, w = a.shape[:2]
  raw = b''.join(b'\x00' + a[i].astype('>u2').tobytes() for i in range(h))

  def chunk(kind, data):
    crc = zlib.crc32(kind + data) & 0xffffffff
    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', crc)

  return (b'\x89PNG\r\n\x1a\n'
          + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 16, color_type,
                                       0, 0, 0))
          + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))


def _values16(shape, seed=0):
  """16-bit values over the whole range, with the corners where >> 8 and
  /257 rounding disagree (255 -> 0, not 1; 0x80FF -> 128)."""
  a = np.random.default_rng(seed).integers(0, 65536, shape, dtype=np.uint16)
  a.reshape(-1)[:4] = (0, 255, 0x80FF, 65535)
  return a


def _rgb(a8):
  return np.repeat(a8[:, :, None], 3, -1) if a8.ndim == 2 else a8[..., :3]


def _forms_16bit(a, tmp_path):
  """The same 16-bit grey image ``a`` in every form ``encode_image`` takes."""
  path = tmp_path / 'grey16.png'
  path.write_bytes(_png16(a))
  pil_path = tmp_path / 'grey16_pil.png'
  Image.fromarray(a).save(pil_path)  # Pillow's own 16-bit writer
  h, w = a.shape
  return {
      'png_path': str(path),
      'pil_written_png_path': str(pil_path),
      'png_bytes': _png16(a),
      'pil_I;16': Image.fromarray(a),
      'pil_I;16B': Image.frombytes('I;16B', (w, h), a.astype('>u2').tobytes()),
      'pil_I': Image.fromarray(a.astype(np.int32)),
      'uint16': a,
      'uint16_big_endian': a.astype('>u2'),
      'uint16_hw1': a[:, :, None],
  }


def test_16bit_grey_becomes_the_high_byte_in_every_form(model, release_model,
                                                        tmp_path):
  a = _values16((20, 24))
  want = (a >> 8).astype(np.uint8)  # the high byte, computed here
  assert want.reshape(-1)[:4].tolist() == [0, 0, 128, 255]
  forms = _forms_16bit(a, tmp_path)
  assert Image.open(forms['png_path']).mode in ('I;16', 'I')  # 16-bit indeed
  assert forms['pil_I;16'].mode == 'I;16' and forms['pil_I'].mode == 'I'
  want_rgb_first = model.preprocess_images([_rgb(want)])
  want_release = release_model.preprocess_images([Image.fromarray(want)])
  for name, x in forms.items():
    np.testing.assert_array_equal(embedding.as_uint8_image(x), _rgb(want),
                                  err_msg=name)
    np.testing.assert_array_equal(model.preprocess_images([x]),
                                  want_rgb_first, err_msg=name)
    # The release order resizes in the stored mode: 'L' after the scaling
    # (an array is RGB pixels there too).
    ref = (want_release if not name.startswith('uint16')
           else release_model.preprocess_images([_rgb(want)]))
    np.testing.assert_array_equal(release_model.preprocess_images([x]), ref,
                                  err_msg=name)


@pytest.mark.parametrize('channels', [3, 4, 2])
def test_16bit_colour_pngs_agree_with_the_high_byte(model, channels):
  """Pillow opens 16-bit RGB(A) and grey+alpha PNGs as 8-bit itself; what it
  gives must be the same high byte."""
  a = _values16((12, 10, channels), seed=channels)
  data = _png16(a)
  want = (a >> 8).astype(np.uint8)
  want = np.repeat(want[..., :1], 3, -1) if channels == 2 else want[..., :3]
  np.testing.assert_array_equal(embedding.as_uint8_image(data), want)
  if channels != 2:  # the same pixels as a uint16 array
    np.testing.assert_array_equal(embedding.as_uint8_image(a), want)
  np.testing.assert_array_equal(model.preprocess_images([data]),
                                model.preprocess_images([want]))


def test_the_data_pipeline_decodes_16bit_alike():
  """Training and evaluation data (``image_decode``) scale the same way."""
  a = _values16((9, 7), seed=3)
  want = (a >> 8).astype(np.uint8)
  np.testing.assert_array_equal(image_decode.decode_rgb(_png16(a)),
                                _rgb(want))
  np.testing.assert_array_equal(image_decode.decode_rgb(a), _rgb(want))
  kept = image_decode.decode_keeping_mode(_png16(a))
  assert kept.mode == 'L'
  np.testing.assert_array_equal(np.asarray(kept), want)
  # 8-bit images are untouched.
  grey8 = Image.fromarray(want)
  assert image_decode.to_8bit(grey8) is grey8


def test_a_mode_I_image_beyond_16_bits_is_refused(model):
  x = Image.fromarray(np.full((8, 8), 70000, np.int32))
  with pytest.raises(embedding.InputError, match=r"^image 1: .*0\.\.65535"):
    model.encode_image([np.zeros((8, 8, 3), np.uint8), x])
  # Integers beyond 255 that are not uint16 are still refused, with a hint.
  with pytest.raises(embedding.InputError, match='go as uint16'):
    model.encode_image([np.full((8, 8), 1000, np.int32)])


# ----------------------------------------------------------------------------
# 3. Per-item errors name the index


def _png_bytes(seed=0):
  buf = io.BytesIO()
  Image.fromarray(_rng_images(1, seed=seed)[0]).save(buf, 'PNG')
  return buf.getvalue()


@pytest.mark.parametrize('bad,reason', [
    (b'garbage, not an image', 'cannot decode the 21 bytes given'),
    (_png_bytes()[:60], 'cannot decode the 60 bytes given'),
    (b'', 'cannot decode the 0 bytes given'),
])
def test_undecodable_bytes_are_one_line_naming_the_index(model, bad, reason):
  ok = _png_bytes(1)
  with pytest.raises(embedding.InputError) as e:
    model.encode_image([ok, ok, bad])
  line = _one_line_user_error(e)
  assert line.startswith(f'image 2: {reason} as an image'), line
  assert 'BytesIO' not in line
  assert isinstance(e.value, ValueError)  # what library callers caught


def test_a_missing_or_unreadable_path_names_the_index(model, tmp_path):
  missing = str(tmp_path / 'missing.png')
  with pytest.raises(FileNotFoundError) as e:
    model.encode_image([_png_bytes(), missing])
  assert _one_line_user_error(e) == f'image 1: no such file {missing}'
  (tmp_path / 'bad.png').write_bytes(b'not a png')
  with pytest.raises(embedding.InputError, match=r'^image 0: .*bad\.png is '
                     'not a readable image'):
    model.encode_image([str(tmp_path / 'bad.png')])


@pytest.mark.parametrize('texts,index,what', [
    (['a red cat', None], 1, 'NoneType'),
    (['a', 'b', 3], 2, 'int'),
    ([['a nested list']], 0, 'list'),
    (['fine', b'\xff\xfe not utf-8'], 1, 'not UTF-8'),
])
def test_a_caption_that_is_not_text_names_the_index(model, texts, index,
                                                    what):
  with pytest.raises(embedding.InputError) as e:
    model.encode_text(texts)
  line = _one_line_user_error(e)
  assert line.startswith(f'text {index}: ') and what in line, line


def test_captions_as_str_or_utf8_bytes_embed_alike(model):
  texts = ['a red cat', 'the small blue bird']
  want = model.encode_text(texts)
  for given in ([t.encode('utf-8') for t in texts],
                [np.str_(t) for t in texts]):
    for got, ref in zip(model.encode_text(given), want):
      np.testing.assert_array_equal(got, ref)
  # One str is one caption, as before.
  np.testing.assert_array_equal(model.encode_text(texts[0])[0], want[0][:1])


def test_an_input_error_is_one_line_on_the_command_line(model, capfd):
  status = errors.cli_main(lambda: model.encode_image([b'junk']), ['x'])
  assert status == errors.EXIT_USER_ERROR
  err = capfd.readouterr().err
  assert err.strip().splitlines() == [
      'error: image 0: cannot decode the 4 bytes given as an image '
      '(UnidentifiedImageError).'], err


# ----------------------------------------------------------------------------
# 4. Damaged exports and snapshots


def _write_export(out, params, tok_path, with_manifest=True):
  """An export as tools/export_pytorch.py writes one (config.json with the
  project's key, model.safetensors, tokenizer.model, manifest), built from
  the library's own pieces."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(out)
  save_file(convert.params_to_state_dict(params, TINY),
            os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'})
  cfg = convert.config_json(TINY, {
      'tokenizer_file': 'tokenizer.model',
      checkpoint.TOKENIZER_SHA256: file_sha256(tok_path)})
  with open(os.path.join(out, 'config.json'), 'w') as f:
    json.dump(cfg, f)
  shutil.copyfile(tok_path, os.path.join(out, 'tokenizer.model'))
  if with_manifest:
    manifest.write(out)
  return str(out)


@pytest.fixture(scope='module')
def exports(tmp_path_factory, params, tok_path):
  """Pristine exports of ``params``, with and without a manifest; tests
  damage copies."""
  root = tmp_path_factory.mktemp('exports')
  return {m: _write_export(str(root / f'manifest_{m}'), params, tok_path, m)
          for m in (True, False)}


def _copy(src, tmp_path):
  dst = str(tmp_path / os.path.basename(src))
  shutil.copytree(src, dst)
  return dst


def test_an_export_without_a_manifest_still_loads_the_same_model(
    exports, params, model):
  """A hand-made or released snapshot has no manifest: it must keep
  loading, with exactly the parameters it was written from and the same
  token ids."""
  loaded = prolip_jax.load(exports[False])
  flat = jax.tree_util.tree_flatten_with_path
  for (pa, a), (pb, b) in zip(flat(loaded.params)[0], flat(params)[0],
                              strict=True):
    assert pa == pb
    np.testing.assert_array_equal(np.asarray(a), b)
  texts = ['a red cat', 'two dogs of the small bird']
  np.testing.assert_array_equal(loaded.tokenizer(texts),
                                model.tokenizer(texts))


def _truncate(path, keep):
  data = open(path, 'rb').read()
  with open(path, 'wb') as f:
    f.write(data[:keep(len(data))])


@pytest.mark.parametrize('keep', [
    lambda n: n // 2, lambda n: n - 1, lambda n: 5, lambda n: 0])
def test_truncated_weights_without_a_manifest_are_one_line(exports, tmp_path,
                                                           keep):
  out = _copy(exports[False], tmp_path)
  weights = os.path.join(out, 'model.safetensors')
  _truncate(weights, keep)
  with pytest.raises(hub.SnapshotContentError) as e:
    prolip_jax.load(out)
  line = _one_line_user_error(e)
  assert line.startswith(f'{weights} ({os.path.getsize(weights)} bytes) is '
                         'not a whole safetensors file'), line
  assert 'truncated or damaged' in line
  assert isinstance(e.value, errors.CheckpointError)


@pytest.mark.parametrize('content,expected', [
    ('[1, 2]', 'holds a JSON array, not the object of a model config'),
    ('null', 'holds a JSON null'),
    ('"text"', 'holds a JSON string'),
    ('{not json', 'cannot read'),
    # Valid JSON of defaults only (open_clip's ViT-B/16): not these weights.
    ('{}', 'does not fit'),
    ('{"embed_dim": "x"}', 'does not fit'),
    ('{"vision_cfg": [1]}', 'is not a model config this project can build'),
    ('{"prolip_jax": [1]}', "its 'prolip_jax' entry is a list"),
])
def test_a_config_json_that_is_no_model_config_is_one_line(
    exports, tmp_path, content, expected):
  out = _copy(exports[False], tmp_path)
  cfg = os.path.join(out, 'config.json')
  with open(cfg, 'w') as f:
    f.write(content)
  with pytest.raises(hub.SnapshotError) as e:
    prolip_jax.load(out)
  line = _one_line_user_error(e)
  assert expected in line and cfg in line, line


@pytest.mark.parametrize('damage', ['truncate', 'flip_bit', 'config_list'])
def test_damage_to_an_export_with_a_manifest_is_caught_by_it(
    exports, tmp_path, damage):
  out = _copy(exports[True], tmp_path)
  if damage == 'truncate':
    _truncate(os.path.join(out, 'model.safetensors'), lambda n: n // 2)
  elif damage == 'flip_bit':
    data = bytearray(open(os.path.join(out, 'model.safetensors'), 'rb').read())
    data[-100] ^= 0x10
    open(os.path.join(out, 'model.safetensors'), 'wb').write(bytes(data))
  else:
    open(os.path.join(out, 'config.json'), 'w').write('[1, 2]')
  with pytest.raises(manifest.ExportIncompleteError) as e:
    prolip_jax.load(out)
  assert 'differs from the manifest' in _one_line_user_error(e)


def test_evaluate_of_a_damaged_export_is_one_line_in_process(
    exports, tmp_path, capfd):
  out = _copy(exports[False], tmp_path)
  _truncate(os.path.join(out, 'model.safetensors'), lambda n: n // 2)
  status = evaluate.command(['evaluate', f'--workdir={out}'])
  err = capfd.readouterr().err
  assert status == errors.EXIT_USER_ERROR, err
  lines = [l for l in err.splitlines() if l.startswith('error: ')]
  assert len(lines) == 1 and 'not a whole safetensors file' in lines[0], err
  assert 'Traceback' not in err


def _env():
  env = dict(os.environ)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env['XLA_FLAGS'] = xla_flags(1)
  env['JAX_PLATFORMS'] = 'cpu'
  env.pop('PROLIP_DEBUG', None)
  return env


@pytest.fixture(scope='module')
def damaged_exports(tmp_path_factory, exports):
  """Damaged copies of the manifest-less export for the command line."""
  root = tmp_path_factory.mktemp('damaged')
  out = {}
  for name in ('truncated', 'config_list', 'config_empty'):
    out[name] = str(root / name)
    shutil.copytree(exports[False], out[name])
  _truncate(os.path.join(out['truncated'], 'model.safetensors'),
            lambda n: n - 7)
  open(os.path.join(out['config_list'], 'config.json'), 'w').write('[1,2]')
  open(os.path.join(out['config_empty'], 'config.json'), 'w').write('{}')
  return out


@pytest.mark.slow
@pytest.mark.parametrize('name,expected', [
    ('truncated', 'is not a whole safetensors file'),
    ('config_list', 'holds a JSON array'),
    ('config_empty', 'does not fit'),
])
def test_evaluate_command_line_of_a_damaged_export_is_one_line(
    damaged_exports, name, expected):
  proc = subprocess.run(
      [sys.executable, '-m', 'prolip_jax.evaluate',
       f'--workdir={damaged_exports[name]}'], cwd=REPO, env=_env(),
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error: ')]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert expected in lines[0] and damaged_exports[name] in lines[0], lines
  assert 'Traceback' not in proc.stderr


# ----------------------------------------------------------------------------
# 5. Finite weights, non-finite embeddings


def _overflowing(params):
  """``params`` with a finite but huge final image layer-norm scale: the
  image embeddings overflow to NaN/inf; every parameter stays finite."""
  bad = jax.tree.map(np.array, params)
  bad['visual']['ln_post']['scale'][:] = 3e38
  return bad


def test_load_refuses_finite_weights_that_embed_as_nan(params, tok_path,
                                                       tmp_path):
  bad = _overflowing(params)
  load_lib.require_finite(bad, 'x')  # finite: the old check passes
  mu, _ = load_lib.LoadedModel(TINY, bad, Tokenizer(tok_path, 12)).image_fn(
      np.full((1, 16, 16, 3), 128, np.uint8))
  assert not np.all(np.isfinite(np.asarray(mu)))  # the premise, directly
  out = _write_export(str(tmp_path / 'bad'), bad, tok_path)
  with pytest.raises(errors.NonFiniteParamsError) as e:
    prolip_jax.load(out)
  line = _one_line_user_error(e)
  assert f'the snapshot {out} embeds' in line and 'image mean' in line, line
  assert 'text' not in line.split('in its')[1]  # the text tower is fine


def test_the_probe_is_compiled_once_per_architecture(exports):
  """Loading the same kind of model again does not compile the probe
  again (it takes the parameters as an argument)."""
  prolip_jax.load(exports[False])
  fn = load_lib._probe_fn(prolip_jax.load(exports[False]))
  size = fn._cache_size()
  prolip_jax.load(exports[True])
  assert fn._cache_size() == size


# ----------------------------------------------------------------------------
# 6. A checkpoint rotated away while it is read


def _run_config():
  c = presets.base_config()
  c.model = ml_collections.ConfigDict(TINY.to_dict())
  return json.loads(c.to_json_best_effort())


def _save_step(workdir, step, params, tok_path, keep):
  """Writes ``params`` as checkpoint ``step`` the way a training run keeping
  ``keep`` checkpoints does: Orbax deletes the older steps. (No checksums in
  the meta, as before they existed: computing them compiles for seconds and
  the rotation does not depend on them.)"""
  meta = {'step': step, 'config': _run_config(), 'model': TINY.to_dict(),
          'has_opt_state': False,
          **checkpoint.tokenizer_meta(Tokenizer(tok_path, 12))}
  with checkpoint.manager(workdir, max_to_keep=keep) as mngr:
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)),
              force=True)
    mngr.wait_until_finished()


@pytest.fixture
def training_workdir(tmp_path, tok_path):
  """A workdir at step 0, and a hook that makes every read of a step's meta
  first let 'training' write the next step and rotate the old one away
  (``keep_checkpoints=1``)."""
  wd = str(tmp_path / 'wd')
  _save_step(wd, 0, tiny_params(0), tok_path, keep=1)
  shutil.copyfile(tok_path, os.path.join(wd, checkpoint.TOKENIZER_FILE))
  return wd


def _rotate_on_read(monkeypatch, wd, tok_path, times):
  real = checkpoint.read_meta
  written = []

  def read_meta(mngr, step):
    if len(written) < times:
      new = step + 1
      _save_step(wd, new, tiny_params(new), tok_path, keep=1)
      written.append(new)
    return real(mngr, step)

  monkeypatch.setattr(checkpoint, 'read_meta', read_meta)
  return written


def test_a_step_rotated_away_mid_read_is_read_again_at_the_newest(
    training_workdir, tok_path, monkeypatch, capfd):
  written = _rotate_on_read(monkeypatch, training_workdir, tok_path, times=1)
  loaded = prolip_jax.load(training_workdir)
  assert written == [1]
  for got, want in zip(jax.tree.leaves(loaded.params),
                       jax.tree.leaves(tiny_params(1))):
    np.testing.assert_array_equal(np.asarray(got), want)
  err = capfd.readouterr().err
  assert 'step 0' in err and 'removed while it was being read' in err, err
  assert 'cannot be read' not in err and 'unreadable' not in err, err
  assert not os.path.exists(os.path.join(training_workdir,
                                         checkpoint.UNREADABLE_DIR))


def test_a_step_rotated_away_twice_says_try_again(training_workdir, tok_path,
                                                  monkeypatch, capfd):
  _rotate_on_read(monkeypatch, training_workdir, tok_path, times=2)
  with pytest.raises(errors.CheckpointError) as e:
    prolip_jax.load(training_workdir)
  line = _one_line_user_error(e)
  assert 'step 1' in line and 'removed while it was being read' in line
  assert line.endswith('try again') and 'no readable' not in line, line
  assert 'cannot be read' not in capfd.readouterr().err
  assert not os.path.exists(os.path.join(training_workdir,
                                         checkpoint.UNREADABLE_DIR))


def test_a_damaged_step_is_still_reported_as_unreadable(training_workdir,
                                                       capfd):
  """Only a step that vanished is called removed: garbled bytes are still
  'cannot be read', as before."""
  step_dir = os.path.join(training_workdir, 'checkpoints', '0', 'params')
  for root, _, files in os.walk(step_dir):
    for name in files:
      if name not in ('_METADATA', '_sharding', 'manifest.ocdbt'):
        full = os.path.join(root, name)
        with open(full, 'r+b') as f:
          f.truncate(max(0, os.path.getsize(full) // 2))
  with pytest.raises(errors.CheckpointError) as e:
    prolip_jax.load(training_workdir)
  assert 'removed while' not in str(e.value)
  err = capfd.readouterr().err
  assert 'cannot be read' in err and 'removed while' not in err, err
