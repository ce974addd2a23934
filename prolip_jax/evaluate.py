"""``python -m prolip_jax.evaluate``: evaluation suites on a checkpoint.

The code lives in ``prolip_jax.evaluation`` (see its package docstring for
the modules); this module is the command-line entry point and keeps
``prolip_jax.evaluate.run`` as a short name for ``evaluation.runner.run``.

  python -m prolip_jax.evaluate --workdir DIR --config configs/eval/digits.py

Suites: ``zero_shot`` (top-1/top-5 by CSD and cosine over the prompt
ensemble), ``retrieval`` (R@1/5/10 both ways, several captions per image),
``uncertainty`` (paper 4.3: Figs. 4-8 and C.6), ``bprw``, ``traversal`` and
``filtering`` (the applications of ``prolip_jax.applications``).
"""

from prolip_jax.evaluation.runner import run  # pylint: disable=unused-import

if __name__ == '__main__':
  from prolip_jax.evaluation import cli  # pylint: disable=g-import-not-at-top
  cli.main()
