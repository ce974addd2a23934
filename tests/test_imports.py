"""No import cycles inside ``prolip_jax``, counting imports inside functions.

A module-level cycle breaks at import time; a cycle hidden behind an import
inside a function still ties the modules together (neither can be read,
tested or moved without the other), so both kinds count. Edges go to the
most specific module an import names: ``from prolip_jax.losses import csd``
is an edge to ``prolip_jax.losses`` (``csd`` is a function), ``from
prolip_jax.data import digits`` to ``prolip_jax.data.digits``.
"""

import ast
import os

import prolip_jax

PACKAGE_DIR = os.path.dirname(prolip_jax.__file__)


def _modules() -> dict[str, str]:
  """``{dotted module name: file path}`` of every module in the package."""
  out = {}
  root = os.path.dirname(PACKAGE_DIR)
  for dirpath, _, files in os.walk(PACKAGE_DIR):
    for f in files:
      if not f.endswith('.py'):
        continue
      path = os.path.join(dirpath, f)
      rel = os.path.relpath(path, root)[:-3].split(os.sep)
      if rel[-1] == '__init__':
        rel = rel[:-1]
      out['.'.join(rel)] = path
  return out


def _resolve_relative(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
  parts = module.split('.')
  if not is_pkg:
    parts = parts[:-1]
  if node.level > 1:
    parts = parts[:len(parts) - (node.level - 1)]
  return '.'.join(parts + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
  """``{module: modules of the package it imports anywhere in its code}``."""
  modules = _modules()
  graph = {m: set() for m in modules}
  for module, path in modules.items():
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), path)
    is_pkg = path.endswith('__init__.py')
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = (_resolve_relative(node, module, is_pkg) if node.level
                else node.module or '')
        for a in node.names:
          sub = f'{base}.{a.name}'
          targets.append(sub if sub in modules else base)
      for t in targets:
        if t in modules and t != module:
          graph[module].add(t)
  return graph


def find_cycle(graph: dict[str, set[str]]):
  """One cycle as a list of modules (first == last), or None."""
  state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
  stack: list[str] = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == 1:
        return stack[stack.index(n):] + [n]
      if n not in state:
        found = visit(n)
        if found:
          return found
    stack.pop()
    state[m] = 2
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


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
