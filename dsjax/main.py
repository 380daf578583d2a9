"""Entry point: `python -m dsjax.main --config=configs/vit_dnt.py --workdir=DIR [--config.key=value ...]`.

Runs `dsjax.train.loop.train_and_evaluate`. Rerunning the same command resumes from the latest
checkpoint in DIR; `--fresh` trains from step 0 in a DIR whose history no intact checkpoint continues
(docs/running.md).

Several processes (hosts, or several processes on one machine) run the same command, each with its own
`--process_id`, and form one run through `jax.distributed` (docs/scaling.md):

    python -m dsjax.main --config=... --workdir=DIR --coordinator_address=HOST:PORT \\
        --num_processes=2 --process_id=0     # and --process_id=1 in the second process

The three flags default to the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID. `--jax_distributed` lets JAX detect whatever is not given from the cluster (Cloud TPU
pods, SLURM, Open MPI). With none of them the run is a single process and `jax.distributed` is not
initialised. Process 0 writes the workdir's files (config, metrics, TensorBoard, moments) and logs
progress; the others log warnings and errors only. Checkpoints are written by all processes together
(Orbax), each its own shards.
"""

from __future__ import annotations

import jax
from absl import flags, logging
from ml_collections import config_flags

from dsjax.train import cli, loop
from dsjax.train import sharding as sharding_lib

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'Path to a config file (configs/*.py).', lock_config=True
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and the config.')
_COORDINATOR = flags.DEFINE_string(
  'coordinator_address',
  None,
  'HOST:PORT of the coordinator that process 0 starts, the same for every process (multi-process '
  'runs). Default: $JAX_COORDINATOR_ADDRESS.',
)
_NUM_PROCESSES = flags.DEFINE_integer(
  'num_processes', None, 'Number of processes of a multi-process run. Default: $JAX_NUM_PROCESSES.'
)
_PROCESS_ID = flags.DEFINE_integer(
  'process_id', None, 'This process, 0 … num_processes − 1 (0 writes the files). Default: $JAX_PROCESS_ID.'
)
_DISTRIBUTED = flags.DEFINE_bool(
  'jax_distributed',
  False,
  'Initialise jax.distributed and let JAX detect what the three flags above leave unset from the '
  'cluster (Cloud TPU pods, SLURM, Open MPI).',
)
_FRESH = flags.DEFINE_bool(
  'fresh',
  False,
  'Train from step 0 in a --workdir that holds the history of an earlier run but no intact checkpoint '
  '(all unreadable, or none written): that history is moved to WORKDIR/earlier_runs/<time>/ first. '
  'An error where an intact checkpoint exists (rerun without it to resume).',
)
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  settings = sharding_lib.distributed_settings(
    _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _DISTRIBUTED.value
  )
  if settings is not None:
    sharding_lib.initialize_distributed(settings, detect=_DISTRIBUTED.value)
  if jax.process_index() > 0 and logging.get_verbosity() <= logging.INFO:
    logging.set_verbosity(logging.WARNING)  # Process 0 reports progress; the others what goes wrong.
  config = _CONFIG.value
  cli.check_output_dir('--workdir', _WORKDIR.value)
  loop.train_and_evaluate(config, _WORKDIR.value, fresh=_FRESH.value)


if __name__ == '__main__':
  cli.run(main)
