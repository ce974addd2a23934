"""Training objectives, selected by ``config.objective``.

Each objective is one module here with one ``Objective`` subclass (the
interface and its hooks are in ``base.py``), found by its ``name``; its pure
loss functions live in ``prolip_jax.losses``. ``get(name)`` returns the
objective's instance; the generic loop in ``training/train.py`` only calls
its hooks.

Adding an objective: write ``objectives/<module>.py`` with a subclass of
``base.Objective`` (``name`` and ``local_loss``, plus whichever hooks it
needs); it is registered by being here. Add a config and tests.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from prolip_jax import errors
from prolip_jax.objectives.base import Objective


def discover() -> dict[str, Objective]:
  """``{name: instance}`` of the ``Objective`` subclass each module of
  this package defines (a class a module imports belongs to its own; a
  folder appended to ``__path__`` adds its modules too)."""
  found = {}
  for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if info.name == 'base':
      continue
    module = importlib.import_module(f'{__name__}.{info.name}')
    for _, cls in inspect.getmembers(module, inspect.isclass):
      if (issubclass(cls, Objective) and cls.__module__ == module.__name__
          and getattr(cls, 'name', None)):
        if cls.name in found:
          raise ImportError(f'two objectives named {cls.name!r}')
        found[cls.name] = cls()
  return found


REGISTRY: dict[str, Objective] = discover()
OBJECTIVES = tuple(REGISTRY)


def get(name: str) -> Objective:
  """The objective called ``name``."""
  if name not in REGISTRY:
    raise errors.ConfigError(f'unknown objective {name!r}'
                             f'{errors.nearest(name, OBJECTIVES)}; have '
                             f'{OBJECTIVES}')
  return REGISTRY[name]
