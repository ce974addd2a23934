"""The names each registry holds, for the config keys whose values they are
(``config_keys.Key.choices``).

``config/`` sits below the packages that define the registries (they import
it), so a key names its registry and this module, above both, lists it:
``objectives`` (one module of ``objectives/`` each), ``sources`` (the training
sources of ``data/sources/``) and ``evaluator kinds`` (one module of
``evaluation/kinds/`` each). A registry is imported when it is asked for,
so that importing this module (``main.py`` does) costs nothing.
"""

from __future__ import annotations

from typing import Any, Callable

from prolip_jax.config import help as config_help


def _objectives() -> tuple[str, ...]:
  from prolip_jax import objectives  # pylint: disable=g-import-not-at-top
  return tuple(objectives.OBJECTIVES)


def _sources() -> tuple[str, ...]:
  from prolip_jax.data import sources  # pylint: disable=g-import-not-at-top
  return sources.names('train')


def _evaluator_kinds() -> tuple[str, ...]:
  from prolip_jax.evaluation import evaluator  # pylint: disable=g-import-not-at-top
  return tuple(evaluator.kind_names())


# {registry named by a Key's ``choices``: () -> the names it holds now}.
REGISTRIES: dict[str, Callable[[], tuple[str, ...]]] = {
    'objectives': _objectives,
    'sources': _sources,
    'evaluator kinds': _evaluator_kinds,
}


def names(registry: str) -> tuple[str, ...]:
  """The names ``registry`` (a key of ``REGISTRIES``) holds now: a module
  appended to its package's path counts."""
  return REGISTRIES[registry]()


def describe(config: Any) -> str:
  """``--print_config``'s text: ``config_help.describe`` with the values of
  each key that names a registry listed from it."""
  return config_help.describe(config, names)
