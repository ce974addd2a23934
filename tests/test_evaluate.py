"""Evaluation metrics vs brute force, and the eval command end to end."""

import ast
import functools
import importlib.util
import io
import json
import os
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest
from PIL import Image

from prolip_jax import embedding
from prolip_jax import evaluate
from prolip_jax.evaluation import cli as eval_cli
from prolip_jax.evaluation import encoders as eval_encoders
from prolip_jax.evaluation import metrics as eval_metrics
from prolip_jax.evaluation import report

from support import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(REPO, 'configs', 'eval', 'digits.py')


def eval_config(name='digits'):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(REPO, 'configs', 'eval', name + '.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# ---------------------------------------------------------------------------
# Metrics against loops.


def test_prompt_ensemble_is_class_major_and_averages_per_class():
  from prolip_jax.evaluation import prompts  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  names, templates = ['cat', 'dog', 'emu'], ['a {}.', 'the {}!']
  table = {f'{c}|{t}': (rng.normal(size=4), rng.normal(size=4))
           for c in names for t in templates}
  seen = []

  def embed(prompts):
    seen.append(list(prompts))
    keys = [next(k for k in table if k.split('|')[1].format(
        k.split('|')[0]) == p) for p in prompts]
    return (np.stack([table[k][0] for k in keys]),
            np.stack([table[k][1] for k in keys]))

  mu, lv = prompts.prompt_ensemble(embed, names, templates)
  assert seen == [[t.format(c) for c in names for t in templates]]
  assert mu.shape == lv.shape == (3, 2, 4)
  np.testing.assert_array_equal(mu[2, 1], table['emu|the {}!'][0])
  cls_mu, cls_var = prompts.class_ensemble(embed, names, templates)
  np.testing.assert_array_equal(cls_mu, eval_metrics.class_gaussians(mu, lv)[0])
  np.testing.assert_allclose(cls_var[0], np.exp(lv[0]).mean(0), rtol=1e-6)
  # A deterministic model: no variances.
  mu_only = prompts.class_ensemble(lambda p: (embed(p)[0], None), names,
                                   templates)
  assert mu_only[1] is None


def test_topk_accuracy_matches_loop():
  rng = np.random.default_rng(0)
  scores = rng.normal(size=(40, 7))
  labels = rng.integers(0, 7, 40)
  got = eval_metrics.topk_accuracy(scores, labels, ks=(1, 3, 5, 10))
  for k in (1, 3, 5, 10):
    hits = 0
    for row, y in zip(scores, labels):
      better = sum(1 for s in row if s > row[y])
      hits += better < k
    assert got[f'top{k}'] == pytest.approx(hits / 40)


def test_flat_hit_at_k_matches_loop():
  rng = np.random.default_rng(1)
  scores = rng.normal(size=(30, 8))
  label_sets = [list(rng.choice(8, rng.integers(1, 4), replace=False))
                for _ in range(30)]
  got = eval_metrics.flat_hit_at_k(scores, label_sets, ks=(1, 2, 5))
  for k in (1, 2, 5):
    hits = 0
    for row, labels in zip(scores, label_sets):
      ranked = sorted(range(8), key=lambda j: -row[j])[:k]
      hits += any(j in labels for j in ranked)
    assert got[f'flat_hit@{k}'] == pytest.approx(hits / 30)
  # One label per row: the same as top-k accuracy.
  single = [[s[0]] for s in label_sets]
  assert eval_metrics.flat_hit_at_k(scores, single, (1, 5)) == {
      'flat_hit@1': eval_metrics.topk_accuracy(scores, np.array(single)[:, 0],
                                           (1,))['top1'],
      'flat_hit@5': eval_metrics.topk_accuracy(scores, np.array(single)[:, 0],
                                           (5,))['top5']}


def test_retrieval_recall_matches_brute_force_with_several_captions():
  rng = np.random.default_rng(2)
  n_img = 12
  counts = rng.integers(1, 5, n_img)  # 1 to 4 captions per image
  owner = np.repeat(np.arange(n_img), counts)
  rng.shuffle(owner)
  scores = rng.normal(size=(n_img, len(owner)))
  # Make the task non-trivial but not random: a bonus for true pairs.
  scores[owner, np.arange(len(owner))] += 1.0
  got = eval_metrics.retrieval_recall(scores, owner, ks=(1, 5, 10))
  for k in (1, 5, 10):
    # i2t: any of the image's captions among its k best texts.
    hit = 0
    for i in range(n_img):
      ranked = sorted(range(len(owner)), key=lambda j: -scores[i, j])[:k]
      hit += any(owner[j] == i for j in ranked)
    assert got[f'i2t_R@{k}'] == pytest.approx(hit / n_img)
    # t2i: the caption's image among its k best images.
    hit = 0
    for j in range(len(owner)):
      ranked = sorted(range(n_img), key=lambda i: -scores[i, j])[:k]
      hit += owner[j] in ranked
    assert got[f't2i_R@{k}'] == pytest.approx(hit / len(owner))


def test_similarity_csd_and_cosine_by_hand():
  rng = np.random.default_rng(3)
  a = (rng.normal(size=(3, 4)), rng.normal(-2, 0.5, (3, 4)))
  b = (rng.normal(size=(5, 4)), rng.normal(-2, 0.5, (5, 4)))
  got = eval_metrics.similarity(a, b, 'csd')
  for i in range(3):
    for j in range(5):
      want = -(((a[0][i] - b[0][j]) ** 2).sum() + np.exp(a[1][i]).sum()
               + np.exp(b[1][j]).sum())
      assert got[i, j] == pytest.approx(want, rel=1e-5)
  cos = eval_metrics.similarity(a, b, 'cosine')
  want = a[0][1] @ b[0][2] / np.linalg.norm(a[0][1]) / np.linalg.norm(b[0][2])
  assert cos[1, 2] == pytest.approx(want, rel=1e-5)
  with pytest.raises(ValueError):
    eval_metrics.similarity((a[0], None), b, 'csd')


def test_embed_in_batches_tuple_inputs_and_progress():
  x = np.arange(10, dtype=np.float32)[:, None]
  y = np.arange(10, dtype=np.float32)[:, None] * 10
  calls = []
  mu, lv = embedding.embed_in_batches(
      lambda xy: (xy[0] + xy[1], xy[0] * 0), (x, y), 4,
      progress=lambda d, t: calls.append((d, t)))
  np.testing.assert_allclose(mu[:, 0], np.arange(10) * 11)
  assert lv.shape == (10, 1)
  assert calls == [(4, 10), (8, 10), (10, 10)]
  stream = io.StringIO()
  p = eval_encoders.Progress('x', stream=stream, interval=1e9)
  p(1, 3)
  p(3, 3)
  assert stream.getvalue().strip().splitlines()[-1].startswith('x: 3/3')


def test_format_table_in_trainings_units():
  # Fractions chosen so that each expected string is computed by hand:
  # 0.95 -> 95.0%, 0.9996 -> 100.0% (one decimal), R@k grouped.
  metrics = {
      'zero_shot/csd_top1': 0.95, 'zero_shot/cosine_top1': 0.947,
      'retrieval/csd_i2t_R@1': 0.4, 'retrieval/csd_i2t_R@5': 0.8125,
      'retrieval/csd_i2t_R@10': 0.9996,
      'retrieval/cosine_t2i_R@1': 0.25, 'retrieval/cosine_t2i_R@5': 0.5,
      'uncertainty/sigma2_per_dim_img_mean': 0.165 / 64,
      'uncertainty/sigma2_trace_img_mean': 0.165,
      'uncertainty/txt_more_uncertain_than_img': 0.996,
      'uncertainty/spearman_level_sigma2': -0.6012,
      'uncertainty/inclusion_positive/image_75pct_patches_dropped': 1.0,
      'bprw/fewshot5_top1': 0.937,
      'traversal/null_root_R@1': 0.1,
      'filtering/auc': 0.9712, 'filtering/total': 1000,
      'other/new_metric': 1e-4,
  }
  # The kinds of the bundled report's entries (configs/eval/digits.py):
  # each entry's rows follow its kind's rules.
  kinds = {name: e.kind for name, e in eval_config().evals.items()}
  assert kinds['uncertainty'] == 'uncertainty_report'
  table = report.format_table(metrics, kinds=kinds)
  lines = table.splitlines()
  assert lines[0].split() == ['suite', 'metric', 'value']
  rows = {}
  for line in lines[2:-1]:
    suite, rest = line.split(None, 1)
    label, value = rest.rsplit('  ', 1)
    rows[(suite, label.strip())] = value.strip()
  assert rows == {
      # The labels training's summary uses (report.format_summary).
      ('zero_shot', 'zero-shot top-1, CSD'): '95.0%',
      ('zero_shot', 'zero-shot top-1, cosine'): '94.7%',
      ('retrieval', 'retrieval image -> text R@1/5/10, CSD'):
          '40.0% / 81.2% / 100.0%',
      ('retrieval', 'retrieval text -> image R@1/5, cosine'): '25.0% / 50.0%',
      ('uncertainty', 'mean sigma^2 per dimension, images'): '2.58e-3',
      ('uncertainty', 'mean sigma^2 = tr(Sigma) (trace), images'): '0.165',
      ('uncertainty', 'caption sigma^2 > its image sigma^2'): '99.6%',
      ('uncertainty', 'Spearman(level, sigma^2)'): '-0.60',
      ('uncertainty', 'H(orig in view) > 0, image, 75% patches dropped'):
          '100.0%',
      ('bprw', 'top-1, 5-shot EM weights'): '93.7%',
      ('traversal', 'empty-caption [ROOT] R@1'): '10.0%',
      ('filtering', 'AUC, original vs shuffled pairs'): '0.971',
      ('filtering', 'pairs scored'): '1,000',
      ('other', 'new_metric'): '1.00e-4',  # no rule: its key, a number
  }
  assert 'fractions' in lines[-1]
  # The row order follows the metrics (recalls at their first R@k).
  assert [l.split()[0] for l in lines[2:5]] == ['zero_shot', 'zero_shot',
                                                'retrieval']
  # The rules follow the kind, not the name: an entry named 'sigma' of kind
  # uncertainty_report, one named 'digits' of kind zero_shot.
  table = report.format_table(
      {'sigma/spearman_level_sigma2': -0.6012, 'digits/csd_top1': 0.95},
      notes=False, kinds={'sigma': 'uncertainty_report',
                          'digits': 'zero_shot'})
  assert [l.split('  ')[0] for l in table.splitlines()[2:]] == ['sigma',
                                                                'digits']
  assert 'Spearman(level, sigma^2)' in table and '-0.60' in table
  assert 'zero-shot top-1, CSD' in table and '95.0%' in table


def test_format_table_uses_the_training_summarys_percentages():
  train = report.format_summary({
      'step': 1, 'checkpoint': 'c', 'eval': {'zeroshot_csd_top1': 0.9473}})
  table = report.format_table({'zero_shot/csd_top1': 0.9473})
  line = [l for l in train.splitlines() if 'zero-shot top-1, CSD' in l][0]
  assert line.split()[-1] == table.splitlines()[2].split()[-1] == '94.7%'


def test_the_next_commands_are_shell_quoted():
  """Issue 45, finding 19: pasted into a shell, the printed commands keep a
  workdir with spaces (and a quote) as one argument."""
  workdir = "/tmp/my runs/bob's run"
  text = report.format_summary({'step': 1, 'checkpoint': 'c', 'eval': {},
                                'workdir': workdir})
  lines = [l for l in text.splitlines() if 'prolip_jax.evaluate' in l or
           'export_pytorch.py' in l]
  assert len(lines) == 2
  evaluate_args = shlex.split(lines[0].split('Next:', 1)[1])
  assert evaluate_args == ['python', '-m', 'prolip_jax.evaluate',
                           '--workdir', workdir]
  export_args = shlex.split(lines[1])
  assert export_args == ['python', 'tools/export_pytorch.py', '--workdir',
                         workdir, '--out', workdir + '/export']


def test_evaluate_out_holding_a_users_files_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch):
  """Issue 45, finding 1: ``--out`` holding a user's summary.json and
  zero_shot.json is refused in one line before the model is loaded; the
  files stay as they were."""
  from prolip_jax.interop import load as load_lib  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'mine'
  out.mkdir()
  (out / 'summary.json').write_text('{"acc": 0.91}')
  (out / 'zero_shot.json').write_text('{"top1": 0.5}')
  loads = []
  monkeypatch.setattr(load_lib, 'load', lambda *a, **k: loads.append(a))
  status = evaluate.command(['evaluate', '--workdir', str(tmp_path / 'w'),
                             '--out', str(out)])
  err = capsys.readouterr().err
  assert status == 2 and not loads
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1, err
  assert lines[0].startswith(f'error: --out {out} is not an evaluation '
                             'report of ours: it holds summary.json, '
                             'zero_shot.json'), lines[0]
  assert (out / 'summary.json').read_text() == '{"acc": 0.91}'
  assert (out / 'zero_shot.json').read_text() == '{"top1": 0.5}'
  assert sorted(os.listdir(out)) == ['summary.json', 'zero_shot.json']


