"""Prints the exact versions of a requirement's installed dependency closure.

  python constraints/freeze.py 'prolip_jax[test,torch]' > constraints/py311.txt

Run it in the environment to record (after `pip install -e '.[test,torch]'`):
it walks the installed distributions from the given requirements through
their own requirements (extras and environment markers honoured), so the
file lists what the project needs and nothing else the environment holds.
The header lines of the checked-in files are written by hand.
"""

import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(roots: list[str]) -> dict[str, str]:
  """Canonical name -> installed version, for ``roots`` and all they need."""
  seen: dict[tuple[str, tuple[str, ...]], md.Distribution] = {}

  def visit(text: str):
    req = Requirement(text)
    key = (canonicalize_name(req.name), tuple(sorted(req.extras)))
    if key in seen:
      return
    try:
      dist = md.distribution(req.name)
    except md.PackageNotFoundError:
      return  # a marker-excluded or optional requirement not installed here
    seen[key] = dist
    for sub in dist.requires or []:
      sub_req = Requirement(sub)
      extras = list(req.extras) or ['']
      if sub_req.marker and not any(
          sub_req.marker.evaluate({'extra': e}) for e in extras):
        continue
      visit(sub)

  for root in roots:
    visit(root)
  return {name: dist.version for (name, _), dist in seen.items()}


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(__doc__, file=sys.stderr)
    return 2
  versions = closure(argv[1:])
  roots = {canonicalize_name(Requirement(r).name) for r in argv[1:]}
  for name in sorted(versions):
    if name not in roots:
      print(f'{name}=={versions[name]}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
