r"""The fused kernels' instructions, compiled for an NVIDIA GPU on a machine without one: how much
arithmetic each element costs, set beside the memory traffic.

  python benchmarks/gpu_kernel_instructions.py [--target=h200] [--rows=16384] [--width=768]
                                               [--hidden=3072] [--json=FILE]

On an H200 the GELU's two kernels (`dsjax.models.fused_ops.bias_gelu`) ran at 50–58% of the memory
bandwidth in GPT-2 small's step whatever their tiling, where the residual norm's reached 88%
(benchmarks/README.md). A kernel whose instructions take longer to issue than its bytes take to move
cannot reach the bandwidth, whatever its tiling. This script compiles, for the target, the GELU's
forward and backward kernels at GPT-2 small's FFN shape (`--rows` = batch 16 × 1024 positions,
`--hidden` units), once as they are and once with `fused_ops.GELU_FMA` on, and the residual norm's
(`--width`) for comparison, has XLA write the PTX of every kernel, and counts (`ptx_count.py`) each kernel's
instructions: per thread, per element (the loop body of a backward kernel, per element of one
iteration), by class. Then, for the whole kernel at that shape:
  * `issue_bound_us`: its warp instructions at one per clock on each of an SM's four schedulers, all
    SMs busy (the target's count and clock; `hlo_traffic.DEVICES`) — a lower bound: it counts PTX, not
    the machine code `ptxas` makes of it, and no instruction waits;
  * `memory_bound_us`: its bytes (`hlo_traffic.py`: each operand read once, each output written once)
    at the target's bandwidth;
  * `registers`: per thread, from `ptxas -v` where jax's CUDA plugin ships `ptxas`.
XLA compiles with the flags in `XLA_FLAGS` (the JSON records them): a lower optimization level there
counts other, unoptimized code. Nothing runs: which bound a kernel meets first is a measurement for a GPU
(benchmarks/gpu_gelu_tiles.py times both forms of the GELU's kernels).
Needs jax's CUDA plugin (`pip install '.[cuda]'`), not a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # compile for the target; run nothing on this machine

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from dsjax import bench, models  # noqa: E402
from dsjax.models import fused_ops  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_compiled_traffic  # noqa: E402 (benchmarks/, beside this script)
import hlo_traffic  # noqa: E402
import paired  # noqa: E402
import ptx_count  # noqa: E402


def dump_ptx() -> pathlib.Path:
  """A new directory XLA writes every compiled kernel's PTX to. XLA reads its flags once, at its first
  compilation: this is called before that."""
  directory = tempfile.mkdtemp(prefix='dsjax_ptx_')
  flags = [os.environ.get('XLA_FLAGS', ''), f'--xla_dump_to={directory}', '--xla_dump_hlo_pass_re=NONE']
  os.environ['XLA_FLAGS'] = ' '.join(flags).strip()
  return pathlib.Path(directory)


def ptx_of(dump: pathlib.Path, module: str, kernel: str) -> pathlib.Path:
  """The dumped PTX file of `module` (the jitted function's name) that holds `.entry kernel`."""
  for path in sorted(dump.glob(f'*.jit_{module}.*.ptx')):
    if f'.entry {kernel}(' in path.read_text():
      return path
  raise FileNotFoundError(f'no PTX of {kernel} in the dump of jit_{module} ({dump})')


def geometry(kernel: str, rows: int, cols: int) -> dict:
  """How the kernel covers a (rows, cols) array: programs, warps per program, iterations of its loop per
  program (1 without one), and the elements one thread handles per iteration (padding included) and of
  them the real ones."""
  if 'gelu' in kernel:
    tiles = fused_ops.gelu_tiles()
    block_rows, block_cols = fused_ops._gelu_blocks(rows, cols, tiles)
    warps, column_blocks, max_programs = tiles.num_warps, pl.cdiv(cols, block_cols), tiles.backward_programs
  else:
    block_rows, block_cols = fused_ops._norm_blocks(rows, cols)
    warps, column_blocks, max_programs = fused_ops.NUM_WARPS, 1, None
  if kernel.endswith('_backward'):
    programs, per_program = fused_ops._backward_programs(rows, block_rows, max_programs)
  else:
    programs, per_program = pl.cdiv(rows, block_rows), 1
  threads = 32 * warps
  return {
    'programs': programs * column_blocks,
    'warps_per_program': warps,
    'iterations_per_program': per_program,
    'block': [block_rows, block_cols],
    'elements_per_thread': block_rows * block_cols / threads,
    'real_elements_per_thread': block_rows * min(block_cols, cols) / threads,
  }


def kernel_row(
  ptx_file: pathlib.Path, kernel: str, shape: tuple[int, int], traffic_bytes: float, target: dict
):
  """What `kernel` of `ptx_file` costs at `shape` on `target` (the module docstring's fields)."""
  statements, loop = ptx_count.entry_statements(ptx_file.read_text(), kernel)
  shape_geometry = geometry(kernel, *shape)
  per_iteration = loop if loop else statements
  outside_loop = len(statements) - len(loop)
  warp_instructions = (
    shape_geometry['programs']
    * shape_geometry['warps_per_program']
    * (outside_loop + shape_geometry['iterations_per_program'] * len(loop))
  )
  issue_rate = target['core_count'] * 4 * target['clock_rate_ghz'] * 1e9  # warp instructions per second
  per_element = len(per_iteration) / shape_geometry['real_elements_per_thread']
  return {
    'instructions_per_thread': len(statements),
    'loop_instructions_per_thread': len(loop),
    'instructions_per_element': per_element,
    'per_element_by_class': {
      name: count / shape_geometry['real_elements_per_thread']
      for name, count in sorted(ptx_count.instructions(per_iteration).items())
    },
    'registers': ptx_count.registers(ptx_file, kernel),
    **shape_geometry,
    'warp_instructions': warp_instructions,
    'issue_bound_us': 1e6 * warp_instructions / issue_rate,
    'gb': traffic_bytes / 1e9,
    'memory_bound_us': 1e6 * traffic_bytes / target['memory_bandwidth'],
  }


def compile_kernels(name: str, fn, args, on_device) -> dict[str, float]:
  """`fn` (forward and backward of one fused op) compiled for the target as jit_`name`; each Pallas
  kernel's traffic in bytes (`hlo_traffic`)."""

  def step(*arrays):  # a new function each time, so that no trace of another form is reused
    return fn(*arrays)

  step.__name__ = name
  placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device) for a in args]
  compiled = jax.jit(step).lower(*placed).compile()
  return {k.group: k.bytes for k in hlo_traffic.kernels(compiled.as_text()) if k.kind == 'pallas'}


