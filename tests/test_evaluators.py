"""Evaluators of ``config.evals`` against dense single-device computations,
through TFDS's real code path (``tfds.testing.mock_data``), on 1 and 8
devices, in training and in ``python -m prolip_jax.evaluate``."""

import io
import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from PIL import Image

from prolip_jax import demos
from prolip_jax import errors
from prolip_jax import evaluate
from prolip_jax import sharding as shd
from prolip_jax.config import presets
from prolip_jax.data import emoji
from prolip_jax.data import eval_data
from prolip_jax.evaluation import encoders as encoders_lib
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import metrics as eval_metrics
from prolip_jax.evaluation import runner
from prolip_jax.evaluation import sets
from prolip_jax.interop import load as load_lib
from prolip_jax.storage import checkpoint

import support

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ('zero', 'one', 'two')
TEMPLATES = ('a photo of the number {}.', 'the digit {}.')


def _mesh(n):
  return shd.make_mesh({'data': -1, 'fsdp': 1}, devices=jax.devices()[:n])


def _run(model, cfg, n=8):
  """The metrics of the entry ``cfg`` (``evaluator.complete``) on
  ``model``'s encoders over ``n`` devices."""
  encoders = encoders_lib.from_loaded(model, _mesh(n))
  e = evaluator.kind_class(cfg.kind)(encoders, 'e', **cfg.to_dict())
  result = e.run(model.params, '', log=lambda _: None)
  assert result.skipped is None, result.skipped
  return result.metrics


def _digit_image(i: int, size: tuple[int, int], mode: str) -> Image.Image:
  rng = np.random.default_rng(i)
  x = rng.integers(0, 256, (size[1], size[0], 3), np.uint8)
  return Image.fromarray(x).convert(mode)


def _png(image: Image.Image) -> bytes:
  buf = io.BytesIO()
  image.save(buf, 'PNG')
  return buf.getvalue()


@pytest.fixture(scope='module')
def model(workdir):  # pylint: disable=redefined-outer-name
  return load_lib.load(workdir)


@pytest.fixture(scope='module')
def image_folder(tmp_path_factory):
  """3 class folders x 3 images of odd sizes and modes (RGB, L, P)."""
  root = tmp_path_factory.mktemp('zs_folder')
  for c, name in enumerate(NAMES):
    os.makedirs(root / name)
    for j, (size, mode) in enumerate(
        [((40, 36), 'RGB'), ((33, 50), 'L'), ((64, 48), 'P')]):
      _digit_image(10 * c + j, size, mode).save(root / name / f'{j}.png')
  return str(root)


def _dense_top1(model, files, labels, names, templates):
  """Top-1 by CSD and cosine, one device, through ``prolip_jax.load``'s own
  encoders and classifier (no sharding, no Grain)."""
  clf = model.zero_shot_classifier(names, templates)
  return {f'{m}_top1': float(np.mean(clf.predict(files, m) == labels))
          for m in ('csd', 'cosine')}


def test_zero_shot_folder_equals_dense_on_1_and_8_devices(model,
                                                          image_folder):
  cfg = evaluator.complete('digits_folder', {
      'kind': 'zero_shot', 'data': f'folder:{image_folder}',
      'templates': TEMPLATES, 'batch_size': 4, 'num_threads': 2})
  # Classes are the folders in sorted order (one, two, zero).
  names = sorted(NAMES)
  files = [os.path.join(image_folder, n, f'{j}.png') for n in names
           for j in range(3)]
  labels = np.repeat(np.arange(3), 3)
  results, embeddings = {}, {}
  for n in (1, 8):
    on_mesh = encoders_lib.from_loaded(model, _mesh(n))
    results[n] = _run(model, cfg, n)
    zs = sets.zero_shot_set(cfg)
    embeddings[n] = on_mesh.embed_images(model.params, zs.images, 4,
                                         num_threads=2)
  # The same embeddings (up to float reassociation) and identical metrics
  # whatever the device count; the padded last batch is dropped.
  np.testing.assert_allclose(embeddings[1].mu, embeddings[8].mu, atol=1e-5)
  np.testing.assert_array_equal(embeddings[8].labels, labels)
  assert results[1] == results[8]
  mu, logvar = model.encode_image(files)
  np.testing.assert_allclose(embeddings[8].mu, mu, atol=1e-5)
  np.testing.assert_allclose(embeddings[8].logvar, logvar, atol=1e-4)
  dense = _dense_top1(model, files, labels, names, TEMPLATES)
  for key, value in dense.items():
    assert results[8][key] == pytest.approx(value)
  assert set(results[8]) == {'csd_top1', 'csd_top5', 'cosine_top1',
                             'cosine_top5'}


