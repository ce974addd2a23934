"""Paraphrase pools: captions whose level cannot be read from
their form, training phrasings drawn per example, validation phrasings that
training never sees, and the default ('templates') unchanged."""

from __future__ import annotations

import collections
import hashlib
import json

import ml_collections
import numpy as np
import pytest

from prolip_jax import errors
from prolip_jax.data import digits
from prolip_jax.data import emoji
from prolip_jax.data import paraphrases
from prolip_jax.data import pipeline
from prolip_jax.data import sources
from prolip_jax.data import transforms
from prolip_jax.data.sources import digits as digits_source
from prolip_jax.evaluation import sets

# sha256 (first 16 hex digits) of json.dumps of today's output, taken on the
# code before the paraphrase pools existed: the default must not move.
BEFORE = {
    'digits captions train': '887954bf65e7eee4',
    'digits captions heldout': '6c33a69e95357efa',
    'emoji captions train': '39eea50000ff25c3',
    'emoji captions heldout': 'c8b112023c23cf60',
    'digits corpus': '10e3522bf86f7df3',
    'emoji corpus train': '1e87e1344e93482d',
    'emoji corpus fit': 'dbec5dce018b64f1',
}


def _digest(x) -> str:
  return hashlib.sha256(json.dumps(x).encode()).hexdigest()[:16]


def _frame(caption: str, content: str) -> str:
  """The caption with its content words replaced by '{}' (the form)."""
  at = caption.rfind(content)
  assert at >= 0, (caption, content)
  return caption[:at] + '{}' + caption[at + len(content):]


def _digit_contents(n=40):
  images, labels = digits.split('train')
  idx = np.linspace(0, len(labels) - 1, n).astype(int)
  images, labels = images[idx], labels[idx]
  measured = digits._measured(images, labels)  # pylint: disable=protected-access
  return images, labels, [digits.level_contents(a) for a in measured]


def _cases():
  """(dataset, per-item level contents, training pools, validation pools)."""
  items = emoji.split('train')[::50]
  yield ('emoji', [emoji.level_contents(c) for c in items],
         emoji.paraphrase_pools_for(items, 'training'),
         emoji.paraphrase_pools_for(items, 'validation'))
  images, labels, contents = _digit_contents()
  yield ('digits', contents,
         digits.paraphrase_pools_for(images, labels, 'training'),
         digits.paraphrase_pools_for(images, labels, 'validation'))


@pytest.mark.parametrize('case', list(_cases()), ids=lambda c: c[0])
def test_pools_sizes_shared_phrasings_and_disjoint_splits(case):
  _, contents, training, validation = case
  for content, train_pools, val_pools in zip(contents, training, validation):
    assert len(train_pools) == len(val_pools) == len(content) == 4
    frames = []
    for words, tr, va in zip(content, train_pools, val_pools):
      assert len(tr) + len(va) >= 8 and len(va) >= 3
      assert len(set(tr)) == len(tr) and len(set(va)) == len(va)
      assert not set(tr) & set(va)  # validation never trained on
      frames.append((collections.Counter(_frame(c, words) for c in tr),
                     collections.Counter(_frame(c, words) for c in va)))
    # The level cannot be read from the form: stripping the content words
    # leaves the same phrasings, as often, at every level (so all >= 3 of
    # them are shared by all levels).
    assert all(f == frames[0] for f in frames)
    assert len(frames[0][0]) + len(frames[0][1]) >= 8
  # Levels differ only in their content words, and they are nested.
  for content in contents:
    assert len(set(content)) == 4


def test_validation_phrasings_are_no_training_phrasing_nor_prompt():
  assert not set(paraphrases.TRAINING) & set(paraphrases.VALIDATION)
  prompts = {t.rstrip('.') for t in emoji.EVAL_TEMPLATES +
             emoji.NAME_TEMPLATES + digits.EVAL_TEMPLATES}
  assert not prompts & set(paraphrases.VALIDATION)


def test_default_captions_records_and_corpus_are_todays():
  now = {}
  for s in ('train', 'heldout'):
    now[f'digits captions {s}'] = _digest(digits.captions_for(*digits.split(s)))
    now[f'emoji captions {s}'] = _digest(emoji.captions_for(emoji.split(s)))
  now['digits corpus'] = _digest(digits.tokenizer_corpus())
  now['emoji corpus train'] = _digest(emoji.tokenizer_corpus('train'))
  now['emoji corpus fit'] = _digest(emoji.tokenizer_corpus('fit'))
  assert now == BEFORE
  # What records carry and the eval captions, at the defaults.
  assert _digest([r['captions'] for r in digits.records('train')]) == (
      BEFORE['digits captions train'])
  assert _digest(emoji.training_captions(emoji.split('train'))) == (
      BEFORE['emoji captions train'])
  assert digits.tokenizer_corpus('templates') == digits.tokenizer_corpus()
  data = digits_source.digits_data('heldout')
  assert _digest(data.captions) == BEFORE['digits captions heldout']
  assert data.name == 'digits-heldout'


