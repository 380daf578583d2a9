"""Entry point: `python -m dsjax.main --config=configs/vit_dnt.py --workdir=DIR [--config.key=value ...]`.

Runs `dsjax.train.loop.train_and_evaluate`. Rerunning the same command resumes from the latest
checkpoint in DIR. On a multi-host TPU pod / GPU cluster, run the same command on every host with
`--jax_distributed` (initialises `jax.distributed` from the environment).
"""

from __future__ import annotations

import jax
from absl import flags, logging
from ml_collections import config_flags

from dsjax.train import cli, loop

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a config file (configs/*.py).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and the config.')
_DISTRIBUTED = flags.DEFINE_bool('jax_distributed', False,
                                 'Call jax.distributed.initialize() (multi-host runs).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  logging.set_verbosity(max(logging.get_verbosity(), logging.INFO))  # -v 1 keeps tracebacks.
  # Orbax logs every file it renames at INFO; keep the terminal to dsjax's own progress lines.
  logging.get_absl_handler().addFilter(lambda record: '/orbax/' not in record.pathname)
  config = _CONFIG.value
  cli.check_output_dir('--workdir', _WORKDIR.value)
  loop.train_and_evaluate(config, _WORKDIR.value)


if __name__ == '__main__':
  cli.run(main)