def test_imagenet_synset_folder_is_labelled_in_ilsvrc_order(model, tmp_path):
  wnids = {'n01440764': 0, 'n01443537': 1, 'n15075141': 999}
  files, labels = [], []
  for wnid, label in wnids.items():
    os.makedirs(tmp_path / wnid)
    for j in range(2):
      path = tmp_path / wnid / f'ILSVRC2012_val_{label:05d}{j}.JPEG'
      _digit_image(label + j, (50, 40), 'RGB').save(path, 'JPEG')
      files.append(str(path))
      labels.append(label)
  templates = ('a photo of a {}.',)
  cfg = evaluator.complete('imagenet', {
      'kind': 'zero_shot', 'data': f'folder:{tmp_path}',
      'class_names': 'imagenet', 'templates': templates, 'batch_size': 8})
  zs = sets.zero_shot_set(cfg)
  assert len(zs.class_names) == 1000 and zs.class_names[999] == 'toilet paper'
  assert [zs.images.get(i) for i in range(6)] == list(zip(files, labels))
  got = _run(model, cfg)
  dense = _dense_top1(model, files, np.array(labels), zs.class_names,
                      templates)
  for key, value in dense.items():
    assert got[key] == pytest.approx(value)
  os.makedirs(tmp_path / 'not_a_synset')
  with pytest.raises(errors.DatasetUnavailableError, match='not_a_synset'):
    sets.zero_shot_set(cfg)


def test_retrieval_jsonl_equals_dense_recall(model, image_folder, tmp_path):
  lines = []
  captions = {}
  for c, name in enumerate(NAMES):
    for j in range(3):
      caps = [f'the digit {name}', f'a photo of a {name} number {j}']
      captions[f'{name}/{j}.png'] = caps
      lines.append(json.dumps({'image': f'{name}/{j}.png',
                               'captions': caps}))
  path = tmp_path / 'captions.jsonl'
  path.write_text('\n'.join(lines) + '\n')
  cfg = evaluator.complete('r', {'kind': 'retrieval',
                                 'data': f'jsonl:{path}',
                                 'images_dir': image_folder, 'batch_size': 8,
                                 'num_threads': 2})
  got = _run(model, cfg)
  files = [os.path.join(image_folder, k) for k in captions]
  texts = [t for caps in captions.values() for t in caps]
  owner = np.repeat(np.arange(len(files)), 2)
  img = model.encode_image(files)
  txt = model.encode_text(texts)
  for metric in ('csd', 'cosine'):
    want = eval_metrics.retrieval_recall(
        eval_metrics.similarity(img, txt, metric), owner, (1, 5, 10))
    for k, v in want.items():
      assert got[f'{metric}_{k}'] == pytest.approx(v)


# ---------------------------------------------------------------------------
# TFDS: the real tfds.builder / as_data_source path with mocked records.