def test_flat_caption_lists_draw_as_before():
  record = {'captions': ['a', 'b', 'c', 'd', 'e']}
  for seed in range(20):
    old = np.random.default_rng(seed)
    expected = record['captions'][int(old.integers(5))]
    rng = np.random.default_rng(seed)
    assert pipeline._caption(record, rng) == expected  # pylint: disable=protected-access
    # The rng is left where the old single draw left it.
    assert rng.integers(1 << 30) == old.integers(1 << 30)


class _RecordingTokenizer:
  """Stands in for the tokenizer: keeps every caption the pipeline draws."""

  def __init__(self):
    self.seen = []

  def __call__(self, text):
    self.seen.append(text)
    return np.zeros((1, 4), np.int32)


def test_paraphrase_training_draws_training_phrasings_per_example():
  config = ml_collections.ConfigDict({'data': {'name': 'digits',
                                               'captions': 'paraphrases'}})
  source, corpus = sources.train_source(config)
  images, labels = digits.split('train')
  assert [r['captions'] for r in source[:3]] == [
      list(p) for p in digits.paraphrase_pools_for(images[:3], labels[:3])]
  tok = _RecordingTokenizer()
  ds = pipeline.train_dataset(
      source, tokenizer=tok, image_size=16, global_batch_size=32, seed=0,
      augment=transforms.AugmentConfig())
  for step in range(4):
    ds[step]  # pylint: disable=pointless-statement
  assert len(tok.seen) == 128
  training = {c for r in source for pool in r['captions'] for c in pool}
  validation = {c for pools in digits.paraphrase_pools_for(
      images, labels, 'validation') for p in pools for c in p}
  assert set(tok.seen) <= training
  assert not set(tok.seen) & validation
  # Different phrasings across examples: most training phrasings and every
  # level turn up in 128 draws.
  level_of = {c: level for r in source
              for level, pool in enumerate(r['captions']) for c in pool}
  frame_of = {c: k for r in source for pool in r['captions']
              for k, c in enumerate(pool)}
  assert len({frame_of[c] for c in tok.seen}) >= 6
  assert {level_of[c] for c in tok.seen} == {0, 1, 2, 3}
  # The corpus: every training phrasing of the train split, no validation one.
  sentences = corpus()
  assert training <= set(sentences)
  assert not set(sentences) & validation
  starts = tuple(f[:-2] for f in paraphrases.VALIDATION)
  assert not any(s.startswith(starts) for s in sentences)


def test_emoji_paraphrase_corpus_has_no_validation_phrasing():
  sentences = emoji.tokenizer_corpus('fit', 'paraphrases')
  starts = tuple(f[:-2] for f in paraphrases.VALIDATION)
  assert not any(s.startswith(starts) for s in sentences)
  fit = emoji.split('fit')
  assert {c for pools in emoji.paraphrase_pools_for(fit) for p in pools
          for c in p} <= set(sentences)
  # Every group and subgroup in its training phrasings (as today's corpus
  # has every group and subgroup caption).
  for c in emoji.concepts()[::97]:
    contents = emoji.level_contents(c)
    assert set(paraphrases.pool(contents[1])) <= set(sentences)
    assert set(paraphrases.pool(contents[2])) <= set(sentences)


def _check_heldout_captions(captions, contents_of, level_of, levels):
  validation_frames = set(paraphrases.VALIDATION)
  for k, caps in enumerate(captions):
    contents = contents_of(k)
    frames = [_frame(c, contents[level_of[pos]]) for pos, c in
              enumerate(caps)]
    assert set(frames) <= validation_frames, frames
    # The hierarchy levels of one image share one phrasing: only the
    # content words differ.
    assert len({frames[j] for j in levels}) == 1
    assert frames[levels[0]] == paraphrases.VALIDATION[
        k % len(paraphrases.VALIDATION)]


