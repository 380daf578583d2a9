"""The architecture rules that import-linter (pyproject.toml, run by CI) does not check by itself.

* No function-level import of a dsjax module: imports inside functions hide cycles.
* No module outside `dsjax/schemes/` names a particular method: the trainer and the CLIs reach every
  method through `dsjax.schemes`, so adding a method never touches them.
"""

from __future__ import annotations

import ast
import pathlib
import re

from dsjax import schemes

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'dsjax'


def _modules():
  return sorted(p for p in PACKAGE.rglob('*.py'))


def test_no_function_level_imports_of_dsjax():
  found = []
  for path in _modules():
    tree = ast.parse(path.read_text())
    for func in ast.walk(tree):
      if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      for node in ast.walk(func):
        names = []
        if isinstance(node, ast.Import):
          names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
          names = [node.module or '']
        if any(n == 'dsjax' or n.startswith('dsjax.') for n in names):
          found.append(f'{path.relative_to(PACKAGE.parent)}:{node.lineno} in {func.name}()')
  assert not found, f'function-level imports of dsjax modules: {found}'


def test_scripts_with_absl_flags_report_user_errors_in_one_line():
  """Every script under experiments/ and benchmarks/ that parses absl flags starts through
  `dsjax.train.cli.run`, not `absl.app.run`, so a bad flag or path ends it in one line, not a traceback."""
  found = []
  for folder in ('experiments', 'benchmarks'):
    for path in sorted((PACKAGE.parent / folder).glob('*.py')):
      text = path.read_text()
      if 'flags.DEFINE_' in text and ('app.run(' in text or 'cli.run(' not in text):
        found.append(str(path.relative_to(PACKAGE.parent)))
  assert not found, f'scripts started without cli.run: {found}'


def test_no_module_outside_schemes_names_a_method():
  """String literals and attribute chains outside dsjax/schemes/ never name a registered method."""
  names = set(schemes.SCHEMES)
  found = []
  for path in _modules():
    rel = path.relative_to(PACKAGE)
    if rel.parts[0] == 'schemes':
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
        found.append(f'{rel}:{node.lineno} {node.value!r}')
      if isinstance(node, ast.Attribute) and node.attr in names:
        found.append(f'{rel}:{node.lineno} .{node.attr}')
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith('dsjax.schemes.'):
        found.append(f'{rel}:{node.lineno} import {node.module}')
  assert not found, f'modules outside dsjax/schemes name a method: {found}'


def test_code_and_docs_cite_papers_not_internal_notes():
  """References go to the papers (authors, year, section); the project's internal notes are not shipped."""
  pattern = re.compile(r'SPEC(\.md|\s*§)|\bseeds?/|\bseed 00\d')
  root = PACKAGE.parent
  files = [
    *root.glob('*.md'),
    *(root / 'configs').glob('*.py'),
    *(root / 'experiments').rglob('*.py'),
    *(root / 'experiments').rglob('*.md'),
    *PACKAGE.rglob('*.py'),
    *PACKAGE.rglob('*.md'),
  ]
  found = [
    f'{p.relative_to(root)}:{i}'
    for p in files
    for i, line in enumerate(p.read_text().splitlines(), 1)
    if pattern.search(line)
  ]
  assert not found, f'references to internal notes: {found}'