@pytest.fixture
def tfds(monkeypatch):
  """tensorflow_datasets with its builders reporting prepared data; the
  records come from ``mock_data(as_data_source_fn=...)``, so TensorFlow
  itself is never imported (it would not share a process with PyTorch)."""
  tfds = pytest.importorskip('tensorflow_datasets')
  # mock_data leaves is_prepared() False; the evaluators check it first so
  # that an unprepared data set is one line, never a download.
  monkeypatch.setattr(tfds.core.DatasetBuilder, 'is_prepared',
                      lambda self: True)
  # COCO's builder declares its features with TensorFlow dtypes (a prepared
  # copy is read from its files without them): the same features, numpy.
  from tensorflow_datasets.object_detection import coco_captions  # pylint: disable=g-import-not-at-top

  def coco_info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(encoding_format='jpeg'),
        'image/id': np.int64,
        'captions': tfds.features.Sequence({'text': tfds.features.Text(),
                                            'id': np.int64})}))
  monkeypatch.setattr(coco_captions.CocoCaptions, '_info', coco_info)
  return tfds


def _fake_records(name: str, n: int) -> list[dict]:
  """Records shaped like TFDS's own (images left encoded by SkipDecoding)."""
  out = []
  for i in range(n):
    image = _png(_digit_image(100 + i, (48 + 3 * i, 40), 'RGB'))
    if name == 'coco_captions':
      text = np.array([f'a picture number {i} of things'.encode(),
                       f'caption {j} of image {i}'.encode()
                       if (j := i % 3) else b'   '], dtype=object)
      out.append({'image': image, 'image/id': i,
                  'captions': {'id': np.arange(2), 'text': text}})
    else:
      out.append({'image': image, 'label': (i * 37) % 1000,
                  'file_name': f'{i}.JPEG'})
  return out


def fake_as_data_source(builder, split, decoders=None, **kwargs):
  del split, kwargs
  assert decoders is not None and 'image' in decoders  # images left encoded
  return _fake_records(builder.name, 5)


def test_imagenet_through_tfds_mock_data_equals_dense(model, tfds):
  cfg = evaluator.complete('imagenet', {
      'kind': 'zero_shot', 'data': 'tfds:imagenet2012:validation',
      'templates': TEMPLATES, 'batch_size': 4, 'num_threads': 2})
  with tfds.testing.mock_data(as_data_source_fn=fake_as_data_source):
    got = _run(model, cfg)
  records = _fake_records('imagenet2012', 5)
  names = eval_data.metadata('imagenet')['classes']
  assert len(names) == 1000
  labels = np.array([r['label'] for r in records])
  assert len(set(labels)) == 5  # labels come with the images, in order
  dense = _dense_top1(model, [r['image'] for r in records], labels, names,
                      TEMPLATES)
  for key, value in dense.items():
    assert got[key] == pytest.approx(value)


def test_coco_captions_through_tfds_mock_data(model, tfds):
  cfg = evaluator.complete('coco', {'kind': 'retrieval',
                                    'data': 'tfds:coco_captions:test',
                                    'batch_size': 8})
  with tfds.testing.mock_data(as_data_source_fn=fake_as_data_source):
    rs = sets.retrieval_set(cfg)
    got = _run(model, cfg)
  records = _fake_records('coco_captions', 5)
  # Blank captions are dropped; the rest keep their image.
  texts = [t.decode().strip() for r in records
           for t in r['captions']['text'] if t.strip()]
  owner = [i for i, r in enumerate(records)
           for t in r['captions']['text'] if t.strip()]
  assert rs.captions == texts and list(rs.image_of_text) == owner
  img = model.encode_image([r['image'] for r in records])
  txt = model.encode_text(texts)
  want = eval_metrics.retrieval_recall(
      eval_metrics.similarity(img, txt, 'csd'), np.array(owner), (1, 5, 10))
  for k, v in want.items():
    assert got[f'csd_{k}'] == pytest.approx(v)


def test_unprepared_tfds_is_one_line_saying_how_to_prepare(tmp_path):
  pytest.importorskip('tensorflow_datasets')
  cfg = evaluator.complete('imagenet', {
      'kind': 'zero_shot', 'data': 'tfds:imagenet2012:validation',
      'data_dir': str(tmp_path)})
  reason = sets.available(cfg)
  assert reason and '\n' not in reason
  assert 'tfds build imagenet2012' in reason and str(tmp_path) in reason
  assert 'array_record' in reason
  with pytest.raises(errors.DatasetUnavailableError):
    sets.zero_shot_set(cfg)
  assert not os.listdir(tmp_path)  # nothing downloaded or written