def test_a_report_lists_its_files_and_is_written_again_over_them(
    tmp_path, monkeypatch):
  """The report's record lists every file it wrote (before copying them),
  so a second report replaces them; a file added by the user is refused;
  a report from before the record is recognised by its summary.json."""
  from prolip_jax import errors  # pylint: disable=g-import-not-at-top
  from prolip_jax.evaluation import runner  # pylint: disable=g-import-not-at-top
  from prolip_jax.storage import owned  # pylint: disable=g-import-not-at-top

  def fake_run(model, config, out_dir, log, only, tfds_data_dir):
    del model, config, log, tfds_data_dir
    files = []
    for name in only:
      files.append(os.path.join(out_dir, f'{name}.json'))
      with open(files[-1], 'w') as f:
        json.dump({'run': name}, f)
    return {'metrics': {f'{n}/x': 1.0 for n in only}, 'figures': [],
            'files': files, 'skipped': {}, 'kinds': {}}

  monkeypatch.setattr(runner, '_run', fake_run)
  out = tmp_path / 'report'
  summary = runner.run(object(), out_dir=str(out), log=lambda s: None,
                       only=('zero_shot', 'retrieval'))
  assert sorted(summary['files']) == sorted(
      str(out / n) for n in ('zero_shot.json', 'retrieval.json',
                             'summary.json'))
  record = json.loads((out / owned.REPORT_RECORD).read_text())['files']
  assert record == ['retrieval.json', 'summary.json', 'zero_shot.json']
  # Again, one evaluator: its file replaced, the other report file kept;
  # a file cut short by a kill in a whole-file write is no user's.
  (out / '.summary.json.partial-x1').write_text('{')
  runner.run(object(), out_dir=str(out), log=lambda s: None,
             only=('zero_shot',))
  assert json.loads((out / 'summary.json').read_text())['metrics'] == {
      'zero_shot/x': 1.0}
  assert json.loads((out / owned.REPORT_RECORD).read_text())['files'] == (
      record)
  (out / 'notes.txt').write_text('mine')
  with pytest.raises(errors.UserError, match='it holds notes.txt'):
    runner.run(object(), out_dir=str(out), log=lambda s: None,
               only=('zero_shot',))
  assert (out / 'notes.txt').read_text() == 'mine'
  # A report from before the record: its summary.json lists its files.
  legacy = tmp_path / 'legacy'
  legacy.mkdir()
  (legacy / 'zero_shot.json').write_text('{}')
  (legacy / 'summary.json').write_text(json.dumps(
      {'metrics': {}, 'figures': [],
       'files': [str(legacy / 'zero_shot.json')]}))
  runner.run(object(), out_dir=str(legacy), log=lambda s: None,
             only=('zero_shot',))
  assert json.loads((legacy / 'zero_shot.json').read_text()) == {
      'run': 'zero_shot'}


