"""Training objectives, selected by ``config.objective``.

Each objective is one module here with an ``Objective`` subclass (the
interface and its hooks are in ``base.py``); its pure loss functions live in
``prolip_jax.losses``. ``get(name)`` returns the registered instance; the
generic loop in ``train.py`` only calls its hooks.

Adding an objective: write ``objectives/<name>.py`` with a subclass of
``base.Objective`` (``name`` and ``local_loss``, plus whichever hooks it
needs), register it in ``REGISTRY`` below, add a config and tests.
"""

from __future__ import annotations

from prolip_jax import errors
from prolip_jax.objectives.base import Objective
from prolip_jax.objectives.clip import CLIPObjective
from prolip_jax.objectives.otter import OTTERObjective
from prolip_jax.objectives.pcclip import PCCLIPObjective
from prolip_jax.objectives.pcme import PCMEObjective
from prolip_jax.objectives.prolip import ProLIPObjective
from prolip_jax.objectives.siglip import SigLIPObjective
from prolip_jax.objectives.uniclip import UniCLIPObjective

REGISTRY: dict[str, Objective] = {
    o.name: o for o in (ProLIPObjective(), SigLIPObjective(), CLIPObjective(),
                        PCMEObjective(), OTTERObjective(), UniCLIPObjective(),
                        PCCLIPObjective())
}
OBJECTIVES = tuple(REGISTRY)


def get(name: str) -> Objective:
  """The registered objective called ``name``."""
  if name not in REGISTRY:
    raise errors.ConfigError(f'unknown objective {name!r}'
                             f'{errors.nearest(name, OBJECTIVES)}; have '
                             f'{OBJECTIVES}')
  return REGISTRY[name]
