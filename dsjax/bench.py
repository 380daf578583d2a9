r"""Train-step time with per-layer moment instrumentation on every step vs off.

  python -m dsjax.bench [--config=configs/gpt_preln.py] [--steps=20] [--config.model.depth=...]

Both steps are the loop's jitted train step (`dsjax.train.step.make_train_step`) on one device; the
instrumented one (`instrument=True`) also measures the per-layer moments, and its timing includes
fetching them and writing moments.jsonl + TensorBoard. Both deliveries of `instrument.delivery` are
timed: 'return' (the statistics table returned from the step, the default) and 'callback' (a
`jax.debug.callback` per probe site from inside the layer scan, waited for with `jax.effects_barrier`).
The three steps are timed in turn on the same real batch, after compilation; the medians are reported.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import jax
from absl import flags
from ml_collections import config_flags

from dsjax import data as data_lib
from dsjax import instrument as instrument_lib
from dsjax import schemes
from dsjax.train import cli
from dsjax.train import config as config_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/gpt_preln.py', 'Config file (configs/*.py).',
                                          lock_config=True)
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps of each kind (after 2 warm-up steps).', lower_bound=1)


def check_args(config, num_steps: int):
  """One-line ValueErrors before anything is compiled: the run's config checks (`dsjax.train.config`;
  the steps run on one device without a mesh, so `mesh.shape` is not checked), then the dataset's.
  Returns the DatasetInfo."""
  if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
    raise ValueError(f'--steps must be a positive integer, got {num_steps!r}')
  data_info = config_lib.validate_single_device_run(config, training=True)
  return data_info


def time_train_steps(config, num_steps: int, workdir: str) -> dict[str, float]:
  """Median seconds per train step, instrumentation off and on every step."""
  data_info = check_args(config, num_steps)
  batch = next(data_lib.make_pipeline(config.data, global_batch_size=config.batch_size,
                                      seed=config.seed, process_index=0, process_count=1))
  batch = jax.device_put(batch)
  prepared = schemes.preparation_for_run(config, data_info, lambda: step_lib.first_model_inputs(config))
  setup = state_lib.make_setup(config, data_info, prepared)
  graphdef, tx, schedule = setup.graphdef, setup.tx, setup.schedule
  state = jax.jit(setup.create_state)()
  loss_fn = step_lib.LOSSES[config.model.name]
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0
  # One collector per delivery, so that neither de-duplicates the other's records.
  collectors = {name: instrument_lib.Collector(os.path.join(workdir, name), keep_records=False)
                for name in ('every_step', 'every_step_callback')}
  make = lambda instrument, receiver=None: jax.jit(step_lib.make_train_step(  # noqa: E731
      graphdef, tx, loss_fn, config.seed, schedule, use_dropout, instrument,
      moments_receiver=receiver), donate_argnums=0)
  steps = {'off': make(False), 'every_step': make(True),
           'every_step_callback': make(True, collectors['every_step_callback'].receive)}

  times: dict[str, list[float]] = {name: [] for name in steps}
  for i in range(num_steps + 2):
    for name, step_fn in steps.items():
      start = time.perf_counter()
      state, metrics = step_fn(state, batch)
      if name != 'off':  # As in the loop, plus fetching and writing the moments at once.
        collectors[name].add(i, metrics.pop('moments'))
        if name == 'every_step_callback':
          jax.effects_barrier()
        collectors[name].flush()
      jax.block_until_ready(metrics)
      if i >= 2:  # The first two calls compile and warm up.
        times[name].append(time.perf_counter() - start)
  for collector in collectors.values():
    collector.close()
  return {name: statistics.median(t) for name, t in times.items()}


def main(argv):
  del argv
  config = _CONFIG.value
  with tempfile.TemporaryDirectory() as workdir:
    t = time_train_steps(config, _STEPS.value, workdir)
  m = config.model
  print(f'{m.name} {m.block} depth {m.depth} width {m.width}, batch {config.batch_size} x '
        f'{config.data.seq_len}, median of {_STEPS.value} steps:')
  print(f'  instrumentation off:        {t["off"] * 1e3:8.1f} ms/step')
  print(f'  instrumentation every step: {t["every_step"] * 1e3:8.1f} ms/step '
        f'(overhead {100 * (t["every_step"] / t["off"] - 1):.1f}%), delivery=return')
  print(f'  instrumentation every step: {t["every_step_callback"] * 1e3:8.1f} ms/step '
        f'(overhead {100 * (t["every_step_callback"] / t["off"] - 1):.1f}%), delivery=callback')


if __name__ == '__main__':
  cli.run(main)
