"""The config-key declarations (``config_keys.KEYS``): every key of every
config is declared, and what a key is declared to change on resume is what
it does change, measured on the optimizer-state and parameter trees the run
builds."""

import glob
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

from prolip_jax import demos
from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax import registries
from prolip_jax.config import drift as config_drift
from prolip_jax.config import help as config_help
from prolip_jax.config import keys as config_keys
from prolip_jax.config import presets
from prolip_jax.data import sources
from prolip_jax.evaluation import evaluator
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.training import optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')


def _all_configs():
  for path in sorted(glob.glob(os.path.join(REPO, 'configs', '*.py'))):
    yield os.path.basename(path), presets.load_config_file(path)
  for name in objectives.OBJECTIVES:
    yield f'tiny_demo_config({name!r})', demos.tiny_demo_config(name)
    yield f'emoji_demo_config({name!r})', demos.emoji_demo_config(name)
    yield f'emoji_study_config({name!r})', demos.emoji_study_config(name)


def test_every_key_of_every_config_is_declared():
  for name, config in _all_configs():
    undeclared = sorted(k for k in config_help.flatten(config)
                        if config_keys.declaration(k) is None)
    assert not undeclared, (name, undeclared)
    # The open subtree's entries are checked by their reader.
    evaluator.entries(config.get('evals'))
  for key, declared in config_keys.KEYS.items():
    assert declared.meaning, key


def test_base_config_and_presets_read_the_declarations():
  base = config_help.flatten(presets.base_config())
  assert base == config_keys.defaults()
  assert presets.base_config().model == presets.model_preset('tiny')
  b16 = presets.model_preset('B/16')
  assert (b16.embed_dim, b16.vision.width, b16.text.vocab_size) == (
      768, 768, 32100)
  assert b16.vision.act == config_keys.default('model.vision.act')
  from prolip_jax.objectives import uniclip  # pylint: disable=g-import-not-at-top
  assert uniclip.DEFAULTS['num_blocks'] == config_keys.default(
      'uniclip.num_blocks')
  # A config that lacks a key (an older stored run) reads its default.
  assert config_keys.get({'data': {}}, 'data.num_views') == 1
  assert config_keys.get({'data': {'num_views': 3}}, 'data.num_views') == 3


def test_default_normalisation_is_openai_clips():
  constants = pytest.importorskip('open_clip.constants')
  assert config_keys.CLIP_MEAN == constants.OPENAI_DATASET_MEAN
  assert config_keys.CLIP_STD == constants.OPENAI_DATASET_STD
  assert presets.base_config().data.mean == config_keys.CLIP_MEAN
  assert presets.base_config().data.std == config_keys.CLIP_STD


def test_print_config_marks_fixed_keys():
  text = config_help.describe(presets.load_config_file(MICRO))
  lines = {l.split(' = ')[0]: l for l in text.splitlines()}
  assert lines['optim.grad_clip'].endswith('[fixed on resume]')
  assert '# peak learning rate' in lines['optim.lr']
  assert not lines['optim.lr'].endswith('[fixed on resume]')
  assert lines['keep_checkpoints'].endswith(
      '[removes the checkpoints older than the newest keep_checkpoints]')
  assert [k for k in lines if '[removes ' in lines[k]] == ['keep_checkpoints']


def _declared_choices() -> dict[str, str]:
  """{key: registry} of every declaration with ``choices``."""
  found = {k: d.choices for k, d in config_keys.KEYS.items() if d.choices}
  found['evals.NAME.kind'] = config_keys.EVAL_KIND.choices
  return found


def test_registries_list_what_their_packages_hold():
  """Each registry a key names lists its package's names, counted here
  another way where there is one: the objectives by the ``name`` of the
  ``Objective`` subclasses in the files of objectives/, the evaluator kinds
  by the files of evaluation/kinds/."""
  assert set(_declared_choices().values()) == set(registries.REGISTRIES)
  here = os.path.dirname(objectives.__file__)
  classes = {cls.name for cls in _subclasses(objectives.Objective)
             if cls.name and os.path.dirname(
                 sys.modules[cls.__module__].__file__ or '') == here}
  assert set(registries.names('objectives')) == classes
  kinds_dir = os.path.join(os.path.dirname(evaluator.__file__), 'kinds')
  assert set(registries.names('evaluator kinds')) == {
      f[:-3] for f in os.listdir(kinds_dir)
      if f.endswith('.py') and f != '__init__.py'}
  assert registries.names('sources') == sources.names('train')
  assert {'digits', 'emoji'} <= set(registries.names('sources'))


