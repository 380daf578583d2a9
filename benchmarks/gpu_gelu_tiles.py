r"""The fused bias + GELU kernels (`dsjax.models.fused_ops`) at other tile sizes, timed on a GPU beside
XLA's own fusions of the same math: which sizes bring the two kernels nearer the memory bandwidth.

  python benchmarks/gpu_gelu_tiles.py [--rows=16384] [--cols=3072] [--dtype=bfloat16] [--repeats=50]
                                      [--grid] [--json=FILE] [--tiny]

On an H200 the GELU's kernels ran at 50% (backward) and 58% (forward) of the bandwidth in GPT-2 small's
step, where the norms' backward kernel reached 88% (benchmarks/README.md). For the current tiling and,
with `--grid`, each tiling in the grid around it (`fused_ops.GeluTiles`: elements per block, columns
per block, backward programs at most, warps) this compiles GELU(z + b) forward, and forward with
backward (`jax.vjp`), at the shape of GPT-2 small's FFN (batch 16 × 1024 positions, 3072 hidden units;
ViT-B/16's is 25216 × 3072), checks the result against
the plain math, and times each: the median (and min–max) over `--repeats` timings of 10 calls issued
back to back and waited for once, per call, after 3 warm-up calls, so that no call waits for the host.
The bandwidth counts the forward pass as reading z and writing the activation, the backward (the
forward with backward less the forward) as reading z and the activation's gradient and writing z's: 2
and 3 passes over an (rows, cols) array of `--dtype`. `--tiny`: a small shape, two tilings and 2
repeats, run in Pallas' interpreter off a GPU (a check that the script runs).

On the H200 no tiling took the kernels above 53% of the bandwidth, and XLA's own forward fusion of the
same erf ran at 40%: the per-element arithmetic of the exact erf (a rational function with a float32
division) may be what holds both. So two more rows time the same kernels with the erf left out (`erf`
replaced by one multiply: wrong values, timing only; `erf_left_out` in the JSON), the default tiling's
and XLA's: the difference is the erf's share of each kernel's time. And one row times the current
tiling with `fused_ops.GELU_FMA` on (`fma`, checked against the plain math as the tilings are): compiled
for an H200, the kernels' arithmetic is then some two thirds of the instructions per element
(benchmarks/gpu_kernel_instructions.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax import bench
from dsjax.models import fused_ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hlo_traffic  # noqa: E402 (benchmarks/hlo_traffic.py, beside this script)

WARMUP = 3
CALLS_PER_TIMING = 10


def tilings(tiny: bool, grid: bool) -> list[fused_ops.GeluTiles]:
  """The current tiling first, then (`--grid`) the grid around it."""
  current = fused_ops.gelu_tiles()
  if tiny:
    return [current, fused_ops.GeluTiles(256, 64, 2, 4)]
  if not grid:
    return [current]
  grid = itertools.product((4096, 8192, 16384), (512, 1024), (256, 1024), (4, 8))
  return [current] + [tiles for tiles in itertools.starmap(fused_ops.GeluTiles, grid) if tiles != current]


def timed_ms(fn, args, repeats: int) -> dict:
  """Milliseconds per call: median and min–max of `repeats` timings of CALLS_PER_TIMING calls each."""
  for _ in range(WARMUP):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    outputs = [fn(*args) for _ in range(CALLS_PER_TIMING)]
    jax.block_until_ready(outputs)
    times.append(1e3 * (time.perf_counter() - start) / CALLS_PER_TIMING)
  return {'median_ms': statistics.median(times), 'min_ms': min(times), 'max_ms': max(times)}


def forward_and_backward(gelu):
  """The activation and the gradients: the activation returned too, or XLA would drop the forward
  kernel, whose output the backward pass does not read."""

  def fn(z, bias, da):
    a, vjp = jax.vjp(gelu, z, bias)
    return a, *vjp(da)

  return jax.jit(fn)


def measure(gelu, args, repeats: int) -> dict:
  """Forward alone and forward with backward, and their outputs (for the check)."""
  forward, both = jax.jit(gelu), forward_and_backward(gelu)
  return {
    'forward': timed_ms(forward, args[:2], repeats),
    'forward_backward': timed_ms(both, args, repeats),
    'outputs': both(*args),
  }


def _erf_left_out(x: jax.Array, fused: bool = False) -> jax.Array:
  """A stand-in for erf of one multiply: the kernels' memory traffic and the rest of their arithmetic
  as they are, the erf's left out (the values are wrong)."""
  return 0.5 * x


def bias_gelu_without_erf(z: jax.Array, bias: jax.Array) -> jax.Array:
  """`fused_ops.bias_gelu_reference` with `_erf_left_out` for erf (timing only)."""
  u = z + bias.astype(z.dtype)
  return 0.5 * u * (1.0 + _erf_left_out(u * 0.7071067811865476))


def erf_left_out_rows(args, repeats: int) -> dict:
  """The default tiling's kernels and XLA's fusions, each with the erf left out (`_erf_left_out` in
  place of the kernels' `fused_ops._erf` for these traces only)."""
  exact_erf = fused_ops._erf
  fused_ops._erf = _erf_left_out
  try:  # a new function, so that no trace with the exact erf is reused
    kernels = measure(lambda z, b: fused_ops.bias_gelu(z, b), args, repeats)
  finally:
    fused_ops._erf = exact_erf
  return {'pallas_default_tiling': kernels, 'xla': measure(bias_gelu_without_erf, args, repeats)}


