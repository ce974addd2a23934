"""``python -m prolip_jax.evaluate``: the evaluation command line.

Flags are absl flags; the config is an ``ml_collections`` file and any value
can be overridden with ``--config.x.y=...``::

  python -m prolip_jax.evaluate --workdir DIR          # the run's own evals
  python -m prolip_jax.evaluate --workdir DIR --config configs/eval/digits.py

``DIR`` is a training workdir or an export directory (anything
``prolip_jax.load`` reads). With no ``--config`` the evaluators are the
ones the checkpoint was trained with (``config.evals``;
``evaluation/runner.py``).

This module holds the flags (``parse``, ``help_text``); the command itself,
which loads the model and runs ``runner.run``, is ``prolip_jax/evaluate.py``.

The flags live in their own ``FlagValues`` (not absl's global ``FLAGS``,
where ``prolip_jax.main`` defines ``--config`` and ``--workdir`` too), so
that ``--help`` lists exactly this command's flags and the parser can be
built in-process, e.g. by a test.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence

from absl import flags
from ml_collections import config_flags

from prolip_jax import command_line
from prolip_jax.config import help as config_help
from prolip_jax import errors

# No config file: the checkpoint's own evaluators (runner.checkpoint_evals).
DEFAULT_CONFIG = None

# The override examples of --help, each a working set of flags (tested).
EXAMPLES = (
    '--config configs/eval/digits.py --config.per_class=20',
    '--config configs/eval/digits.py --evals=zero_shot,retrieval',
    '--config configs/eval/imagenet_folder.py '
    '--config.evals.imagenet.data=folder:/data/imagenet/val',
    '--config configs/eval/benchmarks.py --config.tfds_data_dir=/data/tfds',
)

USAGE = """\
Usage: python -m prolip_jax.evaluate --workdir DIR [--config FILE]
                                     [--config.KEY=VALUE ...] [--out DIR]
                                     [--step N] [--evals NAME,...]
                                     [--tfds_data_dir DIR]

Runs a checkpoint's evaluators: by default the ones it was trained with
(its config.evals: ImageNet / COCO for the B/16 configs; the demos add the
digits or emoji report), or those of --config. Writes OUT/<name>.json, PNG
figures beside them and summary.json,
and prints a table (accuracies and recalls in percent, sigma^2 per
dimension and as a trace).

Eval configs: configs/eval/digits.py, configs/eval/emoji.py (the bundled
reports), configs/eval/benchmarks.py (ImageNet, ImageNet-v2, COCO 5k from
prepared TFDS data), configs/eval/imagenet_folder.py (a folder of synset
folders). Overrides: any value of the --config file, e.g. (each after
--workdir DIR):
{examples}
(docs/evaluation.md documents them).

Flags:""".format(examples='\n'.join('  ' + e for e in EXAMPLES))


def define_flags(argv: Optional[Sequence[str]] = None) -> flags.FlagValues:
  """A fresh ``FlagValues`` with the command's flags; ``argv`` is where the
  config flag reads its ``--config.KEY`` overrides."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file(
      'config', DEFAULT_CONFIG,
      'Evaluation config file (default: the evaluators the checkpoint was '
      'trained with). configs/eval/digits.py, emoji.py: the bundled '
      'reports; benchmarks.py: ImageNet and COCO. Override any of its '
      'values with --config.KEY=VALUE.',
      flag_values=fv, sys_argv=list(argv) if argv is not None else None)
  flags.DEFINE_string('workdir', None, 'Training workdir or export directory '
                      '(anything prolip_jax.load reads). Required.',
                      flag_values=fv)
  flags.DEFINE_string('out', None, 'Output directory for the JSON files and '
                      'figures (default WORKDIR/eval).', flag_values=fv)
  flags.DEFINE_integer('step', None, 'Checkpoint step to load (default: the '
                       'latest).', flag_values=fv)
  flags.DEFINE_list('evals', [], 'Run only these evaluators (names in '
                    'config.evals).', flag_values=fv)
  flags.DEFINE_string('tfds_data_dir', None, 'TFDS data_dir of evaluators '
                      'that set none (default: the config\'s tfds_data_dir, '
                      'else the run\'s eval.tfds_data_dir).', flag_values=fv)
  flags.DEFINE_bool('debug', False, 'Show the traceback of user errors too '
                    '(also PROLIP_DEBUG=1).', flag_values=fv)
  return fv


def help_text() -> str:
  """What ``--help`` prints: the usage and every flag with its help and
  default."""
  fv = define_flags([sys.argv[0] if sys.argv else 'evaluate'])
  return USAGE + '\n' + fv.module_help(__name__)


def parse(argv: Sequence[str]) -> flags.FlagValues:
  """Parsed flags of ``argv`` (program name first); a bad flag, a missing
  ``--workdir`` or config file or an unknown config key raise ``UserError``
  with a one-line reason."""
  path = command_line.config_path(argv, DEFAULT_CONFIG)
  if path is None and any(a.startswith('--config.') for a in argv):
    raise errors.UserError(
        '--config.KEY overrides need --config FILE (without it the '
        "checkpoint's own evaluators run; --evals picks some of them)")
  if path is not None and not os.path.isfile(path):
    raise errors.UserError(f'config file {path!r} not found')
  if path is not None:
    try:
      config = runpy.run_path(path)['get_config']()
    except Exception as e:  # the user's file: report it, don't trace us
      raise errors.UserError(f'config file {path!r} failed to load: '
                             f'{type(e).__name__}: {e}') from e
    command_line.check_overrides(argv, config_help.flatten(config),
                                 f'{path} lists the keys')
  try:
    fv = define_flags(argv)  # reads the --config.KEY overrides
    rest = fv(list(argv))
  except flags.Error as e:
    raise errors.UserError(str(e).splitlines()[0]) from e
  except (KeyError, AttributeError) as e:
    # config_flags meets an unknown key while applying the overrides.
    key = str(e).strip('\'"\\ ')
    raise errors.UserError(f'unknown config key {key!r} in '
                           f'{[a for a in argv if a.startswith("--config.")]}'
                           f'; {path} lists the keys') from e
  command_line.refuse_positional(rest[1:])
  if not fv.workdir:
    raise errors.UserError('--workdir is required (a training workdir or an '
                           'export directory); --help lists the flags')
  return fv