def _subclasses(cls):
  for sub in cls.__subclasses__():
    yield sub
    yield from _subclasses(sub)


def test_every_value_of_a_key_with_choices_is_one_of_them():
  """The declared defaults and every config's values of such keys are
  names their registry holds."""
  for key, registry in _declared_choices().items():
    if 'NAME' not in key:
      assert config_keys.default(key) in registries.names(registry), key
  for name, config in _all_configs():
    for key, value in config_help.flatten(config).items():
      declared = config_keys.declaration(key)
      if declared is not None and declared.choices:
        assert value in registries.names(declared.choices), (name, key)


def test_print_config_lists_each_registry_from_itself(monkeypatch):
  """``--print_config``'s line of a key with choices lists its registry's
  names, a name added to the registry included; ``describe`` without the
  registries lists none."""
  config = presets.load_config_file(MICRO)
  config.evals.eval.kind = 'heldout'
  lines = {l.split(' = ')[0]: l for l in
           registries.describe(config).splitlines()}
  listed = {key: lines[key].split('(one of ')[1].split(')')[0].split(' | ')
            for key in ('objective', 'data.name', 'evals.eval.kind')}
  assert listed == {
      'objective': list(objectives.OBJECTIVES),
      'data.name': list(sources.names('train')),
      'evals.eval.kind': list(evaluator.kind_names())}
  assert lines['objective'].endswith('[fixed on resume]')
  assert '(one of' not in config_help.describe(config)
  monkeypatch.setattr(objectives, 'OBJECTIVES',
                      (*objectives.OBJECTIVES, 'added_here'))
  assert 'added_here)' in registries.describe(config).splitlines()[
      list(lines).index('objective')]


def test_minimums_refuse_below_and_accept_at_the_minimum():
  """``check_values`` against each declared minimum: the minimum itself
  passes (and None where declared), one below fails naming the key; bools
  and strings never pass as counts."""
  config = presets.load_config_file(MICRO)
  config_keys.check_values(config)
  bounded = {k: d for k, d in config_keys.KEYS.items()
             if d.minimum is not None and not d.added_by}
  assert {'checkpoint_every_steps', 'log_every_steps', 'keep_checkpoints',
          'batch_size', 'total_steps'} <= set(bounded)
  for key, declared in bounded.items():
    node = config
    *parents, last = key.split('.')
    for part in parents:
      node = node[part]
    saved = node[last]
    with node.ignore_type():
      node[last] = declared.minimum
      config_keys.check_values(config)
      if declared.none_allowed:  # keep_checkpoints=None: keep every one
        node[last] = None
        config_keys.check_values(config)
      for bad in (declared.minimum - 1, True, 'x'):
        node[last] = bad
        with pytest.raises(ValueError, match=key.replace('.', r'\.')):
          config_keys.check_values(config)
      node[last] = saved
  # An evaluator's batch size (``evals.NAME.batch_size``: the open subtree)
  # is bounded by its reader.
  evals = config.evals.to_dict()
  evals['eval']['batch_size'] = 1
  evaluator.entries(evals)
  evals['eval']['batch_size'] = 0
  with pytest.raises(errors.ConfigError, match=r'evals\.eval\.batch_size'):
    evaluator.entries(evals)


def _changed(key, value):
  """Another valid value of ``key`` and the overrides it needs."""
  special = {
      'model.vision.act': ('quick_gelu', {}),
      'model.text.act': ('quick_gelu', {}),
      'model.text.pool': ('argmax', {'model.use_unc': False}),
      'model.compute_dtype': ('bfloat16', {}),
      'model.remat_policy': ('dots_saveable', {'model.remat': True}),
      'model.attention_impl': ('xla', {}),
      'model.attention_logits_dtype': ('bfloat16', {}),
      'optim.freeze': (('visual/.*',), {}),
  }
  if key in special:
    return special[key]
  if isinstance(value, bool):
    return (not value), {}
  if isinstance(value, int):
    return (value * 2 if value else 1), {}
  if isinstance(value, float):
    return (value / 2 if value else 0.5), {}
  raise AssertionError(f'no changed value for {key}={value!r}')


