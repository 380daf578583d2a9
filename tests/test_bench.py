"""`python -m dsjax.bench` on a tiny model: its JSON, the model-FLOPs formula and the parameter count.

Run as a subprocess: the CLI defines absl flags (`--config`) that other CLIs imported by the test
session define too.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import run_python

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / 'benchmarks'))
import paired  # noqa: E402 (benchmarks/paired.py)

DEPTH, WIDTH, SEQ_LEN, BATCH, VOCAB = 2, 32, 16, 8, 256

# One timed step of a tiny GPT, as every test here runs the benchmark.
TINY_BENCH = [
  sys.executable,
  '-m',
  'dsjax.bench',
  '--config=configs/gpt_preln.py',
  f'--config.model.depth={DEPTH}',
  f'--config.model.width={WIDTH}',
  f'--config.batch_size={BATCH}',
  f'--config.data.seq_len={SEQ_LEN}',
  '--steps=1',
]


def _tiny_benchmark(tmp_path, modes: str, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
  """The tiny benchmark in the `--instrument` modes `modes`, with 32 sampled rows per site and a 1 TFLOP/s
  peak: its process (checked to have succeeded) and its JSON."""
  out = tmp_path / 'bench.json'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  command = [*TINY_BENCH, f'--instrument={modes}', '--config.instrument.sample_rows=32', '--peak_tflops=1']
  proc = subprocess.run(
    [*command, f'--json={out}', *flags], capture_output=True, text=True, env=env, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc, json.loads(out.read_text())


def test_a_tiny_benchmark_writes_its_numbers(tmp_path):
  """The plain, returned and sampled instrumentation modes of one tiny run ('sampled' beside the 'return'
  step on whole tensors), its JSON, the FLOPs formula, the parameter count and the profile of the first
  mode."""
  out = tmp_path / 'bench.json'
  proc, results = _tiny_benchmark(tmp_path, 'off,return,sampled', f'--profile={tmp_path / "profile"}')
  assert 'instrumentation overhead (sampled)' in proc.stdout
  assert 'sampled statistics (32 rows per site)' in proc.stdout
  assert set(results['modes']) == {'off', 'return', 'sampled'}
  assert results['inputs'] == 'random' and results['sample_rows'] == 32
  assert results['compilation_cache'] is None  # every compile_s a cold compile
  # Every parameter but the looked-up token and position tables: q, k, v, o, FFN, two LayerNorms per
  # layer, then the final norm and the head (no bias).
  per_layer = 4 * (WIDTH * WIDTH + WIDTH) + 2 * (4 * WIDTH * WIDTH) + 4 * WIDTH + WIDTH + 2 * 2 * WIDTH
  num_params = DEPTH * per_layer + 2 * WIDTH + WIDTH * VOCAB
  assert results['matmul_params'] == num_params
  positions = BATCH * SEQ_LEN
  assert results['positions_per_step'] == positions
  assert results['model_flops_per_step'] == (6 * num_params + 12 * DEPTH * WIDTH * SEQ_LEN) * positions
  # The host's time in the collector after each dispatch, for the instrumented modes only.
  assert 'collector_ms_median' not in results['modes']['off']
  for mode in ('return', 'sampled'):
    r = results['modes'][mode]
    assert 0 < r['collector_ms_min'] <= r['collector_ms_median'] <= r['collector_ms_max']
  assert 'host in the collector after each dispatch' in proc.stdout
  for r in results['modes'].values():
    assert r['step_ms_min'] <= r['step_ms_median'] <= r['step_ms_max']
    assert r['pipelined_step_ms_min'] <= r['pipelined_step_ms_median'] <= r['pipelined_step_ms_max']
    assert math.isclose(r['pipelined_tokens_per_s'], positions / r['pipelined_step_ms_median'] * 1e3)
    assert r['compile_s'] > 0 and r['memory']['total_gib'] > 0
    assert math.isclose(r['mfu'], r['model_tflops_per_s'])  # peak 1 TFLOP/s
  # --profile traces the first mode: the time per XLA op (the CPU's ops stand in for kernels) and the HLO.
  profile = results['modes']['off']['profile']
  assert profile['busy_ms_per_step'] > 0 and profile['kernels']
  assert math.isclose(sum(profile['ms_per_step_by_kind'].values()), profile['busy_ms_per_step'])
  assert profile['ms_per_step_by_kind']['matmul'] > 0  # the CPU's ops that contain a dot
  assert profile['idle']['idle_ms_per_step'] >= 0 and profile['idle']['largest']
  assert profile['idle']['kernels_per_step'] >= len(profile['kernels']) / 3  # (3 traced steps)
  assert 'profile' not in results['modes']['return']
  assert (tmp_path / 'profile' / 'step.hlo.txt').read_text().startswith('HloModule')
  # benchmarks/profile_traffic.py finds the profiled kernels in that HLO (reads files only).
  traffic = tmp_path / 'traffic.json'
  hlo = tmp_path / 'profile' / 'step.hlo.txt'
  command = [
    sys.executable,
    'benchmarks/profile_traffic.py',
    f'--json={out}',
    f'--hlo={hlo}',
    f'--out={traffic}',
  ]
  proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  matched = json.loads(traffic.read_text())
  assert matched['matched_kernels'] > 0 and matched['gb'] > 0
  assert {row['kernel'] for row in matched['kernels']} <= {k['kernel'] for k in profile['kernels']}


# Slow (20 s): the callback delivery and the stability monitor run by default in tests/instrument/
# (test_instrument.py, test_monitor.py); this is their rows of the benchmark.
@pytest.mark.slow
def test_idle_time_is_the_gaps_in_the_union_of_the_kernels_named_by_their_neighbours():
  # Two streams over 2 steps: a overlaps b (no gap); c starts 5 after b's end; the second step repeats it,
  # 10 after the first's end. Gaps: b -> c in each step and c -> a between them, 20 ns over 2 steps.
  check = """
