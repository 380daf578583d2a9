r"""Bytes the instrumented train step reads and writes, by XLA's cost analysis, with and without sampling.

  python benchmarks/instrument_sampling_cost.py [--config=configs/gpt2_small.py] [--set=KEY=VALUE ...]
                                                [--rows=256,1024] [--json=FILE]

Compiles, without running or allocating anything (the state and batch are shapes only), the train step
of `dsjax.bench` plain, instrumented on whole tensors and instrumented with each `instrument.sample_rows`
of `--rows`, and prints the 'bytes accessed' and FLOPs of XLA's cost analysis of each compiled step, and
the instrumented steps' bytes beyond the plain step's. The statistics are memory-bound reductions, so
their bytes are a proxy for their cost where a step cannot be timed (on a CPU, which cannot time a
GPU-sized model; the analysis is of the HLO compiled for the device it runs on, so a CPU's numbers
describe the CPU's fusions, not a GPU's).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax

from dsjax import bench

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import paired  # noqa: E402 (benchmarks/paired.py, beside this script)


def compiled_cost(step_fn, state, batch) -> dict[str, float]:
  analysis = jax.jit(step_fn, donate_argnums=0).lower(state, batch).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  return {'bytes_accessed': float(analysis['bytes accessed']), 'flops': float(analysis['flops'])}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  paired.add_config_args(parser)
  parser.set_defaults(config='configs/gpt2_small.py')
  parser.add_argument('--rows', default='256,1024', help='Sample sizes (instrument.sample_rows > 0).')
  parser.add_argument('--json', default=None, help='Also write the results to this JSON file.')
  args = parser.parse_args()
  config = paired.config_from_args(parser, args)
  try:
    rows = [int(v) for v in args.rows.split(',') if v]
  except ValueError:
    parser.error(f'--rows must be comma-separated integers, got {args.rows!r}')
  if not rows or min(rows) < 1:
    parser.error(f'--rows must list sample sizes >= 1, got {args.rows!r}')
  paired.check_output_args(parser, args)

  prepared = bench.prepare(config, ['off'], 'random', shapes_only=True)
  make = prepared.make_step
  steps = {'off': make(), 'return': make(True), **{f'sampled_{n}': make(True, sample_rows=n) for n in rows}}
  results = {
    'config': args.config,
    'overrides': args.set,
    'device': jax.devices()[0].device_kind,
    'commit': bench.source_commit(),
    'date': time.strftime('%Y-%m-%d'),
    'steps': {},
  }
  for name, step_fn in steps.items():
    cost = compiled_cost(step_fn, prepared.state, prepared.batch)
    results['steps'][name] = cost
    extra = cost['bytes_accessed'] - results['steps']['off']['bytes_accessed']
    print(
      f'{name:16s} {cost["bytes_accessed"] / 1e9:9.2f} GB accessed  {cost["flops"] / 1e9:10.1f} GFLOP  '
      f'{extra / 1e9:+8.2f} GB beyond the plain step',
      flush=True,
    )
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
