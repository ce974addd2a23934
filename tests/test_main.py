"""The command line in-process: user errors are one line and status 2.

The fast twin of ``test_faults.py``'s command-line tests (which start
``python -m prolip_jax.main`` as a process and are marked slow): the same
``main.run(argv)`` that ``main()`` exits with, called here directly. Every
case fails before training starts, so nothing is trained or compiled.
"""

import os

import pytest

from prolip_jax import errors
from prolip_jax import registries
from prolip_jax.config import help as config_help
from prolip_jax.config import presets

from support import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')


@pytest.mark.parametrize('args,expected', [
    (['--config.batchsize=3'],
     "unknown config key 'batchsize' (did you mean 'batch_size'?)"),
    (['--config=/nonexistent/config.py'], "config file '/nonexistent"),
    (['--config.objective=prolp'], "unknown objective 'prolp' (did you mean "
                                   "'prolip'?)"),
    (['--config.batch_size=abc'], 'config.batch_size=abc'),
    (['--config.total_steps=0'], 'total_steps must be an integer >= 1 '
                                 '(got 0)'),
    # A config path without --config would train the default demo.
    (['configs/siglip_tiny.py'], 'unexpected argument configs/siglip_tiny.py;'
                                 ' a config file goes as '
                                 '--config=configs/siglip_tiny.py'),
])
def test_user_errors_are_one_line_with_status_2(tmp_path, args, expected):
  code, out, err = run_main(f'--config={MICRO}', *args,
                            f'--workdir={tmp_path / "w"}')
  assert code == errors.EXIT_USER_ERROR == 2, (out, err)
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), err
  assert expected in lines[0], lines[0]
  assert not os.path.exists(tmp_path / 'w' / 'checkpoints')


def test_help_and_print_config():
  code, out, _ = run_main('--help')
  assert code == 0 and '--print_config' in out and '--config.KEY' in out
  code, out, _ = run_main(f'--config={MICRO}', '--print_config',
                          '--config.total_steps=7')
  assert code == 0
  lines = out.splitlines()
  assert any(l.split('#')[0].strip() == 'total_steps = 7' for l in lines)
  assert any(l.startswith('optim.lr = ') and '# peak learning rate' in l
             for l in lines)
  # One line per key of the file's config, the override applied.
  config = presets.load_config_file(MICRO)
  assert len(lines) == len(config_help.flatten(config))
  config.total_steps = 7
  assert out.strip() == registries.describe(config).strip()
  assert '# the training objective' in out and '(one of ' in out


def test_nearest_and_config_errors():
  assert errors.nearest('batchsize', ['batch_size', 'seed']) == (
      " (did you mean 'batch_size'?)")
  assert errors.nearest('zzz', ['batch_size', 'seed']) == ''
  # ValueError / FileNotFoundError while setting up -> ConfigError (a
  # UserError, so status 2), the cause chained; other errors are bugs.
  for exc in (ValueError('bad'), FileNotFoundError('gone')):
    with pytest.raises(errors.ConfigError) as info:
      with errors.config_errors():
        raise exc
    assert info.value.__cause__ is exc
    assert isinstance(info.value, errors.UserError)
  with pytest.raises(KeyError):
    with errors.config_errors():
      raise KeyError('a bug')
