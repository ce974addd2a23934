"""Weighted mixtures of training sources (``data.sources``, data/mixture.py):
Grain's interleave counted exactly, the batches' shares, hosts, resumption,
per-source metrics and the drift rule for the weights."""

import json
import os
import shutil

import grain
import jax
import numpy as np
import pytest

from prolip_jax import errors
from prolip_jax.config import drift as config_drift
from prolip_jax.config import keys as config_keys
from prolip_jax.config import presets
from prolip_jax.data import digits
from prolip_jax.data import mixture
from prolip_jax.data import pipeline
from prolip_jax.data import sources
from prolip_jax.data import transforms
from prolip_jax.storage import checkpoint
from prolip_jax.training import train
import support

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                          'configs')
RED = support.RED


def _tokens(text):
  """A stand-in tokenizer: the caption's first letter as the one token."""
  out = np.zeros((1, 4), np.int32)
  out[0, 0] = ord(text[0])
  return out


def _memory_source(letter, n):
  """``n`` records of 8x8 images whose caption starts with ``letter``."""
  return [{'image': np.full((8, 8, 3), i % 250, np.uint8),
           'caption': f'{letter}{i}'} for i in range(n)]


def _tagged(labels_weights, n):
  """The source index of each of the first ``n`` records of Grain's mix."""
  children = [grain.MapDataset.range(10**9).map(lambda _, i=i: i)
              for i in range(len(labels_weights))]
  mixed = grain.MapDataset.mix(children, list(labels_weights))
  return np.asarray([mixed[k] for k in range(n)])


@pytest.mark.parametrize('weights', [(0.7, 0.3), (1.0, 1.0, 1.0),
                                     (0.5, 0.2, 0.3), (0.013, 1.0, 7.7)])
def test_records_drawn_counts_grains_own_interleave(weights):
  tags = _tagged(weights, 1500)
  for n in (0, 1, 7, 333, 1000, 1500):
    np.testing.assert_array_equal(
        mixture.records_drawn(weights, n),
        np.bincount(tags[:n], minlength=len(weights)))
  # Grain's rounding: the smallest weight scaled to 100, the rest truncated.
  assert mixture.proportions((0.7, 0.3)) == (233, 100)


def _mixture(weights=(0.75, 0.25), sizes=(37, 11)):
  return mixture.Mixture(('a', 'b'), tuple(
      _memory_source(letter, n) for letter, n in zip('ab', sizes)), weights)


def _dataset(mix, process_index=0, process_count=1, batch=8):
  return pipeline.train_dataset(
      mix, tokenizer=_tokens, image_size=8, global_batch_size=batch,
      seed=3, augment=transforms.AugmentConfig(),
      process_index=process_index, process_count=process_count)


def test_mixed_batches_hold_the_weights_on_any_host_count_and_resume():
  mix, steps, batch = _mixture(), 12, 8
  ds = _dataset(mix)
  batches = [ds[i] for i in range(steps)]
  letters = np.concatenate([b['tokens'][:, 0] for b in batches])
  # Each batch's share of each source is exactly Grain's arithmetic.
  for i in range(1, steps + 1):
    got = [int(np.sum(letters[:i * batch] == ord(c))) for c in 'ab']
    np.testing.assert_array_equal(
        got, mixture.records_drawn(mix.weights, i * batch))
  # The batch's records are permuted: a source does not sit at fixed rows
  # (Grain's 300:100 interleave alone puts 'b' at 2 of the 8 rows, every
  # batch; masked copies take every 8th row).
  rows_of_b = {r for b in batches for r in np.flatnonzero(
      b['tokens'][:, 0] == ord('b'))}
  assert len(rows_of_b) > 2
  unpermuted = mixture.mixed_records(mix, seed=3)
  assert len({k % batch for k in range(steps * batch)
              if unpermuted[k]['caption'][0] == 'b'}) == 2
  # Within an epoch of a source no record repeats (it was shuffled, not
  # sampled with replacement): 'b' has 11 records, 24 drawn.
  b_caps = [int(t) for t in letters if t == ord('b')]
  assert len(b_caps) == 24
  # Two hosts read the same global batch, each its contiguous half.
  halves = [_dataset(mix, p, 2) for p in range(2)]
  for i in (0, 5, 11):
    for key in ('image', 'tokens', 'aug'):
      np.testing.assert_array_equal(
          np.concatenate([h[i][key] for h in halves]), batches[i][key])
  # A resumed read (a rebuilt dataset from step k) gives the same batches.
  resumed = pipeline.iterate_from(_dataset(_mixture()), 7, num_threads=1)
  for i in range(7, steps):
    got = next(resumed)
    for key in ('image', 'tokens', 'aug'):
      np.testing.assert_array_equal(got[key], batches[i][key])


