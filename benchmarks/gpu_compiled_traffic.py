r"""A dsjax train step compiled for an NVIDIA GPU on a machine without one, and the memory traffic of its
kernels.

  python benchmarks/gpu_compiled_traffic.py [--config=configs/gpt2_small.py] [--set=KEY=VALUE ...]
                                            [--target=h100|h200] [--instrument=off[,return][,sampled]]
                                            [--top=15] [--json=FILE] [--hlo=DIR]

Needs jax's CUDA plugin (`pip install '.[cuda]'`), not a GPU. `jax.experimental.topologies` describes
the target device (`hlo_traffic.DEVICES`, from the data sheets); the model is built and traced for a GPU
(`dsjax.models.compiling_for`: 'auto' takes bfloat16, cuDNN's attention and, at width ≥ 768, the fused
kernels; `model.fused_ops=pallas` lowers its Triton kernels rather than interpreting them, `none` keeps
the plain math) and XLA's GPU compiler compiles the step of
`dsjax.bench` (the loop's own, donated state, optimizer included) as it would on that device, with one
difference: without a device it cannot autotune, so the matmuls stay Triton GEMM fusions with default
tiles where a device picks cuBLAS or other tiles. The kernels around them are fused as on the device.

For each `--instrument` mode ('off', 'return': per-layer statistics on whole tensors, 'sampled': on
`instrument.sample_rows` rows per site) it prints every kernel kind's count and memory traffic
(`hlo_traffic.py`: each operand read once, slices counted as slices, each output written once), the
traffic's time at the device's memory bandwidth and the device memory the step needs (XLA's memory
analysis); for the memory-bound kernels (XLA's other fusions and Pallas kernels) also by phase
(forward, backward, the update) and the `--top` kernel groups, named as a profile names them (XLA's
deduplicated fusion names), so that they can be set beside a measured profile.
The matmuls' and attention's traffic is listed but is no time: they are compute-bound. `--hlo=DIR`
writes each compiled step's HLO as DIR/<mode>.hlo.txt; `--json=FILE` everything printed. Nothing runs:
what this gives is a lower bound on the memory-bound kernels' time and, between two versions of the
code, the change in their passes over the activations — measured times need the GPU
(benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # compile for the target; run nothing on this machine

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from dsjax import bench, models  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hlo_traffic  # noqa: E402 (benchmarks/hlo_traffic.py, beside this script)
import paired  # noqa: E402

MODES = ('off', 'return', 'sampled')
# The versions of the CUDA libraries that jax[cuda12] installs with jax 0.10 (cuDNN 9, CUDA 12.9).
_DNN_VERSION = (9, 28)
_RUNTIME_VERSION = (12, 9)


def target_config(target: dict) -> str:
  """The device description XLA's GPU compiler takes (a `GpuTargetConfigProto` in text form)."""
  major, minor = target['compute_capability']
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {target['shared_memory_per_core']}
  threads_per_core_limit: 2048
  core_count: {target['core_count']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(target['memory_bandwidth'])}
  l2_cache_size: {target['l2_cache_size']}
  clock_rate_ghz: {target['clock_rate_ghz']}
  device_memory_size: {target['device_memory_size']}
  shared_memory_per_block_optin: {target['shared_memory_per_block_optin']}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {_DNN_VERSION[0]} minor: {_DNN_VERSION[1]} }}
