"""`benchmarks/gpu_speed.sh`, the GPU speed measurements in one call: its usage errors, and (slow) the whole
call at a tiny size on the CPU (`GPU_SPEED_TINY=1`), every row run and its JSON written (the PyTorch peer
rows need PyTorch, and timm for its ViT)."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'benchmarks' / 'gpu_speed.sh'


def _run(args, env=None, timeout=60):
  # python3 on PATH is this interpreter, whose environment has dsjax's dependencies.
  path = f'{os.path.dirname(sys.executable)}{os.pathsep}{os.environ["PATH"]}'
  env = dict(os.environ, PATH=path, JAX_PLATFORMS='cpu', **(env or {}))
  return subprocess.run(
    ['bash', str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout
  )


def test_usage_and_an_outdir_that_is_a_file_are_one_line_and_exit_2(tmp_path):
  proc = _run([])
  assert proc.returncode == 2 and proc.stderr.strip().count('\n') == 0
  assert proc.stderr.startswith('usage: benchmarks/gpu_speed.sh OUTDIR')
  a_file = tmp_path / 'f'
  a_file.write_text('')
  proc = _run([str(a_file)])
  assert proc.returncode == 2 and proc.stderr.strip() == f'OUTDIR: {a_file} exists and is not a directory'


def _row_names():
  """Every row the script names: its bench, row and peer rows, and its traffic rows ('<name>_traffic')."""
  script = SCRIPT.read_text()
  named = set(re.findall(r'^(?:bench|row|peer) (\w+) ', script, re.M))
  return named | {f'{name}_traffic' for name in re.findall(r'^traffic (\w+) ', script, re.M)}


@pytest.mark.slow
def test_the_whole_call_runs_at_a_tiny_size_on_the_cpu(tmp_path):
  out = tmp_path / 'out'
  proc = _run(
    [str(out), 'cpu', '100000'],
    env={'GPU_SPEED_TINY': '1', 'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'cache')},
    timeout=1200,
  )
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert 'FAILED' not in proc.stdout and 'skipped: none' in proc.stdout
  # Every JSON a row names is written, under the names benchmarks/README.md cites (with PREFIX 'cpu').
  named = _row_names()
  assert {'torch_gpt2_small_b16', 'torch_vit_b16_b128_timm'} <= named
  # A peer row whose library is missing here is left out, and named as such.
  for library, left_out in (
    ('torch', lambda name: name.startswith('torch_')),
    ('timm', lambda n: n.endswith('_timm')),
  ):
    if importlib.util.find_spec(library) is None:
      assert all(
        f'{name}: not run, {library} is not installed' in proc.stdout for name in named if left_out(name)
      )
      named = {name for name in named if not left_out(name)}
  written = {p.name for p in out.glob('cpu_*.json')}
  assert written == {f'cpu_{name}.json' for name in named}, (written, named)


def test_a_second_call_into_the_same_outdir_reruns_no_row_whose_json_is_there(tmp_path):
  # Resumability: with every row's JSON present (the traffic rows' own outputs, not the profiles they
  # read), nothing is run; with one removed, that row alone would run (the budget of 0 skips it, named).
  out = tmp_path / 'out'
  out.mkdir()
  names = _row_names()
  for name in names:
    (out / f'cpu_{name}.json').write_text('{}')
  env = {'GPU_SPEED_TINY': '1', 'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'cache')}
  proc = _run([str(out), 'cpu', '0'], env=env)
  assert proc.returncode == 0, proc.stdout[-3000:]
  for name in names:  # a peer row whose library is missing is named as such first
    assert f'=== cpu_{name}: done already' in proc.stdout or (
      name.startswith('torch_') and f'=== cpu_{name}: not run' in proc.stdout
    )
  assert 'skipped: none' in proc.stdout
  (out / 'cpu_gpt2_small_b16_traffic.json').unlink()
  (out / 'cpu_vit_b16_b128.json').write_text('{"cut off')  # a JSON a kill left half-written
  proc = _run([str(out), 'cpu', '0'], env=env)
  assert '=== cpu_gpt2_small_b16_traffic: skipped' in proc.stdout
  assert '=== cpu_vit_b16_b128: skipped' in proc.stdout
  assert 'skipped: vit_b16_b128 gpt2_small_b16_traffic' in proc.stdout
