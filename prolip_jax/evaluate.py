"""``python -m prolip_jax.evaluate``: evaluators on a checkpoint.

The command layer of evaluation: it parses the flags
(``evaluation/cli.py``), loads the model (``prolip_jax.load``, the only
place evaluation meets a path) and hands it to ``evaluation.runner.run``;
the code that scores it lives in ``prolip_jax.evaluation`` (see its package
docstring for the modules), which never imports the loader.

  python -m prolip_jax.evaluate --workdir DIR --config configs/eval/digits.py

Kinds (``prolip_jax/evaluation/kinds/``): ``zero_shot`` (top-1/top-5 by
CSD and cosine over the prompt ensemble), ``retrieval`` (R@1/5/10 both
ways, several captions per image), ``uncertainty`` and
``uncertainty_report`` (paper 4.3: Figs. 4-8 and C.6), ``heldout`` (the
training run's own), ``bprw``, ``traversal`` and ``filtering`` (the
applications of ``prolip_jax.applications``).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

from absl import logging

from prolip_jax import command_line
from prolip_jax import errors
from prolip_jax import host_memory
from prolip_jax.evaluation import cli
from prolip_jax.evaluation import runner
from prolip_jax.interop import load as load_lib
from prolip_jax.storage import paths


def run(model, config=None, out_dir: Optional[str] = None,
        step: Optional[int] = None, log: Callable[[str], None] = print,
        only: tuple[str, ...] = (), tfds_data_dir: Optional[str] = None
        ) -> dict:
  """``runner.run`` on a model or on a path ``prolip_jax.load`` reads.

  Args:
    model: a ``LoadedModel``, or a workdir / export / ``hf-hub:`` path.
    config: None (the model's own ``evals``, ``runner.checkpoint_evals``)
      or an eval config with ``evals`` (``configs/eval/digits.py``).
    out_dir: default ``<model path>/eval`` (required for a model object).
    step: checkpoint step when loading a workdir.
    log, only, tfds_data_dir: as ``runner.run``.

  Returns:
    ``runner.run``'s summary.
  """
  if isinstance(model, (str, os.PathLike)):
    path = os.fspath(model)
    if out_dir is None:
      out_dir = paths.join(paths.parse(path, 'model path'), 'eval')
    runner.check_out(out_dir)  # a user's folder: refused before the load
    model = load_lib.load(path, step=step)
  return runner.run(model, config, out_dir, log=log, only=only,
                    tfds_data_dir=tfds_data_dir)


def command(argv: Sequence[str]) -> int:
  """Runs the command line ``argv`` (program name first); returns the exit
  status (0, 2 for a user error)."""
  if any(a in ('--help', '-h', '--helpfull', '-help') for a in argv[1:]):
    print(cli.help_text())
    return 0

  def body():
    fv = cli.parse(argv)
    logging.set_verbosity(logging.ERROR)
    command_line.pin_cpu_thread_pool()  # as training: the same bits
    # As training does: no TPU runtime warnings on a machine without one.
    command_line.cpu_only_without_accelerators()
    host_memory.keep_freed_memory_on_cpu()  # as training
    run(fv.workdir, fv.config, fv.out, fv.step,
        log=lambda s: print(s, flush=True), only=tuple(fv.evals),
        tfds_data_dir=fv.tfds_data_dir)
    return 0

  return errors.cli_main(body, argv)


def main():
  """Entry point of ``python -m prolip_jax.evaluate``."""
  sys.exit(command(sys.argv))


if __name__ == '__main__':
  main()
