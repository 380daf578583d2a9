"""PTX read as text: a kernel's instructions (statements), its loop's body, their classes, and the registers
`ptxas` gives it. What `benchmarks/gpu_kernel_instructions.py` counts, apart from the compiling, so that
it can be tested on a hand-written module without jax's CUDA plugin."""

from __future__ import annotations

import collections
import importlib.util
import os
import pathlib
import re
import subprocess

# PTX opcodes (their first dot-separated part) by the unit or purpose they take an issue slot for.
CLASSES = {
  'fma': 'fused multiply-add',
  'mul': 'multiply',
  'add': 'add',
  'sub': 'add',
  'neg': 'add',
  'min': 'min/max',
  'max': 'min/max',
  'div': 'special function',
  'rcp': 'special function',
  'ex2': 'special function',
  'rsqrt': 'special function',
  'sqrt': 'special function',
  'cvt': 'convert',
  'ld': 'memory',
  'st': 'memory',
  'shfl': 'memory',
}


def instructions(statements: list[str]) -> collections.Counter:
  """PTX statements by class (`CLASSES`, 'other' for the rest)."""
  return collections.Counter(CLASSES.get(s.split('.')[0], 'other') for s in statements)


def entry_statements(ptx: str, kernel: str) -> tuple[list[str], list[str]]:
  """The statements of `.entry kernel` (directives, labels and comments left out) and those of its
  loop's body (between a label and the branch back to it; empty without a loop)."""
  body = ptx[ptx.index(f'.entry {kernel}(') :]
  body = body[body.index('{') + 1 :]
  lines = body[: re.search(r'^}', body, re.MULTILINE).start()].splitlines()
  statements, labels, loop = [], {}, []
  for line in lines:
    line = line.split('//')[0].strip()
    if not line or line.startswith(('.', '{', '}')):
      continue
    if line.endswith(':'):
      labels[line[:-1]] = len(statements)
      continue
    for statement in filter(None, (s.strip() for s in line.split(';'))):
      statement = re.sub(r'^@!?%p\d+\s+', '', statement)  # a predicate guards it; it is still issued
      branch = re.match(r'bra(?:\.uni)?\s+(\$\w+)', statement)
      if branch and branch.group(1) in labels:  # a branch back: what lies between is the loop's body
        loop = statements[labels[branch.group(1)] :] + [statement]
      statements.append(statement)
  return [s.split()[0] for s in statements], [s.split()[0] for s in loop]


def registers(ptx_file: pathlib.Path, kernel: str) -> int | None:
  """Registers per thread `ptxas -v` reports for `kernel`, None without `ptxas`."""
  nvcc = importlib.util.find_spec('nvidia.cuda_nvcc') if importlib.util.find_spec('nvidia') else None
  ptxas = pathlib.Path(nvcc.submodule_search_locations[0], 'bin', 'ptxas') if nvcc else None
  if ptxas is None or not ptxas.exists():  # `ptxas` comes with jax's CUDA plugin's dependencies
    return None
  arch = re.search(r'^\.target\s+(\w+)', ptx_file.read_text(), re.MULTILINE).group(1)
  report = subprocess.run(
    [str(ptxas), f'-arch={arch}', '-v', str(ptx_file), '-o', os.devnull], capture_output=True, text=True
  ).stderr
  for block in report.split('Compiling entry function')[1:]:
    if block.split("'")[1] == kernel:
      return int(re.search(r'Used (\d+) registers', block).group(1))
  return None
