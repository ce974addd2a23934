"""The README and the docs/ pages: every relative link resolves, and the
README's Python snippet runs.

Links are checked the way GitHub renders them: a path relative to the page
must name an existing file, and a ``#fragment`` must be the slug of a
heading in the target page (lower case, punctuation other than ``-`` and
``_`` dropped, spaces to ``-``, ``-1``, ``-2``... for repeated headings).
Links inside fenced code blocks are not links; ``http(s):`` and other
schemes are not checked (the tests run offline).
"""

import glob
import importlib.util
import os
import re

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FENCE = re.compile(r'^```.*?^```', re.S | re.M)
_LINK = re.compile(r'\]\(([^)\s]+)\)')
_HEADING = re.compile(r'^#{1,6}\s+(.+?)\s*#*\s*$', re.M)


def _pages(root: str) -> list[str]:
  return ([os.path.join(root, 'README.md')]
          + sorted(glob.glob(os.path.join(root, 'docs', '*.md'))))


def _prose(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return _FENCE.sub('', f.read())


def heading_slug(heading: str) -> str:
  """GitHub's anchor for a Markdown heading."""
  text = re.sub(r'[^\w\- ]', '', heading.strip().lower())
  return text.replace(' ', '-')


def anchors(path: str) -> set[str]:
  """Every ``#fragment`` the headings of ``path`` define."""
  out, seen = set(), {}
  for m in _HEADING.finditer(_prose(path)):
    slug = heading_slug(m.group(1))
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f'{slug}-{n}')
  return out


def broken_links(root: str) -> list[str]:
  """``'page: target (why)'`` for each relative link that does not resolve."""
  bad = []
  for page in _pages(root):
    for m in _LINK.finditer(_prose(page)):
      target = m.group(1)
      if re.match(r'[a-zA-Z][a-zA-Z0-9+.-]*:', target):
        continue
      path, _, fragment = target.partition('#')
      resolved = (os.path.normpath(os.path.join(os.path.dirname(page), path))
                  if path else page)
      where = f'{os.path.relpath(page, root)}: {target}'
      if not os.path.exists(resolved):
        bad.append(f'{where} (no such file)')
      elif fragment and (not resolved.endswith('.md')
                         or fragment not in anchors(resolved)):
        bad.append(f'{where} (no heading with that anchor)')
  return bad


def test_heading_slugs_follow_github():
  assert heading_slug('Training ViT-B/16 on accelerators') == (
      'training-vit-b16-on-accelerators')
  assert heading_slug('What a run writes, resuming') == (
      'what-a-run-writes-resuming')
  assert heading_slug('Using `prolip_jax.load`') == 'using-prolip_jaxload'


def test_checker_finds_broken_links(tmp_path):
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'README.md').write_text(
      '# Top\n[ok](docs/a.md#part-one) [gone](docs/b.md) '
      '[bad anchor](docs/a.md#part-two) [self](#top) [web](https://x.y/z)\n'
      '```\n[in code](nowhere.md)\n```\n')
  (tmp_path / 'docs' / 'a.md').write_text('# A\n## Part one\n[up](../README.md)\n')
  assert broken_links(str(tmp_path)) == [
      'README.md: docs/b.md (no such file)',
      'README.md: docs/a.md#part-two (no heading with that anchor)']


def test_readme_and_docs_links_resolve():
  bad = broken_links(REPO)
  assert not bad, 'broken links:\n' + '\n'.join(bad)


def test_readme_is_a_short_front_door():
  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    lines = f.read().splitlines()
  assert len(lines) <= 250, f'README.md has {len(lines)} lines; move detail to docs/'
  listed = set(re.findall(r'\]\((docs/[\w.-]+\.md)\)', '\n'.join(lines)))
  pages = {os.path.relpath(p, REPO) for p in glob.glob(
      os.path.join(REPO, 'docs', '*.md'))}
  assert pages <= listed, f'docs pages the README does not list: {pages - listed}'


@pytest.mark.slow
def test_readme_snippet_runs_on_a_trained_workdir(tmp_path, monkeypatch,
                                                   capsys):
  """The README's "Using a trained model" snippet, run as written on a short
  run in ``workdirs/prolip_tiny``: it encodes one digit of each class and
  prints their predictions beside the labels 0-9."""
  from prolip_jax.training import train  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      'prolip_micro', os.path.join(REPO, 'configs', 'prolip_micro.py'))
  cfg_mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(cfg_mod)
  cfg = cfg_mod.get_config()
  cfg.total_steps = 2
  cfg.mesh.num_devices = 1
  train.train_and_evaluate(cfg, str(tmp_path / 'workdirs' / 'prolip_tiny'))

  with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
    readme = f.read()
  snippet = readme.split('## Using a trained model')[1]
  snippet = snippet.split('```python')[1].split('```')[0]
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  scope = {}
  exec(snippet, scope)  # pylint: disable=exec-used
  printed = capsys.readouterr().out.strip().splitlines()
  assert printed[-1].endswith('[0 1 2 3 4 5 6 7 8 9]'), printed
  np.testing.assert_array_equal(scope['labels'][::100], np.arange(10))
  assert scope['mu'].shape == (10, cfg.model.embed_dim)
  # tr(Σ) as printed is the sum of exp(log σ²) of each caption.
  trace = np.exp(np.asarray(scope['logvar_t'], np.float64)).sum(-1)
  assert len(trace) == 2 and np.all(trace > 0)