def test_heldout_phrasings_eval_data_digits():
  default = digits_source.digits_data('heldout', per_class=3)
  data = digits_source.digits_data('heldout', per_class=3, phrasings='heldout')
  assert data.name == 'digits-heldout-heldout-phrasings'
  np.testing.assert_array_equal(data.images, default.images)
  assert len(data.captions[0]) == len(default.captions[0]) == len(
      data.level_names)
  idx = np.concatenate([np.flatnonzero(digits.split('heldout')[1] == c)[:3]
                        for c in range(10)])
  measured = digits._measured(*(a[idx] for a in digits.split('heldout')))  # pylint: disable=protected-access
  _check_heldout_captions(
      data.captions, lambda k: digits.level_contents(measured[k]),
      (0, 0, 0, 0, 1, 2, 3, 3), (0, 4, 5, 6))
  # The long caption is a second phrasing of the three-attribute level.
  assert all(c[6] != c[7] for c in data.captions)
  training = {c for pools in digits.paraphrase_pools_for(
      *(a[idx] for a in digits.split('heldout'))) for p in pools for c in p}
  assert not training & {c for caps in data.captions for c in caps}


def test_heldout_phrasings_eval_data_emoji(monkeypatch):
  # Only the captions are under test: skip drawing the glyphs.
  monkeypatch.setattr(emoji, 'images', lambda split, size: np.zeros(
      (len(emoji.split(split)), size, size, 3), np.uint8))
  cfg = ml_collections.ConfigDict({'data': 'emoji', 'phrasings': 'heldout'})
  data = sets.bundled_data(cfg)
  items = emoji.split('heldout')
  assert data.name == 'emoji-heldout-heldout-phrasings'
  assert data.level_names == emoji.LEVEL_NAMES
  assert data.templates == emoji.EVAL_TEMPLATES  # zero-shot unchanged
  _check_heldout_captions(
      data.captions, lambda k: emoji.level_contents(items[k]),
      (0, 1, 2, 3, 3), (1, 2, 3))
  assert data.captions[0][2] == 'a sketch of ' + ' '.join(
      items[0].subgroup.replace('-', ' ').split())
  training = {c for pools in emoji.paraphrase_pools_for(items) for p in pools
              for c in p}
  assert not training & {c for caps in data.captions for c in caps}
  default = sets.bundled_data(ml_collections.ConfigDict({'data': 'emoji'}))
  assert _digest(default.captions) == BEFORE['emoji captions heldout']


def test_bad_values_are_config_errors():
  for data in ({'name': 'digits', 'captions': 'paraphrase'},
               {'name': 'array_record', 'path': 'x', 'captions':
                'paraphrases'}):
    with pytest.raises(errors.ConfigError, match='data.captions'):
      sources.train_source(ml_collections.ConfigDict({'data': data}))
  with pytest.raises(errors.ConfigError, match='data.phrasings'):
    sets.bundled_data(ml_collections.ConfigDict(
        {'data': 'digits', 'phrasings': 'validation'}))


def test_study_configs_are_twins_at_one_budget():
  """The emoji study: ProLIP and its SigLIP twin differ only in what the
  objective needs; both train on 'fit' (the validation names held back)
  with the paraphrase pools, three times the demo's length."""
  from prolip_jax.config import help as config_help  # pylint: disable=g-import-not-at-top
  from prolip_jax import demos  # pylint: disable=g-import-not-at-top
  pro = demos.emoji_study_config('prolip')
  sig = demos.emoji_study_config('siglip')
  demo = demos.emoji_demo_config('prolip')
  for c in (pro, sig):
    assert (c.data.captions, c.data.split) == ('paraphrases', 'fit')
    assert c.total_steps == 3 * demo.total_steps
    assert c.optim.warmup_steps == c.total_steps // 10
  assert pro.loss.beta < demo.loss.beta  # closer to the paper's 1e-4
  flat_pro, flat_sig = config_help.flatten(pro), config_help.flatten(sig)
  differ = {k for k in flat_pro.keys() | flat_sig.keys()
            if flat_pro.get(k) != flat_sig.get(k)}
  allowed = ('objective', 'model.use_unc', 'loss.', 'optim.unc_lr_mult')
  assert differ and all(k.startswith(allowed) for k in differ), sorted(differ)
  for key in ('batch_size', 'seed', 'data.name', 'model.vision.width',
              'model.text.layers', 'model.embed_dim', 'optim.lr'):
    assert flat_pro[key] == flat_sig[key], key
  # The split the knobs were chosen on is never trained on.
  assert not {c.name for c in emoji.split('val')} & {
      c.name for c in emoji.split('fit')}
