"""The benchmark numbers in the docs and the JSONs behind them stay together: every results file the docs
name (README.md, docs/, benchmarks/README.md, the package's READMEs, experiments/) is in
`benchmarks/results/`, and every file there is named by some doc, so no number loses its source and no
stale result lingers unexplained.

The docs name files singly (`h100_gpt2_small_b16.json`) or by shell-like patterns: braces
(`cpu_side_by_side_{1,...,6}.json`, `cpu4_*_{1..5}.json`, `h100_gpt_192x256_{before,after}.json`) and
`*` wildcards (`cpu2_*`).
"""

from __future__ import annotations

import fnmatch
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'benchmarks' / 'results'
DOCS = [
  ROOT / 'README.md',
  *sorted((ROOT / 'docs').rglob('*.md')),
  *sorted((ROOT / 'benchmarks').rglob('*.md')),
  *sorted((ROOT / 'dsjax').rglob('README.md')),
  *sorted((ROOT / 'experiments').rglob('*.md')),
]
# A results name as the docs write it: a device prefix, then name characters, braces and wildcards.
RESULT_NAME = re.compile(r'\b((?:h100|h200|cpu)[\w*{},.]*)')


def _expand(pattern: str) -> list[str]:
  """Brace expansion: {a,b}, and numeric ranges written {1..5} or {1,...,6}."""
  match = re.search(r'\{([^{}]*)\}', pattern)
  if not match:
    return [pattern]
  body = match.group(1)
  numeric = re.fullmatch(r'(\d+)(?:\.\.|,\.\.\.,)(\d+)', body)
  options = (
    [str(i) for i in range(int(numeric.group(1)), int(numeric.group(2)) + 1)] if numeric else body.split(',')
  )
  head, tail = pattern[: match.start()], pattern[match.end() :]
  return [name for option in options for name in _expand(head + option + tail)]


def _cited_patterns() -> list[str]:
  patterns = []
  for doc in DOCS:
    for token in RESULT_NAME.findall(doc.read_text()):
      token = token.rstrip('.,')
      if token.endswith('.json') or token.endswith('*'):
        patterns += _expand(token)
  return patterns


def test_expand_braces():
  assert _expand('a_{1..3}.json') == ['a_1.json', 'a_2.json', 'a_3.json']
  assert _expand('a_{1,...,2}_{x,y}.json') == ['a_1_x.json', 'a_1_y.json', 'a_2_x.json', 'a_2_y.json']


def test_every_cited_result_exists():
  files = sorted(p.name for p in RESULTS.glob('*.json'))
  missing = [p for p in _cited_patterns() if not fnmatch.filter(files, p)]
  assert not missing, f'the docs cite results that benchmarks/results/ lacks: {missing}'


def test_every_result_is_cited():
  patterns = _cited_patterns()
  orphans = [
    p.name
    for p in sorted(RESULTS.glob('*.json'))
    if not any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns)
  ]
  assert not orphans, f'results in benchmarks/results/ that no doc names: {orphans}'
