"""Settings out of range, prompt templates that cannot name a class, a
moving average dropped on resume, memory that ran out and ``None`` where
a key's help allows it (issue 45, findings 7, 8, 10, 12, 20): each is one
line that says what to change, or works as its help says.

All in-process and fast: the refusals come before any work, the memory
error is XLA's message raised through the commands' one error path.
"""

import json
import math
import sys

import jax
import numpy as np
import pytest
from jax.errors import JaxRuntimeError

from prolip_jax import errors
from prolip_jax.config import keys as config_keys
from prolip_jax.evaluation import prompts
from prolip_jax.interop import load as load_lib
from prolip_jax.storage.stored_state import StoredState
from prolip_jax.training import resume

import support


def _one_line(text):
  lines = [l for l in text.strip().splitlines() if l.startswith('error: ')]
  assert len(lines) == 1, text
  assert 'Traceback' not in text, text
  return lines[0]


def _micro_refused(wd, *overrides):
  """``python -m prolip_jax.main`` of the micro config on one device in
  ``wd`` with ``overrides``: it must exit 2; its one error line."""
  code, _, err = support.run_main(
      f'--config={support.MICRO}', f'--workdir={wd}', *overrides,
      '--config.mesh.num_devices=1')
  assert code == errors.EXIT_USER_ERROR, err
  return _one_line(err)


# ----------------------------------------------------------------------------
# 7. Numbers out of their declared interval


@pytest.mark.parametrize('key,value', [
    ('optim.ema_decay', '1.0'), ('optim.ema_decay', '1.5'),
    ('optim.ema_decay', '-0.1'), ('optim.ema_decay', 'nan'),
    ('optim.ema_decay', 'inf'), ('optim.b1', '-3'), ('optim.b2', '1.5'),
    ('optim.weight_decay', '-5'), ('optim.grad_clip', '-1'),
])
def test_numbers_out_of_range_are_one_line_before_any_work(tmp_path, key,
                                                           value):
  """The issue's probes, through ``python -m prolip_jax.main``'s own
  ``run``: exit status 2, one line naming the key, its interval and the
  value given; the workdir is never created (ema_decay 1.0 used to train a
  model that stays at its initial weights, NaN to act as 0)."""
  wd = tmp_path / 'wd'
  line = _micro_refused(wd, f'--config.{key}={value}')
  interval = config_keys.KEYS[key].within
  assert f'{key} must be a number in {interval} (got {float(value)!r})' in (
      line), line
  assert not wd.exists()


# ----------------------------------------------------------------------------
# 8. Prompt templates


class _NoTextModel:
  """A loaded model whose text tower must not be reached: a template is
  refused before anything is embedded."""

  def encode_text(self, texts):
    raise AssertionError(f'embedded {texts!r}')


@pytest.mark.parametrize('templates,expected', [
    (['a photo of a digit'], "has no '{}'"),
    ('digit', 'a list of templates'),
    ('a photo of a {}.', 'a list of templates'),
    (['a {} digit', 'a {digit}'], "template 1 'a {digit}'"),
    (['a {} in {curly'], "'{{' or '}}'"),
    (['a {} }'], "'{{' or '}}'"),
    (['a {} and {}'], "2 '{}'"),
    (['a {:d}'], "template 0 'a {:d}'"),
    ([b'a {}'], 'not a string'),
])
def test_zero_shot_templates_that_cannot_name_a_class_are_refused(
    templates, expected):
  """``zero_shot_classifier`` (and every zero-shot evaluator: the one
  ``prompts.prompt_ensemble``) refuses a template without ``{}`` (every
  class would get the same prompt and ``predict`` return class 0), a string
  given for the list, and a stray brace, in one line; a literal brace
  written ``{{``/``}}`` is fine."""
  with pytest.raises(errors.ConfigError) as e:
    load_lib.LoadedModel.zero_shot_classifier(_NoTextModel(), ['0', '1'],
                                              templates)
  text = str(e.value)
  assert expected in text and '\n' not in text, text
  assert errors.message(errors.user_error_of(e.value)) == text


