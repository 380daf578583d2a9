"""`benchmarks/hlo_traffic.py` (the memory traffic of a compiled GPU program's kernels, from its HLO text)
and `benchmarks/gpu_compiled_traffic.py` (a train step compiled for a GPU on a machine without one): the
traffic of a small hand-written module, the script's one-line usage errors, and, where jax's CUDA plugin
is installed, a tiny GPT compiled for an H100 with cuDNN's attention and the Pallas kernels lowered."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from dsjax.instrument import probe

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'benchmarks' / 'gpu_compiled_traffic.py'
sys.path.insert(0, str(ROOT / 'benchmarks'))
import hlo_traffic  # noqa: E402

HAVE_CUDA_PLUGIN = any(importlib.util.find_spec(f'jax_cuda{v}_plugin') for v in (12, 13))
TINY_GPT = ['--set=model.depth=2', '--set=model.width=64', '--set=model.num_heads=2', '--set=data.seq_len=32']

# A loop of 3 layers over a stacked f32[3,64,64] weight, as a scanned model's step compiles: per layer a
# fusion casts the layer's slice of the weight to bf16 and a matmul fusion uses it; after the loop a
# cuDNN attention call, a Pallas (Triton) kernel and a copy.
MODULE = """HloModule jit_step

%fused_cast (param_0: f32[3,64,64], param_1: s32[]) -> bf16[64,64] {
  %param_0 = f32[3,64,64]{2,1,0} parameter(0)
  %convert.1 = bf16[3,64,64]{2,1,0} convert(%param_0), metadata={op_name="jit(step)/jvp()/convert_element_type"}
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,64,64]{2,1,0} dynamic-slice(%convert.1, %param_1, %zero, %zero), dynamic_slice_sizes={1,64,64}
  ROOT %bitcast.1 = bf16[64,64]{1,0} bitcast(%dynamic-slice.1)
}