from dsjax import bench
one_step = [(0, 10, 'a'), (4, 12, 'b'), (17, 20, 'c')]
intervals = one_step + [(start + 30, end + 30, name) for start, end, name in one_step]
idle = bench.idle_gaps(intervals, num_steps=2)
assert abs(idle['idle_ms_per_step'] - 10 / 1e6) < 1e-12 and idle['gaps_per_step'] == 1.5, idle
assert idle['kernels_per_step'] == 3, idle
# The gaps are 5, 5 and 10 ns long: all under 2 us.
assert idle['idle_ms_per_step_by_gap'] == {**dict.fromkeys(bench.GAP_LABELS, 0.0), '<2us': 10 / 1e6}, idle
assert bench._gap_label(2_000) == '<5us' and bench._gap_label(5e6) == '>=1000us'
pairs = [(g['after'], g['before'], g['gaps_per_step']) for g in idle['largest']]
assert pairs == [('b', 'c', 1.0), ('c', 'a', 0.5)], pairs
assert bench.idle_gaps([], num_steps=3)['idle_ms_per_step_by_gap']['<2us'] == 0.0
assert bench.idle_gaps([], num_steps=3)['largest'] == []
"""
  result = subprocess.run([sys.executable, '-c', check], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


def test_the_callback_and_monitor_modes_time_their_overhead(tmp_path):
  proc, results = _tiny_benchmark(tmp_path, 'off,callback,monitor')
  assert 'instrumentation overhead (callback)' in proc.stdout
  assert 'instrumentation overhead (monitor)' in proc.stdout  # the 'return' step with the stability monitor
  assert set(results['modes']) == {'off', 'callback', 'monitor'}


def test_sampled_mode_without_sample_rows_is_one_line_before_anything_is_compiled(tmp_path):
  out = tmp_path / 'bench.json'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  command = [*TINY_BENCH, '--instrument=off,return,sampled', f'--json={out}']
  refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
  assert refused.returncode == 2 and 'Traceback' not in refused.stderr
  last = refused.stderr.strip().splitlines()[-1]
  assert (
    last
    == 'dsjax.bench: error: --instrument=sampled needs --config.instrument.sample_rows > 0 (rows per site)'
  )
  assert not out.exists()


NEEDS_THE_KERNELS = 'needs the fused kernels: --config.model.fused_ops=pallas (or auto, where it takes them)'


@pytest.mark.parametrize(
  'flag, expected',
  [
    (
      '--gelu_tiles=1,2,3',
      'expected 4 positive integers (block elements, columns per block, backward programs, warps)',
    ),
    ('--gelu_tiles=4096,1000,256,4', 'GeluTiles.column_block must be a positive power of two, got 1000'),
    ('--gelu_tiles=4096,1024,256,4', f'--gelu_tiles {NEEDS_THE_KERNELS}'),
    ('--gelu_fma', f'--gelu_fma {NEEDS_THE_KERNELS}'),
  ],
)
def test_a_bad_gelu_kernel_flag_is_one_line_and_writes_nothing(tmp_path, flag, expected):
  out = tmp_path / 'bench.json'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  command = [*TINY_BENCH, flag, f'--json={out}']
  refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
  assert refused.returncode == 2 and 'Traceback' not in refused.stderr
  assert refused.stderr.strip().splitlines()[-1].endswith(expected)
  assert not out.exists()


def test_peak_lookup_takes_the_longest_matching_device_kind():
  check = """
import types
from dsjax import bench
kind = lambda name: types.SimpleNamespace(device_kind=name)
assert bench.peak_tflops_for(kind('NVIDIA H100 80GB HBM3'), 'bfloat16') == 989.0
assert bench.peak_tflops_for(kind('NVIDIA H100 NVL'), 'bfloat16') == 835.0
assert bench.peak_tflops_for(kind('NVIDIA H100 PCIe'), 'float32') == 378.0
assert bench.peak_tflops_for(kind('TPU v5 lite'), 'bfloat16') == 197.0
assert bench.peak_tflops_for(kind('TPU v5'), 'bfloat16') == 459.0
assert bench.peak_tflops_for(kind('cpu'), 'float32') is None
"""
  result = subprocess.run([sys.executable, '-c', check], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


def test_the_recorded_commit_is_the_one_the_caller_names_with_the_checkout_head_beside_it():
  check = """