def test_mixture_records_are_each_sources_permutation():
  mix = _mixture(sizes=(37, 11))
  records = mixture.mixed_records(mix, seed=3)
  n = 4 * 48
  caps = [records[k]['caption'] for k in range(n)]
  b = [c for c in caps if c[0] == 'b']
  # Every epoch of 11 draws of 'b' is a permutation of its 11 records.
  for start in range(0, len(b) - 10, 11):
    assert sorted(b[start:start + 11]) == sorted(f'b{i}' for i in range(11))
  # The two sources are shuffled with different seeds.
  assert mixture.source_seed(3, 'a') != mixture.source_seed(3, 'b')


def _config(**entries):
  c = presets.load_config_file(os.path.join(CONFIG_DIR, 'prolip_micro.py'))
  c.data.sources = entries
  c.mesh.num_devices = 1  # one device, whatever the host has
  return c


@pytest.mark.parametrize('entry,match', [
    ({'name': 'digits', 'weight': 0}, r'data\.sources\.x\.weight'),
    ({'name': 'digits', 'weight': 'lots'}, r'data\.sources\.x\.weight'),
    ({'name': 'digits'}, r'data\.sources\.x\.weight'),
    ({'name': 'digits', 'weight': 1.0, 'pth': 'a'}, 'pth'),
    ({'weight': 1.0}, 'no name'),
])
def test_a_bad_entry_is_a_one_line_config_error(entry, match):
  with pytest.raises(errors.ConfigError, match=match) as raised:
    sources.train_source(_config(x=entry, y={'name': 'digits',
                                              'weight': 1.0}))
  assert '\n' not in str(raised.value)


def test_drift_rules_weights_may_change_sources_may_not():
  stored = json.loads(_config(
      a={'name': 'digits', 'weight': 0.7},
      b={'name': 'digits', 'weight': 0.3}).to_json_best_effort())
  same = _config(b={'name': 'digits', 'weight': 0.3},
                 a={'name': 'digits', 'weight': 0.7})  # order is no change
  assert config_drift.check(stored, same, step=4) == []
  changed = _config(a={'name': 'digits', 'weight': 0.5},
                    b={'name': 'digits', 'weight': 0.3})
  assert config_drift.check(stored, changed, step=4) == [
      'data.sources.a.weight: 0.7 -> 0.5']
  # An entry's data.* fields keep their own rule: the TFDS folder may move
  # (as data.tfds_data_dir may), the shards may not change.
  moved = _config(a={'name': 'digits', 'weight': 0.7},
                  b={'name': 'digits', 'weight': 0.3,
                     'tfds_data_dir': '/elsewhere'})
  assert config_drift.check(stored, moved, step=4) == [
      "data.sources.b.tfds_data_dir: '<absent>' -> '/elsewhere'"]
  assert config_keys.fixed_reason('data.sources.b.path') == config_keys.DATA
  assert config_keys.meaning('data.sources.b.path') == config_keys.meaning(
      'data.path')
  # Adding a source, or turning a single-source run into a mixture, is not.
  added = _config(a={'name': 'digits', 'weight': 0.7},
                  b={'name': 'digits', 'weight': 0.3},
                  c={'name': 'digits', 'weight': 0.3})
  with pytest.raises(errors.ConfigDriftError, match=r'data\.sources\.c\.name'):
    config_drift.check(stored, added, step=4)
  single = json.loads(_config().to_json_best_effort())
  with pytest.raises(errors.ConfigDriftError, match='data.sources.a.name'):
    config_drift.check(single, changed, step=4)


def test_new_weights_continue_each_source_where_it_stopped():
  before = _mixture()
  history = mixture.continue_history(
      mixture.history_meta(before), ('a', 'b'), (0.5, 0.5), 40)
  assert history == ((0, (0.75, 0.25)), (40, (0.5, 0.5)))
  after = mixture.Mixture(before.labels, before.sources, (0.5, 0.5), history)
  old, new = (mixture.mixed_records(m, seed=3) for m in (before, after))
  n = 200
  old_caps = [old[k]['caption'] for k in range(n)]
  new_caps = [new[k]['caption'] for k in range(n)]
  assert new_caps[:40] == old_caps[:40]
  for letter in 'ab':  # each source's own order goes on, no jump
    mine = [c for c in new_caps if c[0] == letter]
    theirs = [c for c in old_caps if c[0] == letter]
    k = min(len(mine), len(theirs))
    assert mine[:k] == theirs[:k]
  # Counts: 30 + 10 before record 40, then half each of the 160 after.
  np.testing.assert_array_equal(mixture.drawn_so_far(after, n), [110, 90])
  np.testing.assert_array_equal(
      mixture.drawn_so_far(after, n),
      [sum(c[0] == letter for c in new_caps) for letter in 'ab'])
  # Resumed again later with the same weights: the same history; at the
  # very step of a change with yet other weights: that change replaced.
  stored = mixture.history_meta(after)
  assert mixture.continue_history(stored, ('a', 'b'), (0.5, 0.5),
                                  80) == history
  assert mixture.continue_history(stored, ('a', 'b'), (0.2, 0.8), 40) == (
      (0, (0.75, 0.25)), (40, (0.2, 0.8)))
  # Resumed from a checkpoint before the change: the change is forgotten.
  assert mixture.continue_history(stored, ('a', 'b'), (0.75, 0.25),
                                  24) == ((0, (0.75, 0.25)),)
  with pytest.raises(errors.ConfigError, match='mixed the sources'):
    mixture.continue_history(stored, ('a', 'c'), (0.5, 0.5), 80)