runtime_version {{ major: {_RUNTIME_VERSION[0]} minor: {_RUNTIME_VERSION[1]} }}
device_description_str: "{target['name']}"
"""


def has_cuda_plugin() -> bool:
  return any(importlib.util.find_spec(f'jax_cuda{v}_plugin') for v in (12, 13))


def one_device_of(target: dict) -> jax.sharding.NamedSharding:
  """A placement on one device of `target`, described to XLA's GPU compiler (no device needed)."""
  config = target_config(target)
  topology = topologies.get_topology_desc(platform='cuda', target_config=config, topology='1x1x1')
  mesh = jax.sharding.Mesh(np.array(topology.devices), ('devices',))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_for(on_device: jax.sharding.NamedSharding, step_fn, state, batch):
  """`step_fn` compiled with every input on `on_device` (the state donated, as the loop's step is)."""
  placed = lambda tree: jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device), tree
  )
  return jax.jit(step_fn, donate_argnums=0).lower(placed(state), placed(batch)).compile()


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  paired.add_config_args(parser)
  parser.set_defaults(config='configs/gpt2_small.py')
  parser.add_argument('--target', default='h100', help=f'The GPU: one of {sorted(hlo_traffic.DEVICES)}.')
  parser.add_argument('--instrument', default='off', help=f'Comma-separated modes, of {list(MODES)}.')
  parser.add_argument('--top', type=int, default=15, help='How many memory-bound kernel groups to list.')
  parser.add_argument('--json', default=None, help='Also write the results to this JSON file.')
  parser.add_argument('--hlo', default=None, help="Write each mode's compiled HLO text into this directory.")
  args = parser.parse_args()
  config = paired.config_from_args(parser, args)
  if args.target not in hlo_traffic.DEVICES:
    parser.error(f'--target must be one of {sorted(hlo_traffic.DEVICES)}, got {args.target!r}')
  modes = [m for m in args.instrument.split(',') if m]
  if not modes or any(m not in MODES for m in modes):
    parser.error(f'--instrument must list some of {list(MODES)}, got {args.instrument!r}')
  if args.top < 0:
    parser.error(f'--top must be >= 0, got {args.top}')
  if args.hlo and not os.path.isdir(args.hlo):
    parser.error(f'--hlo={args.hlo} is not a directory')
  paired.check_output_args(parser, args)
  if not has_cuda_plugin():
    parser.exit(2, f"{parser.prog}: needs jax's CUDA plugin (no GPU): pip install '.[cuda]'\n")
  return parser, args, config, modes


def print_summary(mode: str, summary: dict, target: dict, compile_s: float, memory: dict) -> None:
  bandwidth = target['memory_bandwidth'] / 1e12
  print(f'{mode}: compiled for {target["name"]} in {compile_s:.0f} s; traffic at {bandwidth:.2f} TB/s')
  if memory:
    print(
      f'  device memory {memory["total_gib"]:.2f} GiB (arguments {memory["arguments_gib"]:.2f}, '
      f'temporaries {memory["temporaries_gib"]:.2f})'
    )
  for kind, row in summary['by_kind'].items():
    note = '  (compute-bound: no time)' if kind in ('matmul', 'attention') else ''
    traffic = f'{row["gb"]:8.2f} GB {row["ms_at_bandwidth"]:7.2f} ms'
    print(f'  {kind:10s} {row["kernels"]:5d} kernels {traffic}{note}')
  total = summary['memory_bound']
  phases = ', '.join(f'{p} {r["gb"]:.2f} GB' for p, r in summary['memory_bound_by_phase'].items())
  print(f'  memory-bound {total["gb"]:.2f} GB, {total["ms_at_bandwidth"]:.2f} ms: {phases}')
  parts = ', '.join(
    f'{part} {summary["by_part"][part]["kernels"]} kernels, '
    f'{bound["gb"]:.2f} GB, {bound["ms_at_bandwidth"]:.2f} ms'
    for part, bound in summary['memory_bound_by_part'].items()
  )
  print(f'  by part (all kernels; GB and ms of the memory-bound ones): {parts}')
  for row in summary['top_memory_bound']:
    print(
      f'    {row["gb"]:7.3f} GB {row["ms_at_bandwidth"]:6.3f} ms x{row["kernels"]:<3d} {row["kind"]:6s} '
      f'{row["phase"]:8s} {row["part"]:10s} {row["group"]}  {row["op_name"][:70]}'
    )


def main():
  parser, args, config, modes = parse_args()
  target = hlo_traffic.DEVICES[args.target]
  on_device = one_device_of(target)
  with models.compiling_for('gpu'):
    try:
      prepared = bench.prepare(config, modes, 'random', shapes_only=True)
    except ValueError as e:
      parser.error(str(e))
    results = {
      'config': args.config,
      'overrides': args.set,
      'target': {**target, 'compute_capability': list(target['compute_capability'])},
      'jax': jax.__version__,
      'commit': bench.source_commit(),
      'date': time.strftime('%Y-%m-%d'),
      'modes': {},
    }
    for mode in modes:
      step_fn = prepared.make_step(
        mode != 'off', sample_rows=config.instrument.sample_rows if mode == 'sampled' else 0
      )
      start = time.perf_counter()
      compiled = compile_for(on_device, step_fn, prepared.state, prepared.batch)
      compile_s = time.perf_counter() - start
      hlo_text = compiled.as_text()
      if args.hlo:
        pathlib.Path(args.hlo, f'{mode}.hlo.txt').write_text(hlo_text)
      summary = hlo_traffic.summarize(hlo_traffic.kernels(hlo_text), target['memory_bandwidth'], args.top)
      memory = bench.memory_of(compiled)
      results['modes'][mode] = {'compile_s': compile_s, 'memory': memory, **summary}
      print_summary(mode, summary, target, compile_s, memory)
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