def test_evaluate_help_lists_the_commands_flags(capsys):
  assert evaluate.command(['evaluate', '--help']) == 0
  out = capsys.readouterr().out
  for flag in ('--workdir', '--config', '--out', '--step', '--evals',
               '--tfds_data_dir', '--config.KEY=VALUE', '--config.per_class'):
    assert flag in out, flag
  assert 'Try --helpfull' not in out


@pytest.mark.parametrize('args, message', [
    ([], '--workdir is required'),
    (['--workdir=w', '--config=/no/such.py'], "'/no/such.py' not found"),
    (['--workdir=w', f'--config={DIGITS}', '--config.no_such_key=1'],
     "unknown config key 'no_such_key'"),
    (['--workdir=w', f'--config={DIGITS}', '--config.batch_size=x'],
     'batch_size'),
    (['--workdir=w', '--config.batch_size=8'], 'overrides need --config'),
    (['--workdir=w', '--bogus'], "Unknown command line flag 'bogus'"),
])
def test_evaluate_flag_errors_are_one_line(args, message):
  from prolip_jax import errors  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.UserError, match=message.replace('(', r'\(')):
    eval_cli.parse(['evaluate'] + args)


def test_evaluate_misspelt_key_is_one_clean_line_with_the_nearest(capsys):
  status = evaluate.command(['evaluate', '--workdir=w', f'--config={DIGITS}',
                         '--config.per_clas=20'])
  assert status == 2
  err = capsys.readouterr().err
  assert err == (f"error: unknown config key 'per_clas' (did you mean "
                 f"'per_class'?); {DIGITS} lists the keys\n"), err