def _red_rows(batch):
  """Which rows of a host-cropped batch (no colour jitter) are red."""
  image = batch['image'].astype(np.int32)
  return (image[..., 0] - image[..., 1]).mean(axis=(1, 2)) > 100


def test_digits_and_array_record_mix_by_weight(tmp_path):
  cfg = _config(red={'name': 'array_record', 'weight': 0.3,
                     'path': support.red_shard(str(tmp_path))},
                digits={'name': 'digits', 'weight': 0.7, 'split': 'val'})
  source, _ = sources.train_source(cfg)
  assert source.labels == ('digits', 'red')
  assert len(source.sources[0]) == len(digits.split('val')[1])
  ds = pipeline.train_dataset(
      source, tokenizer=_tokens, image_size=16, global_batch_size=16,
      seed=0, augment=transforms.AugmentConfig(color_on_device=True))
  reds = sum(int(_red_rows(ds[i]).sum()) for i in range(6))
  assert reds == mixture.records_drawn((0.7, 0.3), 6 * 16)[1] == 28
  # The red source checks its records on its own; digits has no checking.
  assert set(source.source_stats()) == {'red'}
  assert source.stats()['seen'] == source.source_stats()['red']['seen'] > 0


def _assert_same_params(workdir_a, workdir_b):
  """The two workdirs' newest checkpoints hold bit-identical parameters."""
  params_a, _ = checkpoint.load_params(str(workdir_a))
  params_b, _ = checkpoint.load_params(str(workdir_b))
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_a_two_source_mixture_trains_resumes_exactly_and_counts(tmp_path,
                                                                capsys):
  """digits + a red array_record set through the real loop: a run stopped
  at step 2 and resumed ends bit-identical to the uninterrupted run, and
  metrics.jsonl counts each source's records as Grain mixes them; new
  weights on resume continue each source and resume exactly again."""
  cfg = _config(red={'name': 'array_record', 'weight': 0.25,
                     'path': support.red_shard(str(tmp_path / 'red'))},
                digits={'name': 'digits', 'weight': 0.75})
  cfg.total_steps = 4
  cfg.evals = {}
  full = train.train_and_evaluate(cfg, str(tmp_path / 'full'))
  part = train.train_and_evaluate(cfg, str(tmp_path / 'split'), max_steps=2)
  assert part['step'] == 2
  resumed = train.train_and_evaluate(cfg, str(tmp_path / 'split'))
  assert full['step'] == resumed['step'] == 4
  _assert_same_params(tmp_path / 'full', tmp_path / 'split')
  for run in ('full', 'split'):
    rows = [json.loads(l) for l in open(tmp_path / run / 'metrics.jsonl')]
    rows = [r for r in rows if 'loss' in r]
    assert [r['step'] for r in rows] == [1, 2, 3, 4]
    for r in rows:
      digits, red = mixture.records_drawn((0.75, 0.25), r['step'] * 16)
      assert (r['data/source_count/digits'],
              r['data/source_count/red']) == (digits, red)
      assert r['data/records_seen/red'] > 0
      assert r['data/bad_records/red'] == 0
  assert (rows[-1]['data/source_count/digits'],
          rows[-1]['data/source_count/red']) == (48, 16)
  # New weights on resume: applied from the resumed step, each source
  # continuing where it stopped; a run resumed again after the change (a
  # kill) reads the same batches.
  shutil.copytree(tmp_path / 'split', tmp_path / 'changed_twice')
  cfg.total_steps = 6
  cfg.data.sources.red.weight = 0.5
  cfg.data.sources.digits.weight = 0.5
  capsys.readouterr()
  train.train_and_evaluate(cfg, str(tmp_path / 'split'))
  assert ('Mixture from step 4 (record 64): a mixture of digits 50.00% '
          '(100/200), red 50.00% (100/200); each source continues where it '
          'stopped (records drawn so far: digits 48, red 16)'
          ) in capsys.readouterr().out
  train.train_and_evaluate(cfg, str(tmp_path / 'changed_twice'), max_steps=1)
  train.train_and_evaluate(cfg, str(tmp_path / 'changed_twice'))
  _assert_same_params(tmp_path / 'split', tmp_path / 'changed_twice')
  for run in ('split', 'changed_twice'):
    rows = [json.loads(l) for l in open(tmp_path / run / 'metrics.jsonl')]
    counts = {r['step']: (r['data/source_count/digits'],
                          r['data/source_count/red'])
              for r in rows if 'loss' in r}
    assert counts[5] == (48 + 8, 16 + 8) and counts[6] == (64, 32), run
