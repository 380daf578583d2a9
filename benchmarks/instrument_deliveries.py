r"""The instrumented train step's cost per delivery of the statistics, timed in turns in one process.

  python benchmarks/instrument_deliveries.py [--config=configs/gpt_preln.py] [--set=KEY=VALUE ...]
                                             [--rounds=40] [--pause=0.05] [--json=FILE]

Four compiled train steps of one config on one device, built as `python -m dsjax.bench` builds them:
'off' (no statistics), 'return' (the statistics table returned from the step), 'callback_table' (the
table sent in one `jax.debug.callback` per step: `instrument.delivery='callback'` on one device) and
'callback_per_site' (a callback per probe site from the backward pass of the layer scan, as on several
devices); with `--set=instrument.sample_rows=N` (N > 0) also 'return_sampled' (the returned statistics
from N rows per probe site, `docs/instrumentation.md`; the others use whole tensors). Each timed call
runs one step, waits for it and for its callbacks (`jax.effects_barrier`), and turns its statistics into
records (`Collector.flush`, in memory). The steps take turns, one each per round, in alternating order,
with `--pause` seconds of idle before each; the ratio of each instrumented step to the plain one of the
same round cancels the machine's drift (benchmarks/README.md, "Instrumentation overhead"). Reported: each
step's median and min–max time, and per round the ratio to 'off' (median and quartiles). Each call's
records are also timed on their own (`records_ms`): the train loop makes them while the device runs the
next step, so the call without them (`ratio_to_off_without_records`) is what an instrumented step costs
the device, and the records what it costs the host. (With a callback delivery the statistics reach the
host during the step; the callback keeps a copy and `Collector.flush` makes the records, so `records_ms`
times them for every delivery alike.) Of the records' time, fetching the step's returned statistics to the
host (`jax.device_get` of `instrument.PackedMoments`, one array) is also reported on its own
(`fetch_ms`). `--set=model.depth=192` (repeatable) overrides a config key, as `--config.model.depth=192`
does for the dsjax commands.
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
DELIVERIES = {
  'off': (False, False, False),
  'return': (True, False, False),
  'callback_table': (True, True, False),
  'callback_per_site': (True, True, True),
}


def timed_steps(config) -> tuple[dict, dict[str, list[float]], dict[str, list[float]]]:
  """One function per delivery that runs one step of it and waits for everything it delivers; the
  seconds each instrumented call spends making its records, and of them fetching its statistics,
  appended call by call."""
  prepared = bench.prepare(config, ['off', 'return', 'callback'], 'random')
  calls, records_s, fetch_s = {}, {}, {}
  deliveries = dict(DELIVERIES)
  if config.instrument.sample_rows:
    deliveries['return_sampled'] = (True, False, False)
  for name, (instrument, by_callback, per_site) in deliveries.items():
    collector = instrument_lib.Collector(keep_records=False)
    sample_rows = config.instrument.sample_rows if name == 'return_sampled' else 0
    step_fn = prepared.make_step(instrument, collector if by_callback else None, per_site, sample_rows)
    if instrument:
      records_s[name], fetch_s[name] = [], []
    calls[name] = bench.step_runner(
      prepared,
      step_fn,
      jax.jit(prepared.setup.create_state)(),
      _deliver_to(collector, records_s[name], fetch_s[name]) if instrument else _wait_for_callbacks,
    )
  return calls, records_s, fetch_s


def _wait_for_callbacks(step, metrics):
  del step, metrics
  jax.effects_barrier()  # the callbacks of this step have run


def _deliver_to(collector, records_s: list[float], fetch_s: list[float]):
  """After a step: its statistics turned into records, the callbacks' and the returned ones; the time
  that takes appended to `records_s`, and of it the returned statistics' fetch to the host (what
  `Collector.flush` does first) to `fetch_s`."""

  def deliver(step, metrics):
    _wait_for_callbacks(step, metrics)
    start = time.perf_counter()
    moments = jax.device_get(metrics['moments'])
    fetched = time.perf_counter()
    collector.add(step, moments)  # new keys each step, as the callbacks' records are
    collector.flush()
    records_s.append(time.perf_counter() - start)
    fetch_s.append(fetched - start)

  return deliver


def _after_warmup_ms(seconds: dict[str, list[float]]) -> dict[str, list[float]]:
  """Each call's seconds in milliseconds, the warm-up rounds left out."""
  return {name: [1e3 * t for t in ts[WARMUP_ROUNDS:]] for name, ts in seconds.items()}


def main():
  args, config = paired.parse_config_timing_args(__doc__)
  calls, records_s, fetch_s = timed_steps(config)
  seconds = paired.alternate(calls, args.rounds, WARMUP_ROUNDS, args.pause)
  device = jax.devices()[0].device_kind
  commit, head = bench.recorded_commit(), bench.source_commit()
  results = paired.report(args, seconds, 'off', device, commit, jax.__version__, head)
  results.update(paired.without_part(results['step_ms'], _after_warmup_ms(records_s), 'off', 'records'))
  results['fetch_ms'] = _after_warmup_ms(fetch_s)
  results['fetch_ms_median'] = {name: statistics.median(ts) for name, ts in results['fetch_ms'].items()}
  print('  without making the records (what the loop overlaps with the next step):')
  for name, ratio in results['ratio_to_off_without_records_median'].items():
    records, fetch = results['records_ms_median'][name], results['fetch_ms_median'][name]
    print(f'    {name:18s} {ratio:.3f} x off; the records {records:.1f} ms, the fetch of them {fetch:.1f} ms')
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
