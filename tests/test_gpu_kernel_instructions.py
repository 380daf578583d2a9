"""`benchmarks/gpu_kernel_instructions.py` (the fused kernels' PTX instructions, compiled for a GPU on a
machine without one): how it reads a kernel's PTX (`benchmarks/ptx_count.py`), its one-line usage
errors, and, where jax's CUDA plugin is installed, the GELU kernels compiled for an H200 with and
without fused multiply-adds."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, run_python, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'benchmarks'))
import ptx_count  # noqa: E402

HAVE_CUDA_PLUGIN = any(importlib.util.find_spec(f'jax_cuda{v}_plugin') for v in (12, 13))

# Two kernels as Triton's PTX writes them: statements joined on a line (an inline-asm load behind a
# predicate), comments, directives, and in the second a loop (a label and the branch back to it).
PTX = """
.version 8.8
.target sm_90a
.visible .entry straight(
\t.param .u64 .ptr .align 256 straight_param_0
)
.reqntid 128, 1, 1
{
\t.reg .b32 \t%r<9>;
\tld.param.b64 \t%rd1, [straight_param_0];  // the pointer
\tmov.u32 %r1, %r5; @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
\tfma.rn.f32 %r6, %r1, %r2, %r3;
\tmul.rn.f32 \t%r7, %r6, %r6;
\tret;
}
.visible .entry looped(
\t.param .u64 .ptr .align 256 looped_param_0
)
{
\tmov.b32 \t%r1, 0;
$L__BB1_1:
\tadd.rn.f32 \t%r2, %r2, %r1;
\tex2.approx.ftz.f32 \t%r3, %r2;
\tsetp.lt.s32 \t%p1, %r1, 8;
\t@%p1 bra \t$L__BB1_1;
\tst.global.b32 [ %rd1 + 0 ], %r3;
\tret;
}
"""


def test_a_kernels_statements_and_its_loop_are_read_from_its_ptx():
  statements, loop = ptx_count.entry_statements(PTX, 'straight')
  assert statements == ['ld.param.b64', 'mov.u32', 'ld.global.v4.b32', 'fma.rn.f32', 'mul.rn.f32', 'ret']
  assert loop == []
  statements, loop = ptx_count.entry_statements(PTX, 'looped')
  assert loop == ['add.rn.f32', 'ex2.approx.ftz.f32', 'setp.lt.s32', 'bra']
  assert statements == ['mov.b32', *loop, 'st.global.b32', 'ret']
  classes = ptx_count.instructions(statements)
  assert classes == {'other': 4, 'add': 1, 'special function': 1, 'memory': 1}


@pytest.mark.parametrize(
  'args, message',
  [
    (['--target=a100'], "--target must be one of ['h100', 'h200'], got 'a100'"),
    (['--rows=0'], '--rows, --width and --hidden must be positive'),
  ],
)
def test_bad_arguments_are_one_line(args, message):
  proc = run_python('benchmarks/gpu_kernel_instructions.py', *args, timeout=120)
  assert proc.returncode == 2 and 'Traceback' not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].endswith(message)


@pytest.mark.skipif(not HAVE_CUDA_PLUGIN, reason="needs jax's CUDA plugin (pip install '.[cuda]'), not a GPU")
def test_fused_multiply_adds_take_fewer_instructions_per_element(tmp_path):
  out = tmp_path / 'instructions.json'
  script = ['benchmarks/gpu_kernel_instructions.py', '--rows=2048', '--hidden=1024', '--width=256']
  # Without the tests' XLA flags: their optimization level 0 would count unoptimized PTX.
  env = subprocess_env(JAX_PLATFORMS='cpu', XLA_FLAGS='')
  proc = subprocess.run(
    [sys.executable, *script, f'--json={out}'],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  kernels = json.loads(out.read_text())['kernels']
  for kernel in ('fused_bias_gelu', 'fused_bias_gelu_backward'):
    as_written, fma = kernels[kernel], kernels[f'{kernel}_fma']
    assert 'fused multiply-add' in fma['per_element_by_class']
    assert fma['instructions_per_element'] < as_written['instructions_per_element']
  # 512 row blocks over 256 programs: each loops twice.
  assert kernels['fused_bias_gelu_backward']['loop_instructions_per_thread'] > 0
