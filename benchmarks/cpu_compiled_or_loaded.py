r"""One train step compiled in this process against the same executable serialized and loaded, in turns.

  python benchmarks/cpu_compiled_or_loaded.py [--config=configs/gpt_preln.py] [--set=KEY=VALUE ...]
                                              [--rounds=40] [--pause=0.05] [--json=FILE]

On the 2-core CPU a process whose train step came from jax's compilation cache ran it faster than a
process that compiled it (benchmarks/README.md, CPU section). This script asks whether the executable
is the difference: in one process it compiles the plain train step of a config (as `python -m
dsjax.bench` builds it; jax's compilation cache is switched off), serializes the executable and loads
it again (`jax.experimental.serialize_executable`), and times the two, one step each per round, in
alternating order with `--pause` seconds of idle before each. Reported: each one's median and min–max
time, and per round the loaded step's ratio to the compiled one (median and quartiles).
"""

from __future__ import annotations

import pathlib
import sys

from dsjax.train import host_memory

host_memory.keep_freed_memory()  # as every dsjax command does; before JAX starts its threads

import jax  # noqa: E402
from jax.experimental import serialize_executable  # noqa: E402

from dsjax import bench  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import paired  # noqa: E402 (benchmarks/paired.py, beside this script)

WARMUP_ROUNDS = 3


def timed_steps(config) -> dict:
  """'compiled' and 'loaded': each runs one step from a state of its own and waits for it."""
  jax.config.update('jax_enable_compilation_cache', False)  # 'compiled' is compiled here
  prepared = bench.prepare(config, ['off'], 'random')
  state = prepared.state
  compiled = jax.jit(prepared.make_step(), donate_argnums=0).lower(state, prepared.batch).compile()
  loaded = serialize_executable.deserialize_and_load(*serialize_executable.serialize(compiled))
  states = {'compiled': state, 'loaded': jax.jit(prepared.setup.create_state)()}

  def runner(name, executable):
    def step():
      states[name], metrics = executable(states[name], prepared.batch)
      jax.block_until_ready(metrics)

    return step

  return {'compiled': runner('compiled', compiled), 'loaded': runner('loaded', loaded)}


def main():
  args, config = paired.parse_config_timing_args(__doc__)
  seconds = paired.alternate(timed_steps(config), args.rounds, WARMUP_ROUNDS, args.pause)
  results = paired.report(
    args, seconds, 'compiled', jax.devices()[0].device_kind, bench.source_commit(), jax.__version__
  )
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