@pytest.mark.parametrize('raw, message', [
    ({'kind': 'zero_shoot', 'data': 'folder:/x'}, "did you mean 'zero_shot'"),
    ({'kind': 'zero_shot'}, 'evals.e.data is required'),
    ({'kind': 'zero_shot', 'data': 'tfd:imagenet2012'}, "did you mean"),
    ({'kind': 'retrieval', 'data': 'jsonl:/x', 'templates': 'imagenet'},
     'not a setting of a retrieval evaluator'),
    # The bundled report is plain entries now: no 'suites' kind.
    ({'kind': 'suites', 'data': 'digits'},
     'evals.e.kind: .*expected one of .*uncertainty_report'),
    ({'kind': 'uncertainty_report', 'data': 'mnist'}, 'expected one of'),
    ({'kind': 'zero_shot', 'data': 'folder:/x', 'per_class': 5},
     'a setting of the bundled sets'),
    ({'kind': 'bprw', 'levels': (0, 1)}, 'not a setting of a bprw evaluator'),
    ({'kind': 'zero_shot', 'data': 'digits', 'batch_size': 0},
     'batch_size must be >= 1'),
    ({'kind': 'heldout', 'every_steps': -2}, 'every_steps must be >= -1'),
])
def test_bad_entries_are_config_errors(raw, message):
  with pytest.raises(errors.ConfigError, match=message):
    evaluator.complete('e', raw)
  with pytest.raises(errors.ConfigError, match=message):
    evaluator.entries({'ok': {'kind': 'heldout'}, 'e': raw})


def test_a_view_a_source_does_not_serve_names_the_sources_that_do():
  """The same registry as training's: each view lists its sources."""
  def entry(data):
    return ml_collections.ConfigDict({'data': data})
  with pytest.raises(errors.ConfigError, match=(
      r'jsonl data has no class labels \(zero-shot reads digits:, emoji:, '
      r'folder:, tfds:\)')):
    sets.zero_shot_set(entry('jsonl:/x.jsonl'))
  with pytest.raises(errors.ConfigError, match=(
      r'folder data has no captions \(retrieval reads array_record:, '
      r'digits:, emoji:, jsonl:, tfds:\)')):
    sets.retrieval_set(entry('folder:/x'))
  with pytest.raises(errors.ConfigError, match=(
      r'tfds data is not a bundled set \(this evaluator reads digits:, '
      r'emoji:\)')):
    sets.bundled_data(entry('tfds:cifar10'))
  with pytest.raises(errors.ConfigError, match=(
      r"expected one of array_record:\.\.\., digits:\.\.\., "
      r"emoji:\.\.\., folder:\.\.\., jsonl:\.\.\., tfds:\.\.\. "
      r"\(did you mean 'emoji'\?\)")):
    sets.parse('emoj:heldout')  # the mixture is training's alone
  assert sets.bundled() == ('digits', 'emoji')
  assert sets.available(entry('jsonl:/no/such.jsonl')) == (
      'jsonl:/no/such.jsonl: no file /no/such.jsonl')


def test_bundled_report_entries_share_the_top_level_settings():
  """configs/eval/digits.py: every entry reads ``data``, ``per_class``,
  ``batch_size``... by reference, so one override reaches all."""
  config = runner.load_config_file(runner.bundled_config_path('digits'))
  assert {n: e.kind for n, e in config.evals.items()} == {
      'zero_shot': 'zero_shot', 'retrieval': 'retrieval',
      'uncertainty': 'uncertainty_report', 'bprw': 'bprw',
      'traversal': 'traversal', 'filtering': 'filtering'}
  config.per_class = 3
  config.data = 'digits:val'
  config.batch_size = 7
  done = evaluator.entries(config.evals)
  assert sorted(done) == sorted(config.evals)
  for name, cfg in done.items():
    assert (cfg.per_class, cfg.data, cfg.batch_size) == (
        3, 'digits:val', 7), name
    assert sets.bundled_data(cfg).labels.shape == (30,), name
  emoji = runner.load_config_file(runner.bundled_config_path('emoji'))
  assert {e.data for e in emoji.evals.values()} == {'emoji:heldout'}
  assert sorted(evaluator.entries(emoji.evals)) == [
      'retrieval', 'traversal', 'uncertainty', 'zero_shot']