def fma_row(args, repeats: int) -> dict:
  """The current tiling's kernels with `fused_ops.GELU_FMA` on (a·b + c as one fused multiply-add
  where the kernels are compiled for a GPU; in the interpreter the same arithmetic as without)."""
  fused_ops.GELU_FMA = True
  try:  # a new function, so that no trace without the fused multiply-adds is reused
    return measure(lambda z, b: fused_ops.bias_gelu(z, b), args, repeats)
  finally:
    fused_ops.GELU_FMA = False


def max_relative_difference(outputs, reference_outputs) -> float:
  """Of each output (activation, z's gradient, the bias gradient), the largest difference over its
  largest value: the same function up to rounding (the kernel's float32 sum and GELU, stored in the
  array's dtype)."""
  return max(
    float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b)))
    for a, b in zip(outputs, reference_outputs)
  )


def bandwidth(row: dict, nbytes: int, device_bandwidth: float | None) -> dict:
  forward_s = row['forward']['median_ms'] / 1e3
  # The backward pass by difference; below a microsecond the two timings cannot separate it.
  backward_s = max(row['forward_backward']['median_ms'] / 1e3 - forward_s, 1e-6)
  out = {
    'forward_tb_per_s': 2 * nbytes / forward_s / 1e12,
    'backward_tb_per_s': 3 * nbytes / backward_s / 1e12,
  }
  if device_bandwidth:
    out |= {k.replace('tb_per_s', 'fraction'): v * 1e12 / device_bandwidth for k, v in list(out.items())}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rows', type=int, default=16384)
  parser.add_argument('--cols', type=int, default=3072)
  parser.add_argument('--dtype', default='bfloat16', choices=('bfloat16', 'float32'))
  parser.add_argument('--repeats', type=int, default=50)
  parser.add_argument('--json', default=None)
  parser.add_argument('--tiny', action='store_true')
  parser.add_argument('--grid', action='store_true', help='Also time the grid of tilings around the current.')
  args = parser.parse_args()
  if min(args.rows, args.cols, args.repeats) < 1:
    parser.error('--rows, --cols and --repeats must be positive')
  rows, cols, repeats = (64, 96, 2) if args.tiny else (args.rows, args.cols, args.repeats)
  device = jax.devices()[0]
  device_bandwidth = hlo_traffic.memory_bandwidth(device.device_kind)
  keys = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(args.dtype)
  z = (2 * jax.random.normal(keys[0], (rows, cols))).astype(dtype)
  bias = 0.1 * jax.random.normal(keys[1], (cols,), jnp.float32)
  da = jax.random.normal(keys[2], (rows, cols)).astype(dtype)
  nbytes = rows * cols * dtype.itemsize

  reference = measure(fused_ops.bias_gelu_reference, (z, bias, da), repeats)
  results = []
  print(f'GELU(z + b) at ({rows}, {cols}) {args.dtype} on {device.device_kind}; jax {jax.__version__}')
  print(
    'tiling (block elements, columns, backward programs, warps) | forward ms | fwd+bwd ms | TB/s fwd, bwd'
  )

  def report(name, row):
    row |= bandwidth(row, nbytes, device_bandwidth)
    print(
      f'{name:42s} {row["forward"]["median_ms"]:8.3f} {row["forward_backward"]["median_ms"]:10.3f}'
      f'   {row["forward_tb_per_s"]:.2f}, {row["backward_tb_per_s"]:.2f}'
    )

  report("XLA's fusions (the plain math)", reference)
  for tiles in tilings(args.tiny, args.grid):
    sizes = list(dataclasses.astuple(tiles))
    fused_ops.GELU_TILES = tiles
    try:  # A new function per tiling, so that no trace of another tiling is reused.
      row = measure(lambda z, b: fused_ops.bias_gelu(z, b), (z, bias, da), repeats)
    except Exception as error:  # a tiling Triton cannot compile: named, and the grid goes on
      print(f'{str(sizes):42s} failed: {type(error).__name__}: {str(error)[:200]}')
      results.append({'tiles': sizes, 'error': f'{type(error).__name__}: {error}'})
      continue
    finally:
      fused_ops.GELU_TILES = None
    row['max_relative_difference'] = max_relative_difference(row.pop('outputs'), reference['outputs'])
    report(str(sizes), row)
    results.append({'tiles': sizes, **row})
  fma = fma_row((z, bias, da), repeats)
  fma['max_relative_difference'] = max_relative_difference(fma.pop('outputs'), reference['outputs'])
  report('current tiling, fused multiply-adds', fma)
  reference.pop('outputs')
  erf_left_out = erf_left_out_rows((z, bias, da), repeats)
  for name, row in erf_left_out.items():
    row.pop('outputs')
    report(
      {'pallas_default_tiling': 'default tiling', 'xla': "XLA's fusions"}[name] + ', no erf (timing only)',
      row,
    )
  out = {
    'device': device.device_kind,
    'jax': jax.__version__,
    'date': time.strftime('%Y-%m-%d'),
    **bench.commit_fields(),
    'shape': [rows, cols],
    'dtype': args.dtype,
    'repeats': repeats,
    'xla': reference,
    'tilings': results,
    'fma': {'tiles': list(dataclasses.astuple(fused_ops.gelu_tiles())), **fma},
    'erf_left_out': erf_left_out,
    'fastest': min(
      (r for r in results if 'error' not in r), key=lambda r: r['forward_backward']['median_ms']
    )['tiles'],
  }
  print('fastest forward + backward:', out['fastest'])
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(out, f, indent=1, default=lambda a: np.asarray(a).tolist())


if __name__ == '__main__':
  main()
