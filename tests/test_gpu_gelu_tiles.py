"""`benchmarks/gpu_gelu_tiles.py` at its tiny size on the CPU (the kernels in Pallas' interpreter): every
tiling is checked against the plain math and timed, the JSON names the fastest, and the rows with
fused multiply-adds and with the erf left out are timed."""

import json

from tests.helpers import run_python


def test_the_tiny_grid_runs_and_matches_the_plain_math(tmp_path):
  out = tmp_path / 'tiles.json'
  proc = run_python('benchmarks/gpu_gelu_tiles.py', '--tiny', f'--json={out}')
  assert proc.returncode == 0, proc.stderr[-2000:]
  results = json.loads(out.read_text())
  tilings = [row['tiles'] for row in results['tilings']]
  assert len(tilings) == 2 and tilings[0] != tilings[1] and results['fastest'] in tilings
  for row in results['tilings']:
    assert row['max_relative_difference'] < 0.02  # bfloat16 outputs of the same float32 math
    assert row['forward']['median_ms'] > 0 and row['forward_backward']['median_ms'] > 0
  assert results['xla']['forward']['median_ms'] > 0
  # The current tiling with fused multiply-adds (in the interpreter the same arithmetic), checked too.
  assert results['fma']['tiles'] == tilings[0] and results['fma']['max_relative_difference'] < 0.02
  # The erf left out, timing only: the default tiling's kernels and XLA's fusions.
  for row in results['erf_left_out'].values():
    assert row['forward_backward']['median_ms'] > 0 and 'backward_tb_per_s' in row


def test_bad_sizes_are_one_line():
  proc = run_python('benchmarks/gpu_gelu_tiles.py', '--rows=0', timeout=120)
  assert proc.returncode == 2 and 'must be positive' in proc.stderr.strip().splitlines()[-1]