@pytest.mark.parametrize('example', eval_cli.EXAMPLES)
def test_the_help_examples_parse_as_written(example):
  """Each override example of --help, pasted after --workdir, parses and
  sets what it says."""
  args = shlex.split(example)
  fv = eval_cli.parse(['evaluate', '--workdir=w', *args])
  if args[-1].startswith('--evals='):  # entries of the config, picked
    names = args[-1][len('--evals='):].split(',')
    assert fv.evals == names and set(names) <= set(fv.config.evals)
    return
  key, value = args[-1][len('--config.'):].split('=', 1)
  node = fv.config
  for part in key.split('.'):
    node = node[part]
  assert str(node) == value or node == ast.literal_eval(value), (key, node)


def test_a_stray_argument_is_refused():
  from prolip_jax import errors  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.UserError,
                     match='a config file goes as --config=configs/x.py'):
    eval_cli.parse(['evaluate', '--workdir=w', 'configs/x.py'])


def test_evaluate_parses_overrides():
  fv = eval_cli.parse(['evaluate', '--workdir=w', '--step=3',
                       f'--config={DIGITS}', '--config.per_class=7'])
  assert (fv.workdir, fv.step, fv.out) == ('w', 3, None)
  assert fv.config.per_class == 7
  assert fv.config.batch_size == eval_config().batch_size
  # The shared settings reach every entry of the bundled report.
  for name, entry in fv.config.evals.items():
    assert entry.per_class == 7 and entry.data == 'digits:heldout', name
  fv = eval_cli.parse(['evaluate', '--workdir=w', f'--config={DIGITS}',
                       '--evals=zero_shot,retrieval'])
  assert fv.evals == ['zero_shot', 'retrieval']
  # No --config: the checkpoint's own evaluators, some of them, a data_dir.
  fv = eval_cli.parse(['evaluate', '--workdir=w', '--evals=imagenet,coco',
                       '--tfds_data_dir=/data/tfds'])
  assert fv.config is None and fv.evals == ['imagenet', 'coco']
  assert fv.tfds_data_dir == '/data/tfds'