def _set(config, key, value):
  node = config
  *parents, last = key.split('.')
  for part in parents:
    node = node[part]
  node[last] = value


def _tree_signature(tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return (jax.tree.structure(tree),
          [(jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in leaves])


def _abstract_params(config):
  model_cfg = ModelConfig.from_config(config.model)
  model = ProLIP(model_cfg)
  objective = objectives.get(config.objective)

  def init(rng):
    size = model_cfg.vision.image_size
    params = model.init(
        rng, jnp.zeros((1, size, size, 3), jnp.float32),
        jnp.zeros((1, model_cfg.text.context_length), jnp.int32))['params']
    return dict(params, **objective.init_extra_params(config, model_cfg, rng))

  return jax.eval_shape(init, jax.random.key(0))


def test_optimizer_keys_that_change_the_state_tree_are_declared_so():
  """For every optim.* key: does changing it change the optimizer-state tree
  (``optimizer.make_optimizer``, on the [UNC] model so the uncertainty group
  exists)? Exactly those keys must be declared ``OPTIMIZER_TREE``."""
  base = presets.load_config_file(MICRO)
  params = _abstract_params(base)

  def signature(config):
    tx, _ = optimizer.make_optimizer(config.optim, config.total_steps)
    return _tree_signature(jax.eval_shape(tx.init, params))

  reference = signature(base)
  keys = [k for k in config_keys.KEYS if k.startswith('optim.')]
  assert len(keys) >= 10
  measured = {}
  for key in keys:
    config = presets.load_config_file(MICRO)
    value, extra = _changed(key, config_keys.get(config, key))
    _set(config, key, value)
    measured[key] = signature(config) != reference
  declared = {k: config_keys.KEYS[k].fixed == config_keys.OPTIMIZER_TREE
              for k in keys}
  assert measured == declared
  assert measured['optim.grad_clip'] and measured['optim.unc_lr_mult']
  assert measured['optim.freeze']
  assert all(config_drift.is_fixed(k) for k in keys if measured[k])


def _parameter_sections() -> list[tuple[str, str]]:
  """(objective, key prefix): ``model.`` under the default objective, and
  each section of its own that an objective adds (``uniclip.``: a
  top-level section no other config has), under that objective."""
  shared = set(presets.base_config())
  own = sorted({(d.added_by, k.split('.')[0] + '.')
                for k, d in config_keys.KEYS.items()
                if d.added_by and k.split('.')[0] not in shared})
  return [(config_keys.default('objective'), 'model.')] + own


def test_parameter_sections_are_the_models_and_each_objectives_own():
  sections = _parameter_sections()
  # Independent: the objectives whose init_extra_params adds parameters
  # each own a section of keys.
  extra = [name for name in objectives.OBJECTIVES
           if type(objectives.get(name)).init_extra_params
           is not objectives.Objective.init_extra_params]
  assert sorted(o for o, _ in sections[1:]) == sorted(extra)
  assert all(prefix == f'{o}.' for o, prefix in sections[1:])


@pytest.mark.slow  # traces the model init once per key (~20 s)
@pytest.mark.parametrize('objective,prefix', _parameter_sections())
def test_keys_that_change_the_parameter_tree_are_declared_so(objective,
                                                            prefix):
  """For every model.* key (and every key of an objective's own section,
  uniclip.*): does changing it change the parameter tree (jax.eval_shape
  of the model's init plus the objective's own parameters)? Exactly those
  keys must be declared ``PARAMETER_TREE``; the others that may not change
  say why."""
  def base():
    c = demos.tiny_demo_config(objective)
    c.model.vision.layers = c.model.text.layers = 1  # faster tracing
    return c

  reference = _tree_signature(_abstract_params(base()))
  keys = [k for k in config_keys.KEYS if k.startswith(prefix)]
  measured = {}
  for key in keys:
    config = base()
    value, extra = _changed(key, config_keys.get(config, key))
    _set(config, key, value)
    if extra:  # a change that needs another: compare against that alone
      ref_config = base()
      for k, v in extra.items():
        _set(ref_config, k, v)
        _set(config, k, v)
      ref = _tree_signature(_abstract_params(ref_config))
    else:
      ref = reference
    measured[key] = _tree_signature(_abstract_params(config)) != ref
  declared = {k: config_keys.KEYS[k].fixed == config_keys.PARAMETER_TREE
              for k in keys}
  assert measured == declared
  assert all(config_drift.is_fixed(k) for k in keys if measured[k])


def test_drift_treats_an_absent_key_as_its_default():
  stored = {'optim': {'lr': 1e-3}}  # written before unc_lr_mult existed
  assert config_drift.diff(stored, {'optim': {'lr': 1e-3,
                                              'unc_lr_mult': 1.0}}) == {}
  with pytest.raises(Exception, match=r'optim.unc_lr_mult: 1.0 -> 10.0 '
                     r'\(changes the optimizer-state tree\)'):
    config_drift.check(stored, {'optim': {'lr': 1e-3, 'unc_lr_mult': 10.0}},
                       5)


def _number_keys() -> set[str]:
  """Every key whose default is a float or a tuple of floats."""
  return {k for k, d in config_keys.KEYS.items()
          if isinstance(d.default, float) or (
              isinstance(d.default, tuple) and d.default
              and all(isinstance(v, float) for v in d.default))}


def _probes(notation: str) -> list[tuple[float, bool]]:
  """``(value, inside)`` around each end of ``notation`` ('[0, 1)'), read
  here from the brackets: an end itself is inside when its bracket is
  closed, a step beyond it never; infinity is a value only where a bracket
  closes on it; NaN is never inside."""
  low, high = (float(x) for x in notation[1:-1].split(','))
  out = [(math.nan, False)]
  for end, closed, outward in ((low, notation[0] == '[', -1.0),
                               (high, notation[-1] == ']', 1.0)):
    if math.isinf(end):
      out.append((end, closed))
    else:
      out += [(end, closed), (end + outward * max(1.0, abs(end)), False),
              (outward * math.inf, False)]
  return out


def test_every_number_key_declares_its_interval_and_check_values_keeps_it():
  """Every float key declares ``within`` (and only those do); for each,
  ``check_values`` accepts the default and refuses values beyond either
  end, NaN, and infinity unless the interval includes it, naming the key;
  the issue's probes (ema_decay 1, betas, negative decay and clip) are
  outside."""
  declared = {k for k, d in config_keys.KEYS.items() if d.within}
  assert declared == _number_keys()
  expected = {'optim.ema_decay': '[0, 1)', 'optim.b1': '[0, 1)',
              'optim.b2': '[0, 1)', 'optim.weight_decay': '[0, inf)',
              'optim.grad_clip': '[0, inf)', 'optim.lr': '[0, inf)',
              'masking.image_keep_ratio': '(0, 1]',
              'loss.otter.eta': '[0, inf]'}  # eta = inf: no self-match
  assert {k: config_keys.KEYS[k].within for k in expected} == expected
  config = presets.load_config_file(MICRO)
  for objective in ('pcclip', 'uniclip'):
    config_keys.add(config, objective)
  config_keys.check_values(config)
  for key in sorted(declared):
    node = config
    *parents, last = key.split('.')
    for part in parents:
      node = node[part]
    saved = node[last]
    tuple_of = isinstance(saved, tuple)
    with node.ignore_type():
      for value, inside in _probes(config_keys.KEYS[key].within):
        node[last] = (saved[:-1] + (value,)) if tuple_of else value
        if inside:
          config_keys.check_values(config)
        else:
          with pytest.raises(ValueError, match=f'^{re.escape(key)} must '):
            config_keys.check_values(config)
      for bad in ('x', None):  # (a ConfigDict stores True as 1.0)
        node[last] = (bad,) * len(saved) if tuple_of else bad
        with pytest.raises(ValueError, match=f'^{re.escape(key)} must '):
          config_keys.check_values(config)
      node[last] = saved
  config_keys.check_values(config)
  # A bool is no number (a plain mapping keeps it one).
  with pytest.raises(ValueError, match=r'^optim\.lr must be a number'):
    config_keys.check_values({'optim': {'lr': True}})
