"""No import cycles inside ``prolip_jax``, counting imports inside functions.

A module-level cycle breaks at import time; a cycle hidden behind an import
inside a function still ties the modules together (neither can be read,
tested or moved without the other), so both kinds count. Edges go to the
most specific module an import names: ``from prolip_jax.losses import csd``
is an edge to ``prolip_jax.losses`` (``csd`` is a function), ``from
prolip_jax.data import digits`` to ``prolip_jax.data.digits``.
"""

from support import find_cycle
from support import import_graph


def test_finder_sees_a_cycle():
  # The checker itself: a cycle through a function-level import is found.
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c',
                                                               'a']
  assert find_cycle({'a': {'b'}, 'b': set()}) is None
  graph = import_graph()
  assert 'prolip_jax.objectives.base' in graph['prolip_jax.training.train'] or (
      'prolip_jax.objectives' in graph['prolip_jax.training.train'])
  # Function-level imports are edges too (``prolip_jax.load``).
  assert 'prolip_jax.interop.load' in graph['prolip_jax']


def test_no_import_cycles():
  cycle = find_cycle(import_graph())
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)