%gemm (p0: bf16[128,64], p1: bf16[64,64]) -> bf16[128,64] {
  %p0 = bf16[128,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[128,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (state: (s32[], bf16[128,64], f32[3,64,64])) -> (s32[], bf16[128,64], f32[3,64,64]) {
  %state = (s32[], bf16[128,64]{1,0}, f32[3,64,64]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = bf16[128,64]{1,0} get-tuple-element(%state), index=1
  %w = f32[3,64,64]{2,1,0} get-tuple-element(%state), index=2
  %cast = bf16[64,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_cast, metadata={op_name="jit(step)/jvp()/convert_element_type" deduplicated_name="loop_convert_fusion"}
  %mm = bf16[128,64]{1,0} fusion(%x, %cast), kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/jvp()/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %next = (s32[], bf16[128,64]{1,0}, f32[3,64,64]{2,1,0}) tuple(%i, %mm, %w)
}

%cond (state: (s32[], bf16[128,64], f32[3,64,64])) -> pred[] {
  %state = (s32[], bf16[128,64]{1,0}, f32[3,64,64]{2,1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: bf16[128,64], w: f32[3,64,64]) -> bf16[128,64] {
  %x = bf16[128,64]{1,0} parameter(0)
  %w = f32[3,64,64]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[128,64]{1,0}, f32[3,64,64]{2,1,0}) tuple(%zero, %x, %w)
  %loop = (s32[], bf16[128,64]{1,0}, f32[3,64,64]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = bf16[128,64]{1,0} get-tuple-element(%loop), index=1
  %attn = (bf16[128,64]{1,0}, u8[0]{0}) custom-call(%y, %y, %y), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/jvp()/attention"}
  %a = bf16[128,64]{1,0} get-tuple-element(%attn), index=0
  %k = bf16[128,64]{1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/transpose(jvp())/fused_gelu_backward/pallas_call"}, backend_config={name = "fused_gelu_backward", num_warps = 4 : i32}
  ROOT %out = bf16[128,64]{1,0} copy(%k), metadata={op_name="jit(step)/add"}
}
"""  # noqa: E501 (an HLO instruction is one line)
ACTIVATION = 128 * 64 * 2  # bytes of one bf16[128,64]
CAST = 3 * (64 * 64 * 4 + 4 + 64 * 64 * 2)  # the loop's casts


def test_traffic_of_a_small_module():
  by_name = {k.name: k for k in hlo_traffic.kernels(MODULE)}
  assert sorted(by_name) == ['attn', 'cast', 'k', 'mm', 'out']
  # In the loop, 3 launches each; the cast reads one layer's f32 slice (not the stack) and the layer
  # index, and writes bf16.
  assert (by_name['cast'].launches, by_name['cast'].bytes) == (3, CAST)
  assert (by_name['cast'].kind, by_name['cast'].phase, by_name['cast'].group) == (
    'other',
    'forward',
    'loop_convert_fusion',
  )
  assert by_name['mm'].kind == 'matmul' and by_name['mm'].bytes == 3 * (2 * ACTIVATION + 64 * 64 * 2)
  assert by_name['attn'].kind == 'attention' and by_name['attn'].bytes == 4 * ACTIVATION
  assert (by_name['k'].kind, by_name['k'].phase, by_name['k'].group) == (
    'pallas',
    'backward',
    'fused_gelu_backward',
  )
  assert (by_name['out'].phase, by_name['out'].bytes) == ('update', 2 * ACTIVATION)


def test_summary_by_kind_phase_and_group():
  summary = hlo_traffic.summarize(hlo_traffic.kernels(MODULE), bandwidth_bytes_per_s=1e9, top=2)
  memory_bound = CAST + 2 * ACTIVATION + 2 * ACTIVATION  # the casts, the Pallas kernel, the copy
  assert summary['memory_bound']['gb'] == pytest.approx(memory_bound / 1e9)
  assert summary['memory_bound']['ms_at_bandwidth'] == pytest.approx(memory_bound / 1e9 * 1e3)
  assert summary['by_kind']['matmul']['kernels'] == 3
  assert summary['memory_bound_by_phase']['backward']['gb'] == pytest.approx(2 * ACTIVATION / 1e9)
  groups = [row['group'] for row in summary['top_memory_bound']]
  assert groups == ['loop_convert_fusion', 'fused_gelu_backward']


def test_profiled_kernels_beside_their_traffic():
  # As a GPU profile names them: the fusion by its deduplicated name, the Pallas kernel by its own, a
  # cuBLAS kernel (not in the HLO's memory-bound kernels) by the library's.
  measured = [
    {'kernel': 'loop_convert_fusion', 'ms_per_step': CAST / 1e9},  # at the bandwidth
    {'kernel': 'fused_gelu_backward', 'ms_per_step': 4 * ACTIVATION / 1e9},  # at half of it
    {'kernel': 'nvjet_sm90_tst_128x160', 'ms_per_step': 1.0},
  ]
  found = hlo_traffic.beside_profile(hlo_traffic.kernels(MODULE), measured, bandwidth_bytes_per_s=1e12)
  assert found['matched_kernels'] == 2
  assert [row['fraction_of_bandwidth'] for row in found['kernels']] == pytest.approx([1.0, 0.5])
  assert found['gb'] == pytest.approx((CAST + 2 * ACTIVATION) / 1e9)
  assert found['fraction_of_bandwidth'] == pytest.approx((CAST + 2 * ACTIVATION) / (CAST + 4 * ACTIVATION))


# Three fusions over one f32[1024]: the step's own add, a statistic's sum of squares alone, and the
# step's add fused with a statistic's sum (a multi-output fusion, as XLA makes of a probed activation).
SCOPED = 'jit(step)/jvp()/instrument_statistics'
PARTS_MODULE = f"""HloModule jit_step

%plain (p0: f32[1024]) -> f32[1024] {{
  %p0 = f32[1024]{{0}} parameter(0)
  ROOT %add.1 = f32[1024]{{0}} add(%p0, %p0), metadata={{op_name="jit(step)/jvp()/add"}}
}}

%sum_add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%squares (p0: f32[1024]) -> f32[] {{
  %p0 = f32[1024]{{0}} parameter(0)
  %sq = f32[1024]{{0}} multiply(%p0, %p0), metadata={{op_name="{SCOPED}/square"}}
  %zero = f32[] constant(0)
  ROOT %r = f32[] reduce(%sq, %zero), dimensions={{0}}, to_apply=%sum_add, metadata={{op_name="{SCOPED}/reduce_sum"}}
}}

%add_and_sum (p0: f32[1024]) -> (f32[1024], f32[]) {{
  %p0 = f32[1024]{{0}} parameter(0)
  %add.2 = f32[1024]{{0}} add(%p0, %p0), metadata={{op_name="jit(step)/jvp()/add"}}
  %zero = f32[] constant(0)
  %r = f32[] reduce(%add.2, %zero), dimensions={{0}}, to_apply=%sum_add, metadata={{op_name="{SCOPED}/reduce_sum"}}
  ROOT %t = (f32[1024]{{0}}, f32[]) tuple(%add.2, %r)
}}

ENTRY %main (x: f32[1024]) -> (f32[1024], f32[], (f32[1024], f32[])) {{
  %x = f32[1024]{{0}} parameter(0)
  %own = f32[1024]{{0}} fusion(%x), kind=kLoop, calls=%plain, metadata={{op_name="jit(step)/jvp()/add" deduplicated_name="loop_add_fusion"}}
  %stat = f32[] fusion(%own), kind=kInput, calls=%squares, metadata={{op_name="{SCOPED}/reduce_sum" deduplicated_name="input_reduce_fusion"}}
  %both = (f32[1024]{{0}}, f32[]) fusion(%own), kind=kInput, calls=%add_and_sum, metadata={{op_name="jit(step)/jvp()/add" deduplicated_name="input_add_reduce_fusion"}}
  ROOT %out = (f32[1024]{{0}}, f32[], (f32[1024]{{0}}, f32[])) tuple(%own, %stat, %both)
}}
"""  # noqa: E501 (an HLO instruction is one line)


def test_kernels_are_told_apart_by_the_statistics_scope():
  assert hlo_traffic.STATISTICS_SCOPE == probe.STATISTICS_SCOPE  # the name the instrumentation gives
  found = hlo_traffic.kernels(PARTS_MODULE)
  assert {k.name: k.part for k in found} == {'own': 'step', 'stat': 'statistics', 'both': 'mixed'}
  summary = hlo_traffic.summarize(found, bandwidth_bytes_per_s=1e9)
  assert {part: row['kernels'] for part, row in summary['by_part'].items()} == {
    'step': 1,
    'statistics': 1,
    'mixed': 1,
  }
  assert summary['memory_bound_by_part']['statistics']['gb'] == pytest.approx((4096 + 4) / 1e9)
  measured = [
    {'kernel': 'input_reduce_fusion', 'ms_per_step': 0.5},
    {'kernel': 'input_add_reduce_fusion', 'ms_per_step': 0.25},
  ]
  beside = hlo_traffic.beside_profile(found, measured, bandwidth_bytes_per_s=1e12)
  assert [row['part'] for row in beside['kernels']] == ['statistics', 'mixed']
  assert beside['by_part']['statistics']['ms_per_step'] == 0.5
  assert beside['by_part']['step']['matched_kernels'] == 0


def test_module_without_entry_is_an_error():
  with pytest.raises(ValueError, match='no ENTRY computation'):
    hlo_traffic.parse('HloModule empty\n')


def _run(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run(
    [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout
  )


@pytest.mark.parametrize(
  'args, expected',
  [
    (['--target=a100'], "--target must be one of ['h100', 'h200'], got 'a100'"),
    (
      ['--instrument=callback'],
      "--instrument must list some of ['off', 'return', 'sampled'], got 'callback'",
    ),
  ],
)
def test_usage_errors_are_one_line_and_write_nothing(tmp_path, args, expected):
  out = tmp_path / 'traffic.json'
  proc = _run(f'--json={out}', *args)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].endswith(expected), proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr and not out.exists()


@pytest.mark.skipif(HAVE_CUDA_PLUGIN, reason="checks the message of a machine without jax's CUDA plugin")
def test_without_the_cuda_plugin_one_line_names_what_to_install(tmp_path):
  proc = _run(f'--json={tmp_path / "traffic.json"}')
  assert proc.returncode == 2
  expected = "gpu_compiled_traffic.py: needs jax's CUDA plugin (no GPU): pip install '.[cuda]'"
  assert proc.stderr.strip() == expected
  assert not (tmp_path / 'traffic.json').exists()


@pytest.mark.skipif(not HAVE_CUDA_PLUGIN, reason="needs jax's CUDA plugin")
def test_tiny_gpt_compiled_for_an_h100(tmp_path):
  out = tmp_path / 'traffic.json'
  fused = '--set=model.fused_ops=pallas'
  proc = _run(*TINY_GPT, fused, '--instrument=off,return', f'--json={out}', f'--hlo={tmp_path}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())
  assert results['target']['name'] == 'NVIDIA H100 80GB HBM3'
  for mode in ('off', 'return'):
    kinds = results['modes'][mode]['by_kind']
    assert kinds['attention']['kernels'] == 2 * 2  # cuDNN's forward and backward kernels, per layer
    assert kinds['pallas']['kernels'] > 0 and kinds['matmul']['kernels'] > 0
    assert (tmp_path / f'{mode}.hlo.txt').exists()
    assert results['modes'][mode]['memory']['total_gib'] > 0
  # The statistics add traffic to the step, in kernels of their own and fused into the step's.
  assert results['modes']['return']['memory_bound']['gb'] > results['modes']['off']['memory_bound']['gb']
  assert results['modes']['off']['by_part']['step']['kernels'] == sum(
    row['kernels'] for row in results['modes']['off']['by_kind'].values()
  )
  assert results['modes']['return']['by_part']['statistics']['kernels'] > 0
