"""The layers between the packages of ``prolip_jax``.

``test_imports.py`` forbids cycles between modules; this test forbids them
between packages: each subpackage (``evaluation``, ``objectives``, ...) is
one node, each module at the package root (``evaluate``, ``plotting``,
...) another, and an edge is any import between two nodes, inside a function or
not. The package's own ``__init__`` (the ``prolip_jax.load`` facade) is no
node. On top of that, a few one-way rules: evaluation sits below training
(training imports evaluation, never the reverse), models import nothing
from data, objectives nothing from evaluation, and neither data nor
training imports the offline converters (conversion imports data).
"""

from support import find_cycle
from support import import_graph

PACKAGE = 'prolip_jax'

# Package-level edges that close a cycle and are kept for now, each with
# why; the test fails once one is gone, so that the list only shrinks.
ALLOWED: set[tuple[str, str]] = set()

# (importer package, imported package or module): never imported.
FORBIDDEN = [
    ('prolip_jax.evaluation', 'prolip_jax.training'),  # the training loop
    ('prolip_jax.models', 'prolip_jax.data'),
    ('prolip_jax.objectives', 'prolip_jax.evaluation'),
    # The offline converters read data's record format; a training run
    # never imports them.
    ('prolip_jax.data', 'prolip_jax.conversion'),
    ('prolip_jax.training', 'prolip_jax.conversion'),
]


def node(module: str) -> str:
  """The package-level node of a module: ``prolip_jax.evaluation.runner``
  -> ``prolip_jax.evaluation``; a root module is its own node."""
  return '.'.join(module.split('.')[:2])


def package_graph(modules: dict[str, set[str]]) -> tuple[dict, dict]:
  """``({node: nodes it imports}, {(node, node): [(module, module)]})``."""
  graph, why = {}, {}
  for module, targets in modules.items():
    if module == PACKAGE:
      continue
    graph.setdefault(node(module), set())
    for target in targets:
      a, b = node(module), node(target)
      if target == PACKAGE or a == b:
        continue
      graph[a].add(b)
      why.setdefault((a, b), []).append((module, target))
  return graph, why


def _under(module: str, prefix: str) -> bool:
  return module == prefix or module.startswith(prefix + '.')


def test_node_and_graph_on_a_made_up_package():
  assert node('prolip_jax.evaluation.runner') == 'prolip_jax.evaluation'
  assert node('prolip_jax.inference') == 'prolip_jax.inference'
  graph, why = package_graph({
      'prolip_jax': {'prolip_jax.inference'},
      'prolip_jax.inference': {'prolip_jax.evaluation.metrics'},
      'prolip_jax.evaluation.runner': {'prolip_jax.inference',
                                       'prolip_jax.evaluation.metrics'},
      'prolip_jax.evaluation.metrics': set()})
  assert graph == {'prolip_jax.inference': {'prolip_jax.evaluation'},
                   'prolip_jax.evaluation': {'prolip_jax.inference'}}
  assert find_cycle(graph) is not None
  assert why[('prolip_jax.evaluation', 'prolip_jax.inference')] == [
      ('prolip_jax.evaluation.runner', 'prolip_jax.inference')]


def test_no_cycle_between_packages():
  graph, why = package_graph(import_graph())
  for a, b in ALLOWED:
    assert b in graph.get(a, ()), (
        f'{a} -> {b} is gone: remove it from ALLOWED')
    graph[a].discard(b)
  cycle = find_cycle(graph)
  assert cycle is None, 'import cycle between packages: ' + ' -> '.join(
      cycle) + '; ' + '; '.join(
          f'{a} -> {b} by {why[(a, b)][:3]}' for a, b in zip(cycle,
                                                               cycle[1:]))


def test_layers_go_one_way():
  wrong = []
  for module, targets in import_graph().items():
    for target in targets:
      for low, high in FORBIDDEN:
        if _under(module, low) and _under(target, high):
          wrong.append(f'{module} imports {target}')
  assert not wrong, '; '.join(sorted(wrong))


def test_the_offline_converters_are_imported_by_nothing_in_the_package():
  """``conversion`` reads ``data``'s record format and is imported only by
  the tools, benchmarks and tests, never by a module of the package."""
  graph, why = package_graph(import_graph())
  assert 'prolip_jax.data' in graph['prolip_jax.conversion']
  importers = sorted(a for a, targets in graph.items()
                     if 'prolip_jax.conversion' in targets)
  assert not importers, [why[(a, 'prolip_jax.conversion')] for a in importers]
