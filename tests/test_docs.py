"""The docs hold together: every relative link of README.md, docs/, benchmarks/README.md, experiments/ and
the package's READMEs names a file or folder of the repository, and every `#anchor` a heading of the
page it points to (GitHub's heading slugs), so that what moved out of the README stays reachable."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [
  ROOT / 'README.md',
  *sorted((ROOT / 'docs').rglob('*.md')),
  *sorted((ROOT / 'benchmarks').rglob('*.md')),
  *sorted((ROOT / 'experiments').rglob('*.md')),
  *sorted((ROOT / 'dsjax').rglob('README.md')),
]
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')
FENCE = re.compile(r'^```.*?^```', re.M | re.S)


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
  text = re.sub(r'[`*]', '', heading.strip().lower())  # rendering drops them; '_' in code stays
  text = re.sub(r'[^\w\- ]', '', text)
  return text.replace(' ', '-')


def _anchors(page: pathlib.Path) -> set[str]:
  found, seen = set(), {}
  for line in FENCE.sub('', page.read_text()).splitlines():
    match = re.match(r'#{1,6}\s+(.*)', line)
    if match:
      slug = _slug(match.group(1))
      found.add(slug if slug not in seen else f'{slug}-{seen[slug]}')
      seen[slug] = seen.get(slug, 0) + 1
  return found


def _links():
  for doc in DOCS:
    for target in LINK.findall(FENCE.sub('', doc.read_text())):
      if re.match(r'[a-z]+:', target):  # http:, https:, mailto:
        continue
      yield doc, target


def test_docs_exist():
  assert (ROOT / 'docs').is_dir() and len(DOCS) > 10


def test_relative_links_resolve():
  broken = []
  for doc, target in _links():
    path, _, anchor = target.partition('#')
    page = (doc.parent / path).resolve() if path else doc
    if not page.exists():
      broken.append(f'{doc.relative_to(ROOT)}: {target}')
    elif anchor and page.suffix == '.md' and anchor not in _anchors(page):
      broken.append(f'{doc.relative_to(ROOT)}: {target} (no such heading)')
  assert not broken, 'links that do not resolve:\n' + '\n'.join(broken)


def test_readme_is_a_short_guide():
  readme = (ROOT / 'README.md').read_text()
  assert len(readme.splitlines()) <= 200
  linked = {
    target.partition('#')[0] for doc, target in _links() if doc.name == 'README.md' and doc.parent == ROOT
  }
  pages = {str(p.relative_to(ROOT)) for p in (ROOT / 'docs').glob('*.md')}
  assert pages <= linked, f'docs pages the README does not link: {sorted(pages - linked)}'