def test_checkpoint_evals_follow_the_training_data():
  def report(dataset):
    return runner.load_config_file(
        runner.bundled_config_path(dataset)).evals.to_dict()

  class Fake:
    run_config = {'data': {'name': 'emoji'}}
  # An emoji model without evals: the emoji report.
  assert runner.checkpoint_evals(Fake()).to_dict() == report('emoji')
  assert {e['data'] for e in report('emoji').values()} == {'emoji:heldout'}
  # A digits demo: its held-out evaluation plus the digits report.
  Fake.run_config = {'evals': presets.heldout_evals(every_steps=300),
                     'data': {'name': 'digits'}}
  evals = runner.checkpoint_evals(Fake())
  assert evals.to_dict() == {**report('digits'),
                             'eval': {'kind': 'heldout', 'every_steps': 300}}
  assert evals.zero_shot.data == 'digits:heldout'
  # The run's entry of a report's name is the run's.
  mine = {'kind': 'zero_shot', 'data': 'folder:/x'}
  Fake.run_config = {'evals': {'zero_shot': mine}, 'data': {'name': 'digits'}}
  assert runner.checkpoint_evals(Fake()).zero_shot.to_dict() == mine
  # Other training data: the run's own evals, none of a report.
  Fake.run_config = {'evals': {'imagenet': mine},
                     'data': {'name': 'array_record'}}
  assert runner.checkpoint_evals(Fake()).to_dict() == {'imagenet': mine}
  Fake.run_config = {'data': {'name': 'array_record'}}
  with pytest.raises(errors.ConfigError, match='declares no evaluators'):
    runner.checkpoint_evals(Fake())


@pytest.mark.slow
def test_b16_config_evaluators_on_mock_tfds(model, tfds, tmp_path):
  """The evaluators configs/prolip_b16.py declares (ImageNet with its 80
  templates, ImageNet-v2, COCO 5k, the uncertainty summary), run as
  declared on mocked TFDS records, with the tiny model in place of B/16."""
  config = presets.load_config_file(
      os.path.join(REPO, 'configs', 'prolip_b16.py'))
  assert sorted(config.evals) == ['coco', 'imagenet', 'imagenet_v2',
                                  'uncertainty']
  with tfds.testing.mock_data(as_data_source_fn=fake_as_data_source):
    summary = runner.run(model, ml_collections.ConfigDict(
        {'evals': config.evals}), str(tmp_path), log=lambda _: None)
  m = summary['metrics']
  for key in ('imagenet/csd_top1', 'imagenet/cosine_top5',
              'imagenet_v2/csd_top1', 'coco/csd_i2t_R@1',
              'coco/cosine_t2i_R@10', 'uncertainty/sigma2_img',
              'uncertainty/txt_more_uncertain_than_img'):
    assert key in m, key
  with open(tmp_path / 'imagenet.json') as f:
    assert len(json.load(f)['details']['templates']) == 80
  # The uncertainty summary equals sigma^2 recomputed from the model.
  records = _fake_records('coco_captions', 5)
  _, lv = model.encode_image([r['image'] for r in records])
  assert m['uncertainty/sigma2_img'] == pytest.approx(
      float(np.exp(lv).mean()), rel=1e-5)


