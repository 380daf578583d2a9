"""The train state of a run: the model its method builds (after the method's data-dependent preparation,
`method_preparation`), the optimizer, and their initial values.

The state is a plain dict of arrays

    {'params': trainable nnx.Param values, 'rest': non-trainable model values (fixed λ/β, sincos
     position table, output scale), 'opt_state': optax state, 'step': int32 scalar,
     'nonfinite_steps': int32 scalar}

and the model is rebuilt from its static `graphdef` inside the jitted steps (`dsjax.train.step`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsjax import data as data_lib
from dsjax import schemes
from dsjax.models import model_inputs
from dsjax.train import optimizers


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  graphdef: nnx.GraphDef
  create_state: Callable[[], dict[str, Any]]  # the initial train state (jit it with out_shardings)
  abstract_model: nnx.Module  # shapes, dtypes and metadata (logical axes, lr scales)
  tx: optax.GradientTransformation
  schedule: optax.Schedule


def param_lr_scales(abstract_model: nnx.Module) -> dict | None:
  """Learning-rate multipliers of the parameters (their `lr_scale` metadata, set by the method's plan,
  e.g. μP) as a pure dict shaped like the params, or None when every multiplier is 1."""
  params = nnx.state(abstract_model, nnx.Param)
  scales = jax.tree.map(
    lambda v: float(v.get_metadata().get('lr_scale', 1.0)),
    params,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )
  scales = nnx.to_pure_dict(scales) if isinstance(scales, nnx.State) else scales
  if all(s == 1.0 for s in jax.tree.leaves(scales)):
    return None
  return scales


def whole_train_batches(config, data_config=None, seed: int | None = None) -> data_lib.Pipeline:
  """The run's training batches from the first one on, each whole (the global batch, as one process
  reads it, the same rows on every host): what the tools that measure a model at the run's data read.
  `data_config`: the run's validated data section (default `config.data`); `seed`: the data order's
  seed (default `config.seed`)."""
  return data_lib.make_pipeline(
    config.data if data_config is None else data_config,
    global_batch_size=config.batch_size,
    seed=config.seed if seed is None else seed,
    process_index=0,
    process_count=1,
    train=True,
  )


def first_model_inputs(config, data_config=None):
  """Model inputs of the run's training batches from the first one on, the same rows on every host (for
  a method's preparation step); a generator, so it reads only what is consumed. `data_config`: the
  run's validated data section (default `config.data`, validated here)."""
  for batch in whole_train_batches(config, data_config):
    yield model_inputs(config.model.name, batch)


def method_preparation(config, data_info, workdir: str | None = None, data_config=None):
  """The result of the method's data-dependent step for a run (`schemes.preparation_for_run`: DSLM's
  measured input correlation, ADMIN's profiling pass), computed on the model inputs of the run's first
  training batches (`first_model_inputs`, read only when it is computed) or read back from `workdir`;
  None for a method without one. `data_config`: as for `first_model_inputs`."""
  return schemes.preparation_for_run(
    config, data_info, lambda: first_model_inputs(config, data_config), workdir
  )


def make_setup(
  config, data_info, prepared: dict | None = None, optimizer: optimizers.OptimizerConfig | None = None
) -> TrainSetup:
  """Model (by `config.model.scheme`, with its preparation result `prepared`), optimizer and the
  function creating the initial state. `optimizer`: the run's validated optimizer section (default:
  `config.optimizer`, validated here)."""
  build = lambda: schemes.build_model(config, data_info, nnx.Rngs(params=config.seed), prepared)
  abstract_model = nnx.eval_shape(build)
  optimizer = config.optimizer if optimizer is None else optimizer
  tx, schedule = optimizers.make_optimizer(
    optimizer, config.total_steps, lr_scale=param_lr_scales(abstract_model)
  )

  def create():
    _, params, rest = nnx.split(build(), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    return {
      'params': params,
      'rest': rest,
      'opt_state': tx.init(params),
      'step': jnp.zeros((), jnp.int32),
      'nonfinite_steps': jnp.zeros((), jnp.int32),
    }

  return TrainSetup(
    graphdef=nnx.graphdef(abstract_model),
    create_state=create,
    abstract_model=abstract_model,
    tx=tx,
    schedule=schedule,
  )
