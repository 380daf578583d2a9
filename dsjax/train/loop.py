"""The training loop, top to bottom: setup → data → model and optimizer → restore → compile → train.

`train_and_evaluate(config, workdir)` is what `python -m dsjax.main` runs. Rerunning it with the same
workdir resumes from the latest checkpoint, bit-for-bit (input position and dropout keys included).
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from dsjax import data as data_lib
from dsjax import instrument as instrument_lib
from dsjax import schemes
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import config as config_lib
from dsjax.train import sharding as sharding_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib
from dsjax.train.metrics import MetricWriter


def evaluate(eval_step, state, config, mesh, process) -> dict[str, float]:
  """One pass over the dataset's evaluation split (padded rows masked out, so averages are exact)."""
  pipeline = data_lib.make_pipeline(config.data, global_batch_size=config.eval_batch_size,
                                    seed=config.seed, train=False, **process)
  totals: dict[str, float] = {}
  for batch in pipeline:
    sums = jax.device_get(eval_step(state, sharding_lib.global_batch(batch, mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  return step_lib.summarize_eval(config.model.name, totals)


def train_and_evaluate(config, workdir: str, devices=None) -> dict[str, float]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns the final eval metrics.

  `devices` defaults to all devices; tests pass a subset to compare meshes in one process.
  """
  # ----------------------------------------------------------------------------------------------
  # Setup: every check runs before anything is compiled or written.
  # ----------------------------------------------------------------------------------------------
  devices = jax.devices() if devices is None else list(devices)
  config_lib.validate_config(config, num_devices=len(devices), process_count=jax.process_count())
  mesh = sharding_lib.make_mesh(config.mesh.shape, devices)
  process = dict(process_index=jax.process_index(), process_count=jax.process_count())
  data_info = data_lib.dataset_info(config.data)  # Fails with a clear message if the data is missing.
  config_lib.validate_against_data(config, data_info)
  is_chief = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if is_chief:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2))
  logging.info('Mesh %s over %d devices (%s)', dict(mesh.shape), len(devices), devices[0].platform)

  # ----------------------------------------------------------------------------------------------
  # Data: this process's share of each global batch, with a saveable position.
  # ----------------------------------------------------------------------------------------------
  train_data = data_lib.make_pipeline(config.data, global_batch_size=config.batch_size,
                                      seed=config.seed, train=True, **process)

  # ----------------------------------------------------------------------------------------------
  # Model, optimizer and the sharded train state (created directly on its shardings).
  # ----------------------------------------------------------------------------------------------
  # A method with a data-dependent step (DSLM's measured input correlation, ADMIN's profiling pass)
  # runs it on the first training batches, or reads its result back from the workdir when resuming.
  prepared = schemes.preparation_for_run(
      config, data_info, lambda: step_lib.first_model_inputs(config), workdir, write=is_chief)
  if prepared is not None:
    logging.info('Preparation of model.scheme=%s: %s', config.model.scheme, prepared)
  setup = state_lib.make_setup(config, data_info, prepared)
  graphdef, create_state, tx, schedule = setup.graphdef, setup.create_state, setup.tx, setup.schedule
  abstract_state = jax.eval_shape(create_state)
  state_shardings = sharding_lib.state_shardings(
      abstract_state, sharding_lib.logical_axes(setup.abstract_model), mesh)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_state['params']))
  logging.info('Model %s: %.2fM parameters, %d layers', config.model.name, num_params / 1e6, config.model.depth)

  checkpointer = checkpoint_lib.Checkpointer(workdir, save_every=config.checkpoint_every,
                                             keep=config.keep_checkpoints)
  if checkpointer.latest_step() is not None:
    state, data_state = checkpointer.restore(
        checkpoint_lib.abstract_with_shardings(abstract_state, state_shardings))
    train_data.set_state(data_state)
    logging.info('Resumed from step %d', int(state['step']))
  else:
    state = jax.jit(create_state, out_shardings=state_shardings)()

  # ----------------------------------------------------------------------------------------------
  # Compile: one jitted train step with explicit shardings and a donated state.
  # ----------------------------------------------------------------------------------------------
  loss_fn = step_lib.LOSSES[config.model.name]
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0
  jit_train_step = lambda step_fn: jax.jit(
      step_fn, in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh)),
      out_shardings=(state_shardings, sharding_lib.replicated(mesh)), donate_argnums=0)
  train_step = jit_train_step(
      step_lib.make_train_step(graphdef, tx, loss_fn, config.seed, schedule, use_dropout))
  # Per-layer moments (dsjax.instrument): a second step that also returns them, run at step 1 (the
  # model at initialisation) and every `instrument.every` steps; `every = 0` compiles none of it.
  instrument_every, moments = config.instrument.every, None
  if instrument_every:
    moments = instrument_lib.Collector(workdir, enabled=is_chief, keep_records=False)  # Files only.
    receiver = moments.receive if config.instrument.delivery == 'callback' else None
    instrumented_train_step = jit_train_step(step_lib.make_train_step(
        graphdef, tx, loss_fn, config.seed, schedule, use_dropout, instrument=True,
        moments_receiver=receiver))
  eval_step = jax.jit(step_lib.make_eval_step(graphdef, loss_fn),
                      in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh)),
                      out_shardings=sharding_lib.replicated(mesh))

  # ----------------------------------------------------------------------------------------------
  # Train. Metrics of step t are fetched after step t+1 is dispatched, so logging never stalls the
  # device; evaluation and checkpoints happen at their intervals and always at the last step.
  # ----------------------------------------------------------------------------------------------
  writer = MetricWriter(workdir, enabled=is_chief)
  first_step = int(state['step'])
  pending: dict[str, Any] | None = None  # {'step', 'train' (device arrays), 'eval' (floats)}
  last_eval: dict[str, float] = {}
  t_start, t_last, step_last = time.time(), time.time(), first_step

  def log(record):
    nonlocal t_last, step_last
    step = record['step']
    if step % config.log_every and step != config.total_steps and not record['eval']:
      return
    now = time.time()
    steps_per_sec = (step - step_last) / max(now - t_last, 1e-9)
    t_last, step_last = now, step
    metrics = {k: float(v) for k, v in jax.device_get(record['train']).items()}
    metrics['train/steps_per_sec'] = steps_per_sec
    writer.write(step, {**metrics, **record['eval']})
    eta_s = int((config.total_steps - step) / max(steps_per_sec, 1e-9))
    logging.info('step %d/%d | loss %.4f | grad_norm %.3g | lr %.3g | %.2f steps/s | ETA %dm%02ds%s',
                 step, config.total_steps, metrics['train/loss'], metrics['train/grad_norm'],
                 metrics['train/lr'], steps_per_sec, eta_s // 60, eta_s % 60,
                 ''.join(f' | {k} {v:.4f}' for k, v in record['eval'].items()))

  with jax.set_mesh(mesh):
    for step in range(first_step + 1, config.total_steps + 1):
      batch = sharding_lib.global_batch(next(train_data), mesh)
      if instrument_lib.is_instrumented_step(step, instrument_every):
        state, train_metrics = instrumented_train_step(state, batch)
        moments.add(step, train_metrics.pop('moments'))
      else:
        state, train_metrics = train_step(state, batch)
      if moments is not None:
        moments.flush(before_step=step)  # Earlier steps' moments -> moments.jsonl and TensorBoard.
      if pending is not None:
        log(pending)
      pending = {'step': step, 'train': train_metrics, 'eval': {}}
      if step % config.eval_every == 0 or step == config.total_steps:
        pending['eval'] = last_eval = evaluate(eval_step, state, config, mesh, process)
      checkpointer.save(step, state, train_data.get_state(), force=step == config.total_steps)
    if pending is not None:
      log(pending)

  if not last_eval:  # Resumed at the end: report the final numbers again.
    last_eval = evaluate(eval_step, state, config, mesh, process)
  checkpointer.close()
  writer.close()
  if moments is not None:
    moments.close()
  logging.info('Done in %.1fs: %s', time.time() - t_start, last_eval)
  return last_eval