@pytest.mark.slow
def test_training_runs_its_evaluators_and_skips_missing_data(tmp_path,
                                                            capfd):
  from prolip_jax.training import train  # pylint: disable=g-import-not-at-top
  cfg = support.micro_config(total_steps=4)
  cfg.evals = {
      'digits_zs': {'kind': 'zero_shot', 'data': 'digits:heldout',
                    'every_steps': 2, 'batch_size': 500},
      'imagenet': {'kind': 'zero_shot', 'data': 'tfds:imagenet2012',
                   'data_dir': str(tmp_path / 'tfds'), 'every_steps': 2}}
  workdir = str(tmp_path / 'run')
  summary = train.train_and_evaluate(cfg, workdir)
  out = capfd.readouterr().out
  assert 'Evaluator imagenet will not run: TFDS data set imagenet2012 is ' \
         'not prepared' in out
  assert 'digits_zs: csd_top1' in out
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(l) for l in f]
  steps = [r['step'] for r in rows if 'digits_zs/csd_top1' in r]
  assert steps == [2, 4]
  assert not any(k.startswith('imagenet/') for r in rows for k in r)
  assert summary['evals']['digits_zs/csd_top1'] == pytest.approx(
      [r for r in rows if r['step'] == 4 and 'digits_zs/csd_top1' in r][0]
      ['digits_zs/csd_top1'])
  # The same evaluator from the checkpoint, by `evaluate`, gives the same
  # numbers (its own evals; the missing one reported and skipped). A run on
  # the digits also gets the digits report, left out here.
  own = runner.checkpoint_evals(load_lib.load(workdir))
  assert {'digits_zs', 'imagenet', 'zero_shot', 'bprw'} <= set(own)
  assert own.digits_zs.to_dict() == cfg.evals.digits_zs.to_dict()
  lines = []
  again = evaluate.run(workdir, None, str(tmp_path / 'eval'),
                       log=lines.append, only=('digits_zs', 'imagenet'))
  assert again['metrics']['digits_zs/csd_top1'] == pytest.approx(
      summary['evals']['digits_zs/csd_top1'], abs=1e-6)
  assert any(l.startswith('[imagenet] skipped: TFDS data set') for l in lines)


@pytest.mark.slow
def test_evaluate_on_an_emoji_checkpoint_scores_the_emoji(workdir, tmp_path):  # pylint: disable=redefined-outer-name
  """``evaluate --workdir W`` with no other flag runs W's own evaluators
  and the emoji report: an emoji run's checkpoint is scored on the
  held-out emoji."""
  params, meta = checkpoint.load_params(workdir)
  emoji_dir = str(tmp_path / 'emoji_run')
  config = demos.emoji_demo_config()
  assert config.evals.to_dict() == presets.heldout_evals(every_steps=300)
  meta = dict(meta, config=config.to_dict())
  with checkpoint.manager(emoji_dir) as mngr:
    checkpoint.save(mngr, 1, params, {'unused': np.zeros(1, np.float32)},
                    meta, force=True)
    mngr.wait_until_finished()
  for name in os.listdir(workdir):
    if name.endswith('.model'):
      with open(os.path.join(workdir, name), 'rb') as f, open(
          os.path.join(emoji_dir, name), 'wb') as g:
        g.write(f.read())
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep +
             os.environ.get('PYTHONPATH', ''), JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = support.xla_flags(1)
  proc = subprocess.run(
      [sys.executable, '-m', 'prolip_jax.evaluate', '--workdir', emoji_dir],
      env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'emoji-heldout' in proc.stdout
  assert 'digits' not in proc.stdout
  with open(os.path.join(emoji_dir, 'eval', 'summary.json')) as f:
    summary = json.load(f)
  assert summary['kinds'] == {
      'eval': 'heldout', 'zero_shot': 'zero_shot', 'retrieval': 'retrieval',
      'uncertainty': 'uncertainty_report', 'traversal': 'traversal'}
  for key in ('eval/zeroshot_csd_top1', 'zero_shot/csd_top1',
              'retrieval/csd_i2t_R@1', 'uncertainty/spearman_level_sigma2',
              'traversal/inclusion_precision'):
    assert key in summary['metrics'], key
  with open(os.path.join(emoji_dir, 'eval', 'zero_shot.json')) as f:
    assert json.load(f)['details']['images'] == len(emoji.split('heldout'))
