r"""The error of the sampled instrumentation statistics (`instrument.sample_rows`) against whole tensors.

  python benchmarks/instrument_sampling_error.py [--config=configs/gpt_preln.py] [--set=KEY=VALUE ...]
                                                 [--rows=256,1024] [--at=0,50,200] [--batches=4]
                                                 [--json=FILE]

Trains the config's model on its real data with the plain train step and, at each step of `--at`
(0: the model at initialisation), runs the instrumented step on `--batches` real batches once on whole
tensors and once per sample size of `--rows`, all from the same state (the instrumented steps' updates
are thrown away). For every statistic it reports the error of the sampled value against the whole
tensor's, pooled over batches, checkpoints, layers and sites (weight types for the weight statistics):
median, 90th percentile and maximum. Errors are relative (|sampled / whole − 1|) for variances, max |x|
and the weight-gradient distribution statistics; absolute for the correlations; the mean's is in units
of the whole tensor's standard deviation. Sites whose whole-tensor variance is 0 are left out.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import numpy as np

from dsjax import bench
from dsjax import data as data_lib
from dsjax.instrument import collector as collector_lib
from dsjax.instrument import stats as stats_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import paired  # noqa: E402 (benchmarks/paired.py, beside this script)

ABSOLUTE = ('corr_seq', 'corr_hidden', 'grad_corr_seq')  # errors in correlation units
QUANTILES = {'median': 50, 'p90': 90, 'max': 100}


def _int_list(text: str) -> list[int]:
  return [int(v) for v in text.split(',') if v]


def parse_args() -> tuple[argparse.Namespace, object]:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  paired.add_config_args(parser)
  parser.add_argument('--rows', default='256,1024', help='Sample sizes (instrument.sample_rows > 0).')
  parser.add_argument('--at', default='0,50,200', help='Training steps at which to compare.')
  parser.add_argument('--batches', type=int, default=4, help='Real batches compared at each step.')
  parser.add_argument('--json', default=None, help='Also write the results to this JSON file.')
  args = parser.parse_args()
  config = paired.config_from_args(parser, args)
  try:
    args.rows, args.at = _int_list(args.rows), sorted(set(_int_list(args.at)))
  except ValueError:
    parser.error('--rows and --at must be comma-separated integers')
  if not args.rows or min(args.rows) < 1:
    parser.error(f'--rows must list sample sizes >= 1, got {args.rows}')
  if not args.at or args.at[0] < 0:
    parser.error(f'--at must list training steps >= 0, got {args.at}')
  if args.batches < 1:
    parser.error(f'--batches must be >= 1, got {args.batches}')
  paired.check_output_args(parser, args)
  return args, config


def _records(moments) -> dict:
  return {key[1:]: float(value) for key, value in collector_lib.moments_to_records(0, moments)}


def errors_of(whole: dict, sampled: dict) -> dict[str, list[tuple[float, str]]]:
  """Per statistic, the error of each sampled record against the whole tensor's (module docstring),
  with where it is ('layer L site')."""
  out: dict[str, list[tuple[float, str]]] = {}
  for (layer, site, stat), value in whole.items():
    if stat == 'grad_norm':
      error = abs(sampled[(layer, site, stat)] / value - 1) if value else 0.0
    elif site.startswith('weight/') or stat in ('var', 'grad_var', 'max_abs'):
      if value == 0:
        continue
      error = abs(sampled[(layer, site, stat)] / value - 1)
    elif stat == 'mean':
      var = whole[(layer, site, 'var')]
      if var == 0:
        continue
      error = abs(sampled[(layer, site, stat)] - value) / np.sqrt(var)
    else:
      if whole.get((layer, site, 'var'), 1.0) == 0:
        continue
      error = abs(sampled[(layer, site, stat)] - value)
    key = f'weight_{stat}' if site.startswith('weight/') else stat
    out.setdefault(key, []).append((error, f'layer {layer} {site}'))
  return out


def main():
  args, config = parse_args()
  prepared = bench.prepare(config, ['off', 'return'], 'real')
  batches = data_lib.make_pipeline(
    config.data, global_batch_size=config.batch_size, seed=config.seed, process_index=0, process_count=1
  )
  train_step = jax.jit(prepared.make_step(), donate_argnums=0)
  instrumented = {rows: jax.jit(prepared.make_step(True, sample_rows=rows)) for rows in [0, *args.rows]}
  state, step = jax.jit(prepared.setup.create_state)(), 0
  errors: dict[int, dict[str, list[tuple[float, str]]]] = {rows: {} for rows in args.rows}
  start = time.perf_counter()
  for at in args.at:
    while step < at:
      state, _ = train_step(state, jax.device_put(next(batches)))
      step += 1
    for _ in range(args.batches):
      batch = jax.device_put(next(batches))
      whole = _records(jax.device_get(instrumented[0](state, batch)[1]['moments']))
      for rows in args.rows:
        sampled = _records(jax.device_get(instrumented[rows](state, batch)[1]['moments']))
        for stat, values in errors_of(whole, sampled).items():
          errors[rows].setdefault(stat, []).extend((e, f'step {at}, {where}') for e, where in values)
    print(f'step {at}: compared ({time.perf_counter() - start:.0f} s)', flush=True)

  b, l = config.batch_size, config.data.seq_len
  results = {
    'config': args.config,
    'overrides': args.set,
    'batch_size': b,
    'seq_len': l,
    'depth': config.model.depth,
    'width': config.model.width,
    'at_steps': args.at,
    'batches_per_step': args.batches,
    'device': jax.devices()[0].device_kind,
    'commit': bench.source_commit(),
    'date': time.strftime('%Y-%m-%d'),
    'errors': {},
  }
  print(
    f'{args.config} {args.set or ""}: batch {b} x seq {l} = {b * l} rows per site, depth '
    f'{config.model.depth}; errors over steps {args.at}, {args.batches} batches each'
  )
  for rows in args.rows:
    per_example = stats_lib.sample_positions_per_example(b, l, rows)
    weight_rows = max(1, rows // config.model.depth)
    print(
      f'sample_rows {rows}: {per_example} positions per example ({b * per_example} rows per site), '
      f'{weight_rows} rows per layer of each weight-gradient leaf'
    )
    summary = {}
    for stat, found in errors[rows].items():
      values = [e for e, _ in found]
      summary[stat] = {name: float(np.percentile(values, q)) for name, q in QUANTILES.items()}
      summary[stat]['count'] = len(values)
      worst = max(found)
      summary[stat]['max_at'] = worst[1] if worst[0] > 0 else None
      kind = 'absolute' if stat in ABSOLUTE else 'in std' if stat == 'mean' else 'relative'
      print(
        f'  {stat:24s} {kind:9s} median {summary[stat]["median"]:.4f}  p90 {summary[stat]["p90"]:.4f}'
        f'  max {summary[stat]["max"]:.4f} ({summary[stat]["max_at"] or "all exact"}; {len(values)} values)'
      )
    results['errors'][str(rows)] = {
      'positions_per_example': per_example,
      'weight_rows_per_layer': weight_rows,
      'statistics': summary,
    }
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
