r"""The host's share of the instrumentation: what turning one step's returned statistics into records and
writing them costs the process, per step, with no device work in the timing.

  python benchmarks/instrument_host_cost.py [--config=configs/gpt_preln.py] [--set=KEY=VALUE ...]
                                            [--rounds=20] [--pause=0.05] [--json=FILE]

One instrumented step of the config runs first, for real statistics of its shape (the records depend on
the depth, not the width: `--set=model.width=32` keeps that step quick at 192 layers). Then, per round
and in turns, the collector's work for one step (`Collector.add` and `flush`, what `dsjax.bench` and the
train loop call after each step) is timed in three sinks: records only (no workdir; what
`benchmarks/instrument_deliveries.py` times), the JSONL file, and the JSONL file with TensorBoard (scalars
per record, the step's histograms and images; `dsjax.bench`'s sink), and the train loop's sink, which is
that one with the stability monitor checking each step (`loop`). In the loop this work runs while the
device computes the next step: where it takes longer than a step, the step waits.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import sys
import tempfile

if __name__ == '__main__':
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the host's work: no device needed

import jax  # noqa: E402

from dsjax import bench  # noqa: E402
from dsjax import instrument as instrument_lib  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import paired  # noqa: E402 (benchmarks/paired.py, beside this script)

WARMUP_ROUNDS = 2


def one_steps_moments(config):
  """The statistics one instrumented step of `config` returns, fetched to the host."""
  prepared = bench.prepare(config, ['return'], 'random')
  step = jax.jit(prepared.make_step(True))
  _, metrics = step(prepared.state, prepared.batch)
  return jax.device_get(metrics['moments'])


def sinks(workdir: str, config) -> dict:
  """The collectors timed, by name; 'loop' is the train loop's own (with the stability monitor, as
  `instrument.monitor` sets it, without the comparison with the theory, which happens at step 1 only)."""
  monitor = instrument_lib.Monitor(
    config.instrument.monitor, config.model.depth, config.model.dropout, workdir=os.path.join(workdir, 'loop')
  )
  return {
    'records': instrument_lib.Collector(keep_records=False),
    'jsonl': instrument_lib.Collector(os.path.join(workdir, 'jsonl'), tensorboard=False, keep_records=False),
    'jsonl_tensorboard': instrument_lib.Collector(os.path.join(workdir, 'tb'), keep_records=False),
    'loop': instrument_lib.Collector(os.path.join(workdir, 'loop'), keep_records=False, monitor=monitor),
  }


def collector_step(collector, moments):
  """A function that hands `collector` one more step of `moments` (new keys each step, as a run's steps
  have) and flushes it."""
  steps = itertools.count(1)

  def call():
    collector.add(next(steps), moments)
    collector.flush()

  return call


def main():
  args, config = paired.parse_config_timing_args(__doc__)
  moments = one_steps_moments(config)
  with tempfile.TemporaryDirectory() as workdir:
    collectors = sinks(workdir, config)
    calls = {name: collector_step(collector, moments) for name, collector in collectors.items()}
    seconds = paired.alternate(calls, args.rounds, WARMUP_ROUNDS, args.pause)
    for collector in collectors.values():
      collector.close()
  results = paired.report(
    args, seconds, 'records', 'host', bench.recorded_commit(), jax.__version__, bench.source_commit()
  )
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
