"""``python -m prolip_jax.evaluate``: the evaluation command line.

Flags are absl flags; the config is an ``ml_collections`` file and any value
can be overridden with ``--config.x.y=...``::

  python -m prolip_jax.evaluate --workdir DIR          # the run's own evals
  python -m prolip_jax.evaluate --workdir DIR --config configs/eval/digits.py

``DIR`` is a training workdir or an export directory (anything
``prolip_jax.load`` reads). With no ``--config`` the evaluators are the
ones the checkpoint was trained with (``config.evals``; see
``evaluation/runner.py``).
"""

from __future__ import annotations

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from prolip_jax import errors
from prolip_jax.evaluation import runner


def main():
  """Defines the flags and runs ``runner.run`` on ``--workdir``.

  Flags are defined here, not at import, since ``prolip_jax.main`` defines
  ``--config`` and ``--workdir`` too.
  """
  config_flags.DEFINE_config_file(
      'config', None, 'Evaluation config file (default: the evaluators the '
      'checkpoint was trained with, its config.evals).')
  flags.DEFINE_string('workdir', None, 'Training workdir or export directory '
                      '(anything prolip_jax.load reads).', required=True)
  flags.DEFINE_string('out', None, 'Output directory (default WORKDIR/eval).')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest).')
  flags.DEFINE_list('evals', [], 'Run only these evaluators (names in '
                    'config.evals).')
  flags.DEFINE_string('tfds_data_dir', None, 'TFDS data_dir of evaluators '
                      'that set none (default: the config\'s, else the '
                      'run\'s eval.tfds_data_dir).')

  def run_main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments {argv[1:]}')
    logging.set_verbosity(logging.ERROR)
    return errors.cli_main(lambda: runner.run(
        flags.FLAGS.workdir, flags.FLAGS.config, flags.FLAGS.out,
        flags.FLAGS.step, log=lambda s: print(s, flush=True),
        only=tuple(flags.FLAGS.evals),
        tfds_data_dir=flags.FLAGS.tfds_data_dir))

  app.run(run_main)