# ---------------------------------------------------------------------------
# End to end on a randomly initialised tiny model saved as a workdir
# (the ``workdir`` fixture of shared_fixtures.py).


EXPECTED_FIGURES = {
    'sigma2_hist.png', 'sigma2_vs_length.png', 'sigma2_by_level.png',
    'inclusion_hist.png', 'uncertain_images.png', 'bprw_weights.png',
    'traversal.png', 'filtering_scores.png'}


def _png_ok(path):
  assert os.path.getsize(path) > 0
  with Image.open(path) as im:
    im.verify()
  with Image.open(path) as im:
    assert im.format == 'PNG' and im.size[0] > 0 and im.size[1] > 0


def test_run_every_entry_of_the_bundled_report(workdir, tmp_path):
  cfg = eval_config()
  cfg.per_class = 5
  cfg.progress = False
  cfg.batch_size = 50
  cfg.evals.bprw.few_shot.shots = 2
  cfg.evals.traversal.steps = 10
  assert sorted(cfg.evals) == ['bprw', 'filtering', 'retrieval', 'traversal',
                               'uncertainty', 'zero_shot']
  out = str(tmp_path / 'eval')
  lines = []
  summary = evaluate.run(workdir, cfg, out, log=lines.append)
  m = summary['metrics']
  for name, entry in cfg.evals.items():
    with open(os.path.join(out, f'{name}.json')) as f:
      data = json.load(f)
    assert data['evaluator'] == name and data['kind'] == entry.kind
    assert data['metrics'], name
    # The shared settings reached every entry.
    assert data['config']['per_class'] == 5, name
    assert data['config']['batch_size'] == 50, name
  assert summary['kinds'] == {n: e.kind for n, e in cfg.evals.items()}
  for key in ('zero_shot/csd_top1', 'zero_shot/cosine_top5',
              'retrieval/csd_i2t_R@10', 'retrieval/cosine_t2i_R@1',
              'uncertainty/spearman_length_sigma2',
              'uncertainty/level_adjacent_decreasing',
              'bprw/uniform_top1', 'bprw/zeroshot_top1',
              'bprw/fewshot2_top1', 'traversal/inclusion_precision',
              'traversal/null_root_R@1', 'filtering/auc'):
    assert key in m, key
  for key, v in m.items():
    if key.endswith(('top1', 'top5', 'precision', 'recall', 'auc')) or (
        '_R@' in key):
      assert 0.0 <= v <= 1.0, (key, v)
  assert m['filtering/kept'] == 40 and m['filtering/total'] == 50
  for side in ('img', 'txt'):  # embed_dim 16: trace = 16 x per dimension
    np.testing.assert_allclose(m[f'uncertainty/sigma2_trace_{side}_mean'],
                               16 * m[f'uncertainty/sigma2_per_dim_{side}_mean'],
                               rtol=1e-6)
  assert {os.path.basename(p) for p in summary['figures']} == \
      EXPECTED_FIGURES
  for p in summary['figures']:
    _png_ok(p)
  kept = open(os.path.join(out, 'filtering_kept_keys.txt')).read().split()
  assert len(kept) == 40 and len(set(kept)) == 40
  table = [l for l in lines if l.startswith('suite')]
  assert table and 'metric' in table[0]