def test_templates_with_escaped_braces_embed_every_class_apart():
  seen = []

  def embed(texts):
    seen.extend(texts)
    return np.arange(len(texts) * 2, dtype=np.float32).reshape(-1, 2), None
  mu, _ = prompts.prompt_ensemble(embed, ['cat', 'dog'],
                                  ['{{a}} {}', 'a {0}.'])
  assert seen == ['{a} cat', 'a cat.', '{a} dog', 'a dog.']
  assert mu.shape == (2, 2, 2)


# ----------------------------------------------------------------------------
# 10. A moving average dropped on resume


def test_resuming_with_the_moving_average_turned_off_says_it_is_dropped(
    capsys):
  """Turning the average off on resume prints one note saying it is
  dropped and how to keep it (turning it on already says it starts from
  the restored parameters), besides the applied change."""
  stored_config = json.loads(support.micro_config(
      6, **{'optim.ema_decay': 0.9}).to_json_best_effort())
  stored = StoredState(steps=(5,), set_aside=(), newest=(
      5, {'config': stored_config, 'has_teacher': True}))
  config = support.micro_config(6)
  resume.check_drift(config, stored, is_chief=True)
  out = capsys.readouterr().out
  assert 'optim.ema_decay: 0.9 -> 0.0' in out
  note = [l for l in out.splitlines() if l.startswith('note: ')]
  assert len(note) == 1, out
  assert 'moving average' in note[0] and 'dropped' in note[0], note
  assert 'optim.ema_decay=0.9' in note[0], note  # how to keep it
  # Kept (or never there): no note.
  config.optim.ema_decay = 0.5
  resume.check_drift(config, stored, is_chief=True)
  assert 'note: ' not in capsys.readouterr().out
  # Not the chief of a multi-host run: the chief says it.
  config.optim.ema_decay = 0.0
  resume.check_drift(config, stored, is_chief=False)
  assert capsys.readouterr().out == ''


# ----------------------------------------------------------------------------
# 12. Out of memory


@pytest.mark.parametrize('xla_message,asked', [
    ('RESOURCE_EXHAUSTED: Out of memory allocating 4294967296 bytes.',
     '4294967296 bytes (4.0 GiB)'),
    ('RESOURCE_EXHAUSTED: Out of memory while trying to allocate '
     '17179869184 bytes.', '17179869184 bytes (16.0 GiB)'),
    ('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory '
     'in memory space hbm. Used 20.50G of 15.48G hbm. Exceeded hbm capacity '
     'by 5.02G.', 'Used 20.50G of 15.48G hbm'),
])
def test_out_of_memory_is_one_line_saying_what_to_lower(capfd, xla_message,
                                                         asked):
  """XLA's out-of-memory error, raised as JAX raises it (also behind
  another exception), is one line: what ran out, what was asked for, the
  settings that lower it; exit status 2, not a traceback."""
  jax.device_put(0).block_until_ready()  # the backend that ran out: up
  def run_out():
    try:
      raise JaxRuntimeError(xla_message)
    except JaxRuntimeError as e:
      raise RuntimeError('while stepping') from e
  assert errors.cli_main(run_out, argv=['prog']) == errors.EXIT_USER_ERROR
  line = _one_line(capfd.readouterr().err)
  assert 'out of ' in line and ' memory' in line, line
  assert asked in line, line
  if 'hbm' in xla_message:  # the compiler said which memory
    assert 'out of HBM device memory' in line, line
  elif jax.default_backend() == 'cpu':
    assert "out of host memory (JAX's CPU backend)" in line, line
  for setting in ('batch_size', 'model.remat=True', 'accum_steps'):
    assert setting in line, line


def test_host_memory_error_is_one_line_too(capfd):
  def run_out():
    raise MemoryError('Unable to allocate 64.0 GiB for an array with shape '
                      '(8, 2147483648) and data type float32')
  assert errors.cli_main(run_out, argv=['prog']) == errors.EXIT_USER_ERROR
  line = _one_line(capfd.readouterr().err)
  assert 'out of host memory' in line and '64.0 GiB' in line, line
  assert 'accum_steps' in line, line


