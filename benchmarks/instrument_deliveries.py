r"""The instrumented train step's cost per delivery of the statistics, timed in turns in one process.

  python benchmarks/instrument_deliveries.py [--config=configs/gpt_preln.py] [--set=KEY=VALUE ...]
                                             [--rounds=40] [--pause=0.05] [--json=FILE]

Four compiled train steps of one config on one device, built as `python -m dsjax.bench` builds them:
'off' (no statistics), 'return' (the statistics table returned from the step), 'callback_table' (the
table sent in one `jax.debug.callback` per step: `instrument.delivery='callback'` on one device) and
'callback_per_site' (a callback per probe site from the backward pass of the layer scan, as on several
devices). Each timed call runs one step, waits for it and for its callbacks (`jax.effects_barrier`),
and turns its statistics into records (`Collector.flush`, in memory). The steps take turns, one each
per round, in alternating order, with `--pause` seconds of idle before each; the ratio of each
instrumented step to the plain one of the same round cancels the machine's drift (README.md,
"Performance"). Reported: each step's median and min–max time, and per round the ratio to 'off'
(median and quartiles). `--set=model.depth=192` (repeatable) overrides a config key, as
`--config.model.depth=192` does for the dsjax commands.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

from dsjax.train import host_memory

host_memory.keep_freed_memory()  # as every dsjax command does; before JAX starts its threads

import jax  # noqa: E402

from dsjax import bench  # noqa: E402
from dsjax import instrument as instrument_lib  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import paired  # noqa: E402 (benchmarks/paired.py, beside this script)

WARMUP_ROUNDS = 3
# name: (instrumented, delivered by callback, a callback per site)
DELIVERIES = {'off': (False, False, False), 'return': (True, False, False),
              'callback_table': (True, True, False), 'callback_per_site': (True, True, True)}


def timed_steps(config) -> dict:
  """One function per delivery that runs one step of it and waits for everything it delivers."""
  prepared = bench.prepare(config, ['off', 'return', 'callback'], 'random')
  calls = {}
  for name, (instrument, by_callback, per_site) in DELIVERIES.items():
    collector = instrument_lib.Collector(keep_records=False)
    step_fn = prepared.make_step(instrument, collector if by_callback else None, per_site)
    state = jax.jit(prepared.setup.create_state)()
    compiled = jax.jit(step_fn, donate_argnums=0).lower(state, prepared.batch).compile()
    calls[name] = _one_step(compiled, state, prepared.batch, collector if instrument else None)
  return calls


def _one_step(compiled, state, batch, collector):
  """A function that runs one step (the state carried from call to call) and waits for its statistics."""
  steps = 0

  def call():
    nonlocal state, steps
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    jax.effects_barrier()  # the callbacks of this step have run
    steps += 1
    if collector is not None:
      collector.add(steps, metrics['moments'])  # new keys each step, as the callbacks' records are
      collector.flush()
  return call


def main():
  parser = paired.timing_parser(__doc__.split('\n\n')[0], 'rounds', 'rounds')
  paired.add_config_args(parser)
  args = paired.parse_timing_args(parser, 'rounds')
  config = paired.config_from_args(parser, args)
  seconds = paired.alternate(timed_steps(config), args.rounds, WARMUP_ROUNDS, args.pause)
  times = {name: [1e3 * t for t in ts] for name, ts in seconds.items()}
  summary = paired.ratio_summary(times, 'off')
  results = {'date': time.strftime('%Y-%m-%d'), 'jax': jax.__version__, 'config': args.config,
             'overrides': args.set,
             'device': jax.devices()[0].device_kind, 'commit': bench.source_commit(),
             'rounds': args.rounds, 'pause_s': args.pause, 'step_ms': times,
             'step_ms_median': {name: statistics.median(t) for name, t in times.items()}, **summary}
  print(f"{args.config}, {args.rounds} rounds on {results['device']}; jax {jax.__version__}, {results['date']}")
  paired.print_times(times, summary, 'off')
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
