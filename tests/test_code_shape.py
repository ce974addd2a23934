"""Code shape: no function in the package, the benchmarks or the tools is
longer than ``_MAX_LINES`` lines (``def`` to its last line, docstring and
comments included), and no module of the package longer than
``_MAX_FILE_LINES``."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MAX_LINES = 100
_MAX_FILE_LINES = 600
_CHECKED_DIRS = ('prolip_jax', 'benchmarks', 'tools')


def _python_files():
  """Every .py file under ``_CHECKED_DIRS``, as paths from the repo root."""
  for top in _CHECKED_DIRS:
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in sorted(files):
        if name.endswith('.py'):
          yield os.path.relpath(os.path.join(root, name), REPO)


def _long_functions():
  """``(path, line, name, length)`` of every function (nested and methods
  included) longer than ``_MAX_LINES`` lines."""
  found = []
  for path in _python_files():
    with open(os.path.join(REPO, path), encoding='utf-8') as f:
      tree = ast.parse(f.read(), filename=path)
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > _MAX_LINES:
          found.append((path, node.lineno, node.name, length))
  return sorted(found)


def test_no_function_over_the_line_limit():
  long = [f'{path}:{line} {name} ({length} lines)'
          for path, line, name, length in _long_functions()]
  assert not long, (f'functions over {_MAX_LINES} lines (split them into '
                    'named helpers):\n  ' + '\n  '.join(long))


def test_no_package_module_over_the_file_limit():
  long = []
  for path in _python_files():
    if path.startswith('prolip_jax' + os.sep):
      with open(os.path.join(REPO, path), encoding='utf-8') as f:
        lines = sum(1 for _ in f)
      if lines > _MAX_FILE_LINES:
        long.append(f'{path} ({lines} lines)')
  assert not long, (f'modules over {_MAX_FILE_LINES} lines (split them by '
                    'concern):\n  ' + '\n  '.join(long))
