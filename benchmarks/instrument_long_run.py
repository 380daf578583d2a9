r"""The host's share of the instrumentation over a long run: the collector's time per instrumented step
early and late in `--steps` steps, the pauses of Python's full garbage collections, and how much the
process's resident memory grew over those steps.

  python benchmarks/instrument_long_run.py [--config=configs/gpt_preln.py] [--set=KEY=VALUE ...]
                                           [--steps=2000] [--sink=records|jsonl|jsonl_tensorboard|loop]
                                           [--gc_freeze=on|off] [--json=FILE]

As `benchmarks/instrument_host_cost.py` does, one instrumented step of the config runs first for real
statistics of its shape (`--set=model.width=32` keeps it quick at 192 layers; the records depend on the
depth only). Then the collector is handed those statistics as step 1, 2, ..., `--steps` (`add` and
`flush`, what the train loop calls after each instrumented step), one step at a time, each timed. What
grows with the number of steps a collector has seen shows as a later quarter slower than the first, as
longer pauses, or as memory (resident memory read from /proc, so on Linux). The default sink keeps no
file (`--sink=records`): what it measures is the collector's own bookkeeping, not the disk. As the train
loop does, what is built is frozen before the steps (`--gc_freeze=on`), so that the full garbage
collections do not walk it; `--gc_freeze=off` shows what they cost without that.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import pathlib
import sys
import tempfile
import time

if __name__ == '__main__':
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the host's work: no device needed

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dsjax import bench  # noqa: E402
from dsjax.train import host_memory  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import instrument_host_cost  # noqa: E402 (beside this script)
import paired  # noqa: E402


class FullCollections:
  """The pauses of Python's full (generation 2) garbage collections while it is installed, in ms."""

  def __init__(self):
    self.pauses_ms: list[float] = []
    self._start = 0.0

  def __call__(self, phase: str, info: dict):
    if info['generation'] != 2:
      return
    if phase == 'start':
      self._start = time.perf_counter()
    else:
      self.pauses_ms.append(1e3 * (time.perf_counter() - self._start))


def resident_mib() -> float:
  """The process's resident memory now (Linux's /proc/self/statm), in MiB."""
  with open('/proc/self/statm') as f:
    pages = int(f.read().split()[1])
  return pages * os.sysconf('SC_PAGE_SIZE') / 2**20


def summary(step_ms: np.ndarray) -> dict[str, float]:
  """Median, 99th percentile and max of step times."""
  return {
    'median': float(np.median(step_ms)),
    'p99': float(np.percentile(step_ms, 99)),
    'max': float(step_ms.max()),
  }


def quarter_summary(step_ms: np.ndarray) -> dict[str, dict[str, float]]:
  """`summary` of the first and of the last quarter of the steps."""
  n = max(len(step_ms) // 4, 1)
  return {'first': summary(step_ms[:n]), 'last': summary(step_ms[-n:])}


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--steps', type=int, default=2000, help='Instrumented steps handed to the collector.')
  parser.add_argument(
    '--sink',
    default='records',
    choices=('records', 'jsonl', 'jsonl_tensorboard', 'loop'),
    help="The collector's sink, as instrument_host_cost.py names them (records: no file).",
  )
  parser.add_argument(
    '--gc_freeze',
    default='on',
    choices=('on', 'off'),
    help='on: what is built frozen before the steps (host_memory.built_objects_frozen), as the train loop '
    'does; off: not frozen.',
  )
  parser.add_argument('--json', default=None, help='Also write the results to this file.')
  paired.add_config_args(parser)
  args = parser.parse_args()
  if args.steps < 4:
    parser.error(f'--steps must be >= 4 (its first and last quarters are compared), got {args.steps}')
  paired.check_output_args(parser, args)
  return args, paired.config_from_args(parser, args)


def main():
  args, config = parse_args()
  moments = instrument_host_cost.one_steps_moments(config)
  pauses = FullCollections()
  with tempfile.TemporaryDirectory() as workdir:
    collectors = instrument_host_cost.sinks(workdir, config)
    collector = collectors.pop(args.sink)
    for other in collectors.values():
      other.close()
    frozen = host_memory.built_objects_frozen() if args.gc_freeze == 'on' else contextlib.nullcontext()
    gc.collect()
    step_ms = []
    with frozen:  # (its own collection on entry is not one of the steps')
      rss_before = resident_mib()
      gc.callbacks.append(pauses)
      for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        collector.add(step, moments)
        collector.flush()
        step_ms.append(1e3 * (time.perf_counter() - t0))
      gc.callbacks.remove(pauses)
    rss_growth = resident_mib() - rss_before
    collector.close()
  results = {
    'date': time.strftime('%Y-%m-%d'),
    'jax': jax.__version__,
    'config': args.config,
    'overrides': args.set,
    'device': 'host',
    **bench.commit_fields(),
    'sink': args.sink,
    'gc_freeze': args.gc_freeze,
    'steps': args.steps,
    'step_ms_by_quarter': quarter_summary(np.array(step_ms)),
    'step_ms_all': summary(np.array(step_ms)),
    'full_collections': len(pauses.pauses_ms),
    'full_collection_ms_max': max(pauses.pauses_ms, default=0.0),
    'full_collection_ms_total': sum(pauses.pauses_ms),
    'resident_mib_growth': rss_growth,
  }
  print(f'{args.config} {" ".join(args.set)}: {args.steps} instrumented steps, sink {args.sink}')
  for name, q in results['step_ms_by_quarter'].items():
    print(f'  {name} quarter: {q["median"]:.2f} ms/step median, p99 {q["p99"]:.1f}, max {q["max"]:.1f}')
  q = results['step_ms_all']
  print(f'  all steps: {q["median"]:.2f} ms/step median, p99 {q["p99"]:.1f}, max {q["max"]:.1f}')
  print(
    f'  full garbage collections: {results["full_collections"]}, '
    f'{results["full_collection_ms_total"]:.0f} ms in all, longest {results["full_collection_ms_max"]:.1f} ms'
  )
  print(f'  resident memory grew by {rss_growth:.0f} MiB over the steps')
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
