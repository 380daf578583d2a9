"""The full run config that `configs/*.py` start from, assembled from each section's own definition.

Each section is described once, next to its validation:

  run keys (seed, steps, batch sizes, intervals)  here
  model (architecture)                            dsjax/models/config.py
  model.scheme and model.<scheme>                 dsjax/schemes/<scheme>.py (registered in dsjax.schemes)
  optimizer                                       dsjax/train/optimizers.py
  data                                            dsjax/data/config.py
  mesh                                            dsjax/train/sharding.py
  instrument                                      dsjax/instrument/probe.py
  instrument.monitor                              dsjax/instrument/monitor.py

Config files override what they need and document the command, runtime and result; a run locks the
config (`lock_config=True`) so that a mistyped override (`--config.model.detph=4`) fails at once.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import ml_collections

from dsjax import data as data_lib
from dsjax import instrument, models, schemes
from dsjax.data import config as data_config
from dsjax.models.config import positive_int
from dsjax.train import optimizers
from dsjax.train import sharding as sharding_lib
from dsjax.train import step as step_lib

RUN_INTS = (
  'total_steps',
  'batch_size',
  'eval_batch_size',
  'eval_every',
  'checkpoint_every',
  'log_every',
  'keep_checkpoints',
  'microbatches',
)


def base_config(model_name: str, optimizer_name: str = 'adamw') -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 1000
  c.batch_size = 128  # global, over all processes and devices
  # Gradient accumulation: the train step splits each batch into this many microbatches, sums their
  # gradients and applies one update with the batch's mean gradient (the same update, with one
  # microbatch's activations in memory; dsjax/train/step.py). Must divide the per-device batch.
  c.microbatches = 1
  c.eval_every = 200  # steps; the final step is always evaluated
  c.eval_batch_size = 256
  c.checkpoint_every = 500  # steps; the final step is always saved
  c.keep_checkpoints = 2
  c.log_every = 50  # steps; progress is also logged at least every ~10 s
  # A step whose loss or gradient norm is NaN/Inf never updates the state. 'stop': the run stops with
  # one line naming the step (exit status 3); 'skip': the update is skipped, counted in
  # train/nonfinite_steps, and the run goes on.
  c.on_nonfinite = 'stop'

  c.model = models.model_config(model_name)
  schemes.add_config_sections(c.model)
  c.optimizer = optimizers.default_optimizer_config(optimizer_name, family=model_name)
  # Embedded offline defaults: 8×8 handwritten digits (ViT), Python's documentation as bytes (GPT).
  c.data = data_config.get_config('sklearn_digits' if model_name == 'vit' else 'python_docs_bytes')
  c.mesh = sharding_lib.mesh_config()
  c.instrument = instrument.instrument_config()
  c.instrument.monitor = instrument.monitor_config()
  return c


@dataclasses.dataclass(frozen=True)
class ValidatedConfig:
  """A run's config once every section has been checked (`validate_config`), with the sections that
  have a typed form in it: what the run passes down instead of checking a section again."""

  config: ml_collections.ConfigDict  # the whole config (the run keys, the model section)
  optimizer: optimizers.OptimizerConfig
  data: data_config.DataConfig
  mesh_shape: tuple[int, ...]  # (data, fsdp, tensor), -1 resolved


def validate_config(
  config, num_devices: int, process_count: int = 1, training: bool = True
) -> ValidatedConfig:
  """Every check that needs no data: one-line ValueErrors naming the key, the allowed values and the value.
  `training=False` (a tool that only measures the model) skips the learning-rate schedule's."""
  for key in RUN_INTS:
    positive_int(key, config[key])
  if not isinstance(config.seed, int) or isinstance(config.seed, bool) or config.seed < 0:
    raise ValueError(f'seed must be a non-negative integer, got {config.seed!r}')
  if config.on_nonfinite not in step_lib.NONFINITE_POLICIES:
    raise ValueError(
      f'on_nonfinite must be one of {step_lib.NONFINITE_POLICIES}, got {config.on_nonfinite!r}'
    )
  models.validate_model(config.model)
  schemes.validate(config.model)
  optimizer = optimizers.parse_optimizer_config(config.optimizer)
  if training:
    optimizers.make_schedule(optimizer, config.total_steps)  # Checks warmup against total_steps.
  data = data_config.parse_config(config.data)
  instrument.validate_instrument_config(config.instrument)
  instrument.validate_monitor_config(config.instrument.monitor)

  shape = sharding_lib.resolve_mesh_shape(config.mesh.shape, num_devices)
  tensor_shards = shape[sharding_lib.MESH_AXES.index('tensor')]
  if config.model.num_heads % tensor_shards:
    # Tensor parallelism gives each device whole heads: a head split over devices would shard the head
    # dimension, which cuDNN's attention refuses and the XLA path pays for in communication.
    raise ValueError(
      f'model.num_heads ({config.model.num_heads}) must be divisible by the tensor axis '
      f'of mesh.shape ({tensor_shards})'
    )
  batch_shards = math.prod(shape[:2])
  for key in ('batch_size', 'eval_batch_size'):
    if config[key] % batch_shards or config[key] % process_count:
      raise ValueError(
        f'{key} ({config[key]}) must be divisible by the data×fsdp mesh size '
        f'({batch_shards}) and the process count ({process_count})'
      )
  if (config.batch_size // batch_shards) % config.microbatches:
    raise ValueError(
      f'microbatches ({config.microbatches}) must divide the per-device batch: batch_size '
      f'({config.batch_size}) / data×fsdp mesh size ({batch_shards}) = '
      f'{config.batch_size // batch_shards}'
    )
  return ValidatedConfig(config=config, optimizer=optimizer, data=data, mesh_shape=shape)


def validate_against_data(config, data_info):
  """Checks that need the dataset's shapes (known before compilation, after the dataset is found)."""
  models.validate_against_data(config.model, config.data.name, data_info)


def validate_single_device_run(config, training: bool, require_data: bool = True):
  """The checks of a tool that runs the config's model on one device without a mesh (`dsjax.moments`,
  `dsjax.bench`, `dsjax.sensitivity`): every run check but `mesh.shape` (and the schedule's unless it
  is `training`), then the dataset's. Returns the dataset's DatasetInfo; `require_data=False` (inputs
  of the dataset's shape only) accepts a registered TFDS dataset that is not prepared."""
  one_device = copy.deepcopy(config)
  one_device.mesh.shape = sharding_lib.mesh_config().shape
  data = validate_config(one_device, num_devices=1, training=training).data
  data_info = data_lib.dataset_info(data, require_prepared=require_data)
  validate_against_data(config, data_info)
  return data_info