import os
from dsjax import bench
head = bench.source_commit()
os.environ['DSJAX_COMMIT'] = 'f' * 40
assert bench.recorded_commit() == 'f' * 40 and bench.source_commit() == head
del os.environ['DSJAX_COMMIT']
assert bench.recorded_commit() == head
"""
  result = subprocess.run([sys.executable, '-c', check], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


def test_matmul_ops_are_the_dots_and_the_fusions_around_one():
  check = """
import jax, jax.numpy as jnp
from dsjax import bench
x = jnp.ones((64, 64))
compiled = jax.jit(lambda a, b, c: (jnp.tanh(a @ b), jnp.exp(c))).lower(x, x, x).compile()
hlo = compiled.as_text()
entry = {line.split(' = ')[0].split()[-1].lstrip('%'): line for line in hlo.split('ENTRY')[1].splitlines()
         if ' = ' in line}
ops = bench.matmul_ops(hlo) & set(entry)
assert ops and all('exp' not in entry[op] for op in ops), (ops, hlo)
assert any('exp' in line for op, line in entry.items() if op not in ops), hlo
"""
  result = subprocess.run([sys.executable, '-c', check], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


def _run_tiny_script(script: str, *flags: str) -> None:
  """A script of benchmarks/ on the tiny GPT of TINY_BENCH (its `--config` and `--set` flags), on the CPU;
  checked to have succeeded."""
  sizes = {'model.depth': DEPTH, 'model.width': WIDTH, 'batch_size': BATCH, 'data.seq_len': SEQ_LEN}
  proc = run_python(
    script, '--config=configs/gpt_preln.py', *(f'--set={k}={v}' for k, v in sizes.items()), *flags
  )
  assert proc.returncode == 0, proc.stderr[-2000:]


# Slow (30 s): compiles three steps. By default `bench.prepare(shapes_only=True)` is compiled for an H100
# by tests/test_gpu_compiled_traffic.py where jax's CUDA plugin is installed.
@pytest.mark.slow
def test_steps_compiled_from_shapes_only(tmp_path):
  """`bench.prepare(shapes_only=True)`, as benchmarks/instrument_sampling_cost.py uses it: the plain,
  instrumented and sampled steps compiled with nothing computed, and XLA's cost analysis of each."""
  out = tmp_path / 'cost.json'
  _run_tiny_script('benchmarks/instrument_sampling_cost.py', '--rows=8', f'--json={out}')
  steps = json.loads(out.read_text())['steps']
  assert sorted(steps) == ['off', 'return', 'sampled_8']
  assert steps['return']['bytes_accessed'] > steps['off']['bytes_accessed'] > 0


def test_the_host_cost_of_the_statistics_is_timed_per_sink(tmp_path):
  """benchmarks/instrument_host_cost.py: one tiny instrumented step's statistics handed to the collector
  in its three sinks, in turns; the JSON has each sink's times and its ratio to the records alone."""
  out = tmp_path / 'host.json'
  _run_tiny_script('benchmarks/instrument_host_cost.py', '--rounds=2', '--pause=0', f'--json={out}')
  results = json.loads(out.read_text())
  assert sorted(results['step_ms']) == ['jsonl', 'jsonl_tensorboard', 'loop', 'records']
  assert all(len(times) == 2 for times in results['step_ms'].values())
  assert sorted(results['ratio_to_records_median']) == ['jsonl', 'jsonl_tensorboard', 'loop']


def test_a_long_runs_collector_is_timed_early_and_late(tmp_path):
  """benchmarks/instrument_long_run.py: a tiny step's statistics handed to one collector as many steps;
  the JSON has the first and last quarters' times, the full collections and the memory's growth."""
  out = tmp_path / 'long.json'
  _run_tiny_script('benchmarks/instrument_long_run.py', '--steps=8', f'--json={out}')
  results = json.loads(out.read_text())
  assert results['steps'] == 8 and results['sink'] == 'records'
  assert sorted(results['step_ms_by_quarter']) == ['first', 'last']
  for part in [*results['step_ms_by_quarter'].values(), results['step_ms_all']]:
    assert 0 < part['median'] <= part['p99'] <= part['max']
  assert results['step_ms_all']['max'] >= results['step_ms_by_quarter']['last']['max']
  assert isinstance(results['full_collections'], int) and results['gc_freeze'] == 'on'
  assert results['full_collection_ms_total'] >= results['full_collection_ms_max'] >= 0


def test_a_part_timed_on_its_own_is_taken_out_of_the_ratios():
  """benchmarks/paired.py `without_part`: what instrument_deliveries.py reports as the step less the
  making of its records, round by round, against the plain step that has no such part."""
  times = {'off': [10.0, 20.0], 'return': [15.0, 26.0]}
  out = paired.without_part(times, {'return': [3.0, 4.0]}, 'off', 'records')
  assert out['step_ms_without_records'] == {'off': [10.0, 20.0], 'return': [12.0, 22.0]}
  assert out['ratio_to_off_without_records_median']['return'] == pytest.approx((1.2 + 1.1) / 2)
  assert out['records_ms_median'] == {'return': 3.5}