@pytest.mark.slow
def test_command_line(workdir, tmp_path):
  out = str(tmp_path / 'cli')
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep +
             os.environ.get('PYTHONPATH', ''), JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = xla_flags(1)
  proc = subprocess.run(
      [sys.executable, '-m', 'prolip_jax.evaluate', '--workdir', workdir,
       '--out', out, '--config', os.path.join(REPO, 'configs', 'eval',
                                               'digits.py'),
       '--evals=zero_shot,retrieval', '--config.per_class=3',
       '--config.batch_size=30'],
      env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'zero-shot top-1, CSD' in proc.stdout
  assert 'retrieval image -> text R@1/5/10, cosine' in proc.stdout
  assert 'images: 30/30' in proc.stderr  # progress
  with open(os.path.join(out, 'summary.json')) as f:
    summary = json.load(f)
  assert set(summary['metrics']) >= {'zero_shot/csd_top1',
                                     'retrieval/csd_t2i_R@5'}
  # Only the two picked.
  assert {k.split('/')[0] for k in summary['metrics']} == {'zero_shot',
                                                           'retrieval'}


@pytest.mark.slow
def test_deterministic_model_gets_cosine_and_skips_uncertainty(workdir,
                                                              tmp_path):
  from prolip_jax.storage import checkpoint  # pylint: disable=g-import-not-at-top
  from prolip_jax.interop import load as load_lib  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import ModelConfig, init_params  # pylint: disable=g-import-not-at-top
  loaded = load_lib.load(workdir)
  cfg_dict = loaded.config.to_dict()
  cfg_dict['use_unc'] = False
  cfg = ModelConfig.from_config(cfg_dict)
  params = jax.device_get(jax.jit(functools.partial(init_params, cfg))(
      jax.random.key(1)))
  tok = tok_lib.Tokenizer(os.path.join(workdir, checkpoint.TOKENIZER_FILE),
                          cfg.text.context_length, pad_id=0)
  model = load_lib.LoadedModel(cfg, params, tok)
  ecfg = eval_config()
  ecfg.per_class = 2
  ecfg.progress = False
  lines = []
  summary = evaluate.run(model, ecfg, str(tmp_path / 'det'),
                         log=lines.append,
                         only=('zero_shot', 'uncertainty', 'filtering'))
  assert set(summary['metrics']) == {'zero_shot/cosine_top1',
                                     'zero_shot/cosine_top5'}
  assert any('[uncertainty] skipped' in l for l in lines)
  assert any('[filtering] skipped' in l for l in lines)


@pytest.mark.slow
def test_emoji_report_hierarchy_metrics_match_direct_computation(
    workdir, tmp_path):
  """The emoji report on a random model: the level and text-inclusion figures
  equal H and Spearman recomputed here from the model's own embeddings."""
  scipy_stats = pytest.importorskip('scipy.stats')
  from prolip_jax.interop import load as load_lib  # pylint: disable=g-import-not-at-top
  from prolip_jax import losses  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import emoji  # pylint: disable=g-import-not-at-top
  cfg = eval_config('emoji')
  cfg.data = 'emoji:val'
  cfg.progress = False
  cfg.evals.traversal.steps = 10
  summary = evaluate.run(workdir, cfg, str(tmp_path / 'eval'),
                         log=lambda _: None)
  m = summary['metrics']
  assert 0.0 <= m['zero_shot/csd_top1'] <= 1.0
  assert 'traversal/inclusion_precision' in m

  model = load_lib.load(workdir)
  caps = emoji.captions_for(emoji.split('val'))
  levels = cfg.evals.uncertainty.levels
  mu, lv = model.encode_text([c[j] for c in caps for j in levels])
  mu = np.asarray(mu, np.float64).reshape(len(caps), len(levels), -1)
  lv = np.asarray(lv, np.float64).reshape(len(caps), len(levels), -1)
  s2 = np.exp(lv).sum(-1)
  rho = scipy_stats.spearmanr(np.tile(np.arange(len(levels)), len(caps)),
                              s2.ravel())[0]
  assert m['uncertainty/spearman_level_sigma2'] == pytest.approx(rho,
                                                                 abs=1e-4)
  positive = []
  for a in range(len(levels) - 1):  # H(level a+1 ⊂ level a) per image
    h = np.asarray(losses.inclusion_hypothesis(mu[:, a + 1], lv[:, a + 1],
                                               mu[:, a], lv[:, a], eps=0.0))
    positive.append(h > 0)
  names = emoji.LEVEL_NAMES
  key = (f'uncertainty/inclusion_positive/text_{names[levels[1]]}_in_'
         f'{names[levels[0]]}')
  assert m[key] == pytest.approx(np.mean(positive[0]), abs=1e-3)
  assert m['uncertainty/inclusion_positive/text_hierarchy_chain'] == \
      pytest.approx(np.mean(np.logical_and.reduce(positive)), abs=1e-3)

  # Image sigma^2 under a change of style, from the library's encode_image.
  from prolip_jax.evaluation import uncertainty  # pylint: disable=g-import-not-at-top
  images = emoji.images('val', cfg.render_size)
  s_orig = uncertainty.sigma2(model.encode_image(images)[1])
  assert cfg.evals.uncertainty.style_views
  for spec in cfg.evals.uncertainty.style_views:
    s_new = uncertainty.sigma2(model.encode_image(
        uncertainty.restyle(images, spec))[1])
    key = 'uncertainty/style_not_more_certain/' + spec.replace(':', '_')
    assert m[key] == pytest.approx(np.mean(s_new >= s_orig), abs=0.01)