def test_other_runtime_errors_stay_bugs():
  def bug():
    raise JaxRuntimeError('INTERNAL: something else broke')
  with pytest.raises(JaxRuntimeError):
    errors.cli_main(bug, argv=['prog'])


# ----------------------------------------------------------------------------
# 20. None where a key's help allows it


@pytest.mark.parametrize('form', [['--config.keep_checkpoints=None'],
                                  ['--config.keep_checkpoints', 'None'],
                                  ['--config.keep_checkpoints=none']])
def test_none_is_accepted_where_the_help_says_so(form):
  """``keep_checkpoints`` (help: "None: every one") takes None on the
  command line, in each way absl writes a value; a later override wins."""
  helps_none = sorted(k for k, d in config_keys.KEYS.items()
                      if 'None' in d.meaning)
  assert helps_none == sorted(k for k, d in config_keys.KEYS.items()
                              if d.none_allowed) == ['keep_checkpoints']
  code, out, err = support.run_main(f'--config={support.MICRO}', *form,
                                    '--print_config')
  assert code == 0, err
  assert 'keep_checkpoints = None ' in out, out
  code, out, err = support.run_main(f'--config={support.MICRO}', *form,
                                    '--config.keep_checkpoints=4',
                                    '--print_config')
  assert code == 0, err
  assert 'keep_checkpoints = 4 ' in out, out


def test_none_is_refused_in_one_line_where_the_help_does_not_allow_it():
  code, _, err = support.run_main(f'--config={support.MICRO}',
                                  '--config.total_steps=None',
                                  '--print_config')
  assert code == errors.EXIT_USER_ERROR
  assert 'total_steps' in _one_line(err)


def test_nan_is_in_no_interval():
  from prolip_jax.config import ranges  # pylint: disable=g-import-not-at-top
  for notation in ('(-inf, inf)', '[0, inf]', '[0, 1]'):
    assert not ranges.contains(notation, math.nan)


def test_an_evaluators_templates_are_checked_with_the_config():
  """A ``zero_shot``/``bprw`` entry's own templates are refused when the
  config is checked (before training starts), not at its first
  evaluation; an asset name (``'imagenet'``) is left to its reader."""
  from prolip_jax.evaluation import evaluator  # pylint: disable=g-import-not-at-top
  for kind in ('zero_shot', 'bprw'):
    entry = {'kind': kind, 'data': 'digits', 'templates': ['a digit']}
    with pytest.raises(errors.ConfigError, match=(
        r"^evals\.zs\.templates: template 0 'a digit' has no '\{\}'")):
      evaluator.entries({'zs': entry})
    evaluator.entries({'zs': dict(entry, templates=['a {} digit'])})
    evaluator.entries({'zs': dict(entry, templates='imagenet')})


# ----------------------------------------------------------------------------
# Issue 47, 2: data.decode='dali' where DALI is not installed


@pytest.mark.parametrize('decode,expected', [
    ('dali', "data.decode='dali' needs NVIDIA DALI, which is not installed"),
    ('gpu', "data.decode='gpu': use one of host, dali"),
])
def test_dali_decode_without_dali_is_one_line_before_any_work(
    tmp_path, monkeypatch, decode, expected):
  """``--config.data.decode=dali`` in an environment without DALI (here
  simulated: ``nvidia.dali`` made unimportable, whether or not it is
  installed) stops in one line that says how to install it, exit 2, before
  the workdir exists; an unknown decode names the two there are."""
  monkeypatch.setitem(sys.modules, 'nvidia.dali', None)
  wd = tmp_path / 'wd'
  line = _micro_refused(wd, f'--config.data.decode={decode}')
  assert expected in line, line
  if decode == 'dali':
    assert line.endswith("pip install -e '.[dali]' (or data.decode=host)"), (
        line)
  assert not wd.exists()