def gelu_forward_backward(z, bias, da):
  a, vjp = jax.vjp(fused_ops.bias_gelu, z, bias)
  return a, *vjp(da)


def residual_norm_forward_backward(x, h, gain, bias, dx, dy):
  def fn(x, h, gain, bias):
    norm = dict(kind='layernorm', eps=1e-5, out_dtype=jnp.bfloat16)
    return fused_ops.residual_norm(x, h, 1.0, 1.0, gain, bias, **norm)

  outputs, vjp = jax.vjp(fn, x, h, gain, bias)
  return outputs, *vjp((dx, dy))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--target', default='h200', help=f'The GPU: one of {sorted(hlo_traffic.DEVICES)}.')
  parser.add_argument('--rows', type=int, default=16384, help='Rows of the activations (batch × positions).')
  parser.add_argument('--width', type=int, default=768, help="The residual stream's width.")
  parser.add_argument('--hidden', type=int, default=3072, help="The FFN's hidden width.")
  parser.add_argument('--json', default=None, help='Also write the results to this JSON file.')
  args = parser.parse_args()
  if args.target not in hlo_traffic.DEVICES:
    parser.error(f'--target must be one of {sorted(hlo_traffic.DEVICES)}, got {args.target!r}')
  if min(args.rows, args.width, args.hidden) < 1:
    parser.error('--rows, --width and --hidden must be positive')
  paired.check_output_args(parser, args)
  if not gpu_compiled_traffic.has_cuda_plugin():
    parser.exit(2, f"{parser.prog}: needs jax's CUDA plugin (no GPU): pip install '.[cuda]'\n")
  target = hlo_traffic.DEVICES[args.target]
  xla_flags = os.environ.get('XLA_FLAGS', '')
  dump = dump_ptx()
  on_device = gpu_compiled_traffic.one_device_of(target)
  n, d, f = args.rows, args.width, args.hidden
  bf16, f32 = jnp.bfloat16, jnp.float32
  gelu_args = [jnp.zeros((n, f), bf16), jnp.zeros((f,), f32), jnp.zeros((n, f), bf16)]
  norm_args = [jnp.zeros((n, d), f32), jnp.zeros((n, d), bf16), jnp.zeros((d,), f32), jnp.zeros((d,), f32)]
  norm_args += [jnp.zeros((n, d), f32), jnp.zeros((n, d), bf16)]
  results = {
    'target': target['name'],
    'jax': jax.__version__,
    'xla_flags': xla_flags,
    'date': time.strftime('%Y-%m-%d'),
    **bench.commit_fields(),
    'rows': n,
    'width': d,
    'hidden': f,
    'gelu_tiles': list(dataclasses.astuple(fused_ops.gelu_tiles())),
    'kernels': {},
  }
  with models.compiling_for('gpu'):
    for fma in (False, True):
      fused_ops.GELU_FMA = fma
      module = f'gelu_{"fma" if fma else "as_written"}'
      try:
        traffic = compile_kernels(module, gelu_forward_backward, gelu_args, on_device)
      finally:
        fused_ops.GELU_FMA = False
      for kernel in ('fused_bias_gelu', 'fused_bias_gelu_backward'):
        row = kernel_row(ptx_of(dump, module, kernel), kernel, (n, f), traffic[kernel], target)
        results['kernels'][f'{kernel}{"_fma" if fma else ""}'] = row
    traffic = compile_kernels('residual_norm', residual_norm_forward_backward, norm_args, on_device)
    for kernel in ('fused_residual_norm', 'fused_residual_norm_backward'):
      ptx_file = ptx_of(dump, 'residual_norm', kernel)
      results['kernels'][kernel] = kernel_row(ptx_file, kernel, (n, d), traffic[kernel], target)

  print(f'compiled for {target["name"]} (jax {jax.__version__}); GELU at ({n}, {f}), norm at ({n}, {d})')
  print('kernel                              instr/elem  registers  issue-bound µs  memory-bound µs')
  for name, row in results['kernels'].items():
    print(
      f'{name:36s} {row["instructions_per_element"]:9.1f}  {row["registers"] or "-":>9}'
      f'  {row["issue_bound_us"]:14.1f}  {row["memory_bound_us"]:15.1f}'
    )
    classes = ', '.join(f'{k} {v:.1f}' for k, v in row['per_element_by_class'].items())
    print(f'    per element: {classes}')
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
