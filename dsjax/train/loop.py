"""The training loop, top to bottom: setup → data → model and optimizer → restore → compile → train.

`train_and_evaluate(config, workdir)` is what `python -m dsjax.main` runs. Rerunning it with the same
workdir resumes from the latest checkpoint, bit-for-bit (input position and dropout keys included).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging

from dsjax import data as data_lib
from dsjax import instrument as instrument_lib
from dsjax import schemes
from dsjax.models.transformer import no_probe
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import cli, interrupts
from dsjax.train import config as config_lib
from dsjax.train import history as history_lib
from dsjax.train import metrics as metrics_lib
from dsjax.train import sharding as sharding_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib


def activation_constrained(loss_fn: Callable, mesh) -> Callable:
  """`loss_fn(model, batch, key, probe)` with the batch axis pinned to data × fsdp
  (`sharding.activation_sharding`) at the model's inputs, at every probe site (the residual stream of
  every layer, inside the layer scan) and at its outputs (the logits), where the sharding propagation
  would otherwise be free to choose another layout for them; the embedding tables and heads are
  gathered over fsdp where they are used (`sharding.gather_tables_over_fsdp`)."""
  constrain = lambda x: sharding_lib.constrain_batch_axis(x, mesh)

  class Constrained:
    def __init__(self, model):
      self.model = sharding_lib.gather_tables_over_fsdp(model, mesh)

    def __call__(self, inputs, **kwargs):  # The inputs come from the constrained batch.
      return constrain(self.model(inputs, **kwargs))

    def __getattr__(self, name):
      return getattr(self.model, name)

  def constrained_loss(model, batch, dropout_key, probe=no_probe):
    constrained_probe = lambda site, x, layer: probe(site, constrain(x), layer)
    return loss_fn(Constrained(model), jax.tree.map(constrain, batch), dropout_key, constrained_probe)
  return constrained_loss


def make_train_step(config, setup: state_lib.TrainSetup, mesh, state_shardings, **step_kwargs):
  """The run's jitted train step: `step.make_train_step` on the activation-constrained loss, with the
  state on its shardings (donated), the batch split over data × fsdp and the metrics replicated.
  `step_kwargs` go to `step.make_train_step` (instrument, moments_receiver, moments_per_site)."""
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0
  loss_fn = activation_constrained(step_lib.LOSSES[config.model.name], mesh)
  step_fn = step_lib.make_train_step(setup.graphdef, setup.tx, loss_fn, config.seed, setup.schedule,
                                     use_dropout, on_nonfinite=config.on_nonfinite,
                                     microbatches=config.microbatches, **step_kwargs)
  return jax.jit(step_fn, in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh)),
                 out_shardings=(state_shardings, sharding_lib.replicated(mesh)), donate_argnums=0)


def make_eval_step(config, setup: state_lib.TrainSetup, mesh, state_shardings):
  """The run's jitted eval step (summed statistics, replicated)."""
  loss_fn = activation_constrained(step_lib.LOSSES[config.model.name], mesh)
  return jax.jit(step_lib.make_eval_step(setup.graphdef, loss_fn),
                 in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh)),
                 out_shardings=sharding_lib.replicated(mesh))


def evaluate(eval_step, state, config, mesh, process) -> dict[str, float]:
  """One pass over the dataset's evaluation split (padded rows masked out, so averages are exact). The
  step runs on `mesh` with its logical axis rules whoever calls (a resumed run that is already done
  evaluates outside the training loop)."""
  pipeline = data_lib.make_pipeline(config.data, global_batch_size=config.eval_batch_size,
                                    seed=config.seed, train=False, **process)
  totals: dict[str, float] = {}
  with sharding_lib.use_mesh(mesh):
    for batch in pipeline:
      sums = jax.device_get(eval_step(state, sharding_lib.global_batch(batch, mesh)))
      for k, v in sums.items():
        totals[k] = totals.get(k, 0.0) + float(v)
  return step_lib.summarize_eval(config.model.name, totals)


def _memory_summary(compiled) -> str:
  """The compiled step's device memory per device, from XLA (empty where the backend does not say)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return ''
  gib = lambda n: n / 2**30
  total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
           + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  return (f'{gib(total):.2f} GiB per device (arguments {gib(analysis.argument_size_in_bytes):.2f}, '
          f'temporaries {gib(analysis.temp_size_in_bytes):.2f})')


def _compile(name: str, step_fn, state, batch):
  """Ahead-of-time compilation with a progress line before and after (compiling a deep model can take
  minutes, which should not look like a hang); returns the compiled step and its memory summary."""
  logging.info('Compiling the %s…', name)
  t0 = time.perf_counter()
  compiled = step_fn.lower(state, batch).compile()
  memory = _memory_summary(compiled)
  logging.info('Compiled the %s in %.1fs%s', name, time.perf_counter() - t0, f'; it needs {memory}' if memory else '')
  return compiled, memory


def _out_of_memory(error: Exception, memory: str) -> ValueError:
  return ValueError(f'out of device memory running the train step (compiled estimate: {memory or "unknown"}); '
                    f'{cli.OUT_OF_MEMORY_ADVICE}')


def _nonfinite_message(step: int, metrics: dict[str, float], where: tuple | None, last_saved) -> str:
  quantity = 'loss' if not np.isfinite(metrics['train/loss']) else 'gradient norm'
  value = metrics['train/loss'] if quantity == 'loss' else metrics['train/grad_norm']
  place = ('the embedding' if where and where[0] == 'embedding' else
           f'layer {where[0]}, site {where[1]}' if where else '')
  site = f' (first non-finite statistic: {place}, {where[2]})' if where else ''
  saved = f'the last checkpoint is step {last_saved}' if last_saved else 'no checkpoint was written'
  return (f'step {step}: the {quantity} is {value}{site}; stopped without saving this state '
          f'(on_nonfinite=\'stop\'; \'skip\' skips such steps), {saved}')


def _lock_workdir(workdir: str, is_chief: bool, mesh) -> checkpoint_lib.WorkdirLock | None:
  """Process 0 takes the workdir's lock; with several processes all of them learn whether it could,
  so that every process stops with the one-line error, before any of them reaches a collective."""
  lock, error = None, None
  if is_chief:
    try:
      lock = checkpoint_lib.WorkdirLock(workdir)
    except ValueError as e:
      error = e
  if not _all_processes(error is None, mesh):
    raise error or ValueError(f'--workdir {workdir}: process 0 could not lock it (its error says why)')
  return lock


def _all_processes(ok: bool, mesh) -> bool:
  """True on every process when `ok` is True on all of them (a vote; with one process, `ok`)."""
  if jax.process_count() == 1:
    return ok
  return not sharding_lib.read_vote(sharding_lib.max_over_processes(int(not ok), mesh))


def train_and_evaluate(config, workdir: str, devices=None, fresh: bool = False) -> dict[str, float]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns the final eval metrics.

  `devices` defaults to all devices; tests pass a subset to compare meshes in one process. SIGTERM or
  SIGINT at any point (setup and compilation included) ends the run after its next step, saved (with
  several processes, after the step that follows: the processes' vote on it is read a step late). A
  check that fails leaves the workdir as it was found. `fresh`: train from step 0 over the history of an
  earlier run that no intact checkpoint continues (`dsjax.train.history`; `--fresh`).
  """
  # What a failing check must not leave behind: the paths the run creates before all checks have
  # passed (the lock is taken first, Orbax creates the checkpoint directory), where they are new. Only
  # a run that holds the lock removes them (while it still holds it), never another run's.
  created = [p for p in (os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR),
                         os.path.join(workdir, checkpoint_lib.LOCK_FILE), workdir) if not os.path.exists(p)]
  held = []  # the workdir's lock, once this run holds it
  with interrupts.StopSignals() as signals:
    try:
      return _train_and_evaluate(config, workdir, devices, signals, held, fresh)
    except BaseException:
      if held and not checkpoint_lib.WorkdirLock.owner_recorded(workdir):
        _remove_if_unused(created)
        held[0].release()
      raise


def _remove_if_unused(paths: list[str]) -> None:
  """Removes each path that is a file or an empty directory (in order: contents before their parent)."""
  for path in paths:
    if os.path.isfile(path):
      os.remove(path)
    elif os.path.isdir(path) and not os.listdir(path):
      os.rmdir(path)


def _train_and_evaluate(config, workdir: str, devices, signals: interrupts.StopSignals,
                        held: list, fresh: bool) -> dict[str, float]:
  # ----------------------------------------------------------------------------------------------
  # Setup: every check runs before anything is compiled or written — the config, the data, the
  # workdir's lock, the architecture of a checkpoint it holds, the model's shardings. (The lock file and
  # Orbax's checkpoint directory come first; `train_and_evaluate` removes them again if a check fails.)
  # ----------------------------------------------------------------------------------------------
  devices = jax.devices() if devices is None else list(devices)
  config_lib.validate_config(config, num_devices=len(devices), process_count=jax.process_count())
  mesh = sharding_lib.make_mesh(config.mesh.shape, devices)
  process = dict(process_index=jax.process_index(), process_count=jax.process_count())
  data_info = data_lib.dataset_info(config.data)  # Fails with a clear message if the data is missing.
  config_lib.validate_against_data(config, data_info)
  is_chief = jax.process_index() == 0
  lock = _lock_workdir(workdir, is_chief, mesh)
  held.extend([lock] if lock is not None else [])
  history_lib.check_layout(workdir, enabled=is_chief, all_ok=lambda ok: _all_processes(ok, mesh))
  checkpointer = checkpoint_lib.Checkpointer(workdir, keep=config.keep_checkpoints)
  checkpointer.check_compatible(config)
  identity = checkpoint_lib.run_identity(config)
  logging.info('Mesh %s over %d devices (%s)', dict(mesh.shape), len(devices), devices[0].platform)

  # ----------------------------------------------------------------------------------------------
  # Data: this process's share of each global batch, with a saveable position.
  # ----------------------------------------------------------------------------------------------
  train_data = data_lib.make_pipeline(config.data, global_batch_size=config.batch_size,
                                      seed=config.seed, train=True, **process)

  # ----------------------------------------------------------------------------------------------
  # Model, optimizer and the sharded train state (created directly on its shardings, or restored from
  # the newest intact checkpoint).
  # ----------------------------------------------------------------------------------------------
  # A method with a data-dependent step (DSLM's measured input correlation, ADMIN's profiling pass)
  # runs it on the first training batches, or reads its result back from the workdir when resuming.
  prepared = schemes.preparation_for_run(config, data_info, lambda: step_lib.first_model_inputs(config),
                                         workdir)
  if prepared is not None:
    logging.info('Preparation of model.scheme=%s: %s', config.model.scheme, prepared)
  setup = state_lib.make_setup(config, data_info, prepared)
  abstract_state = jax.eval_shape(setup.create_state)
  model_axes = sharding_lib.logical_axes(setup.abstract_model)
  state_shardings = sharding_lib.state_shardings(abstract_state, model_axes, mesh)
  for undivided in sharding_lib.undivided_dimensions(abstract_state, model_axes, mesh):
    logging.warning('Not sharded (size does not divide the mesh axis): %s', undivided)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_state['params']))
  logging.info('Model %s: %.2fM parameters, %d layers', config.model.name, num_params / 1e6, config.model.depth)

  restored = checkpointer.restore(checkpoint_lib.abstract_with_shardings(abstract_state, state_shardings),
                                  set_aside=is_chief, fresh=fresh, all_ok=lambda ok: _all_processes(ok, mesh))
  if restored is not None:
    state, data_state = restored
    train_data.set_state(data_state)
    logging.info('Resumed from step %d', int(state['step']))
  else:
    state = jax.jit(setup.create_state, out_shardings=state_shardings)()
  first_step = int(state['step'])
  start = history_lib.Start.check(workdir, first_step, checkpointer, fresh=fresh, enabled=is_chief,
                                  all_ok=lambda ok: _all_processes(ok, mesh))
  # Every check has passed: now the workdir may change.
  start.apply(checkpointer, enabled=is_chief, barrier=lambda ok: _all_processes(ok, mesh))
  if is_chief:
    lock.record_owner()
    if prepared is not None:
      schemes.save_preparation(config, workdir, prepared)
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2))

  # ----------------------------------------------------------------------------------------------
  # Compile: one jitted train step with explicit shardings and a donated state, compiled ahead of time
  # on the first batch (with its time and memory in the log).
  # ----------------------------------------------------------------------------------------------
  jit_train_step = lambda **kw: make_train_step(config, setup, mesh, state_shardings, **kw)
  next_batch = lambda: sharding_lib.global_batch(next(train_data), mesh)
  batch = next_batch() if first_step < config.total_steps else None
  with sharding_lib.use_mesh(mesh):
    if batch is not None:
      train_step, step_memory = _compile('train step', jit_train_step(), state, batch)
  # Per-layer moments (dsjax.instrument): a second step that also returns them, run at step 1 (the
  # model at initialisation) and every `instrument.every` steps; `every = 0` compiles none of it.
  instrument_every, moments = config.instrument.every, None
  if instrument_every:
    moments = instrument_lib.Collector(workdir, enabled=is_chief, keep_records=False)  # Files only.
    receiver = moments if config.instrument.delivery == 'callback' else None
    # A callback after the layer scan can deadlock a step on several devices (instrument/README.md):
    # there each probe site sends its own statistics; on one device the step sends its table once.
    instrumented_train_step = jit_train_step(instrument=True, moments_receiver=receiver,
                                             moments_per_site=mesh.size > 1)
    if batch is not None:
      with sharding_lib.use_mesh(mesh):
        instrumented_train_step, _ = _compile('instrumented train step', instrumented_train_step, state, batch)
  eval_step = make_eval_step(config, setup, mesh, state_shardings)

  def first_nonfinite_site(state, batch):
    """Replays a non-finite step with the instrumentation (with on_nonfinite='stop' the state is still
    the one before that step) and names the first layer and site whose statistics are NaN/Inf."""
    if not instrument_every:
      return None
    # The instrumented step returns the statistics unless they go to a callback; then compile one
    # that returns them. Either may consume the state: the run ends here.
    replay = (instrumented_train_step if config.instrument.delivery == 'return'
              else jit_train_step(instrument=True))
    _, replayed = jax.device_get(replay(state, batch))
    return instrument_lib.first_nonfinite(replayed['moments'])

  # ----------------------------------------------------------------------------------------------
  # Train. Metrics of step t are fetched after step t+1 is dispatched, so the host never stalls the
  # device; that is where a non-finite loss is caught, one step late (the state never takes the
  # non-finite update, see `step.guard_nonfinite`). Before a checkpoint the step's metrics are checked
  # first, so no checkpoint holds a non-finite step. Evaluation and checkpoints happen at their
  # intervals and always at the last step; SIGTERM/SIGINT save the current step and stop.
  # ----------------------------------------------------------------------------------------------
  writer = metrics_lib.MetricWriter(workdir, enabled=is_chief)
  progress = metrics_lib.Progress(first_step, config.total_steps)
  pending: dict[str, Any] | None = None  # {'step', 'train' (device arrays), 'eval' (floats), 'batch'}
  last_eval: dict[str, float] = {}
  last_saved = checkpointer.latest_step()
  # Several processes stop together: each step the processes vote the signal they received (its number,
  # 0 for none; `max_over_processes`), and the vote is read one step later — the same step and signal on
  # every process, without waiting for the device.
  several_processes, stop_vote = jax.process_count() > 1, None
  t_start = time.time()

  def finish(record):
    """Fetches step `record['step']`'s metrics: stops on a non-finite step (or counts it), logs."""
    step = record['step']
    metrics = {k: float(v) for k, v in jax.device_get(record['train']).items()}
    if metrics['train/nonfinite']:
      if config.on_nonfinite == 'stop':
        where = first_nonfinite_site(state, record['batch'])
        raise cli.Exit(_nonfinite_message(step, metrics, where, last_saved), status=3)
      logging.warning('step %d: non-finite loss or gradient; update skipped (%d so far)', step,
                      int(metrics['train/nonfinite_steps']))
    if not (progress.due(step, config.log_every) or record['eval']):
      return
    steps_per_sec, eta_s = progress.mark(step)
    metrics['train/steps_per_sec'] = steps_per_sec
    writer.write(step, {**metrics, **record['eval']})
    eta_s = int(eta_s)
    logging.info('step %d/%d | loss %.4f | grad_norm %.3g | lr %.3g | %.2f steps/s | ETA %dm%02ds%s',
                 step, config.total_steps, metrics['train/loss'], metrics['train/grad_norm'],
                 metrics['train/lr'], steps_per_sec, eta_s // 60, eta_s % 60,
                 ''.join(f' | {k} {v:.4f}' for k, v in record['eval'].items()))

  with sharding_lib.use_mesh(mesh):
    for step in range(first_step + 1, config.total_steps + 1):
      batch = batch if step == first_step + 1 else next_batch()
      try:
        if instrument_lib.is_instrumented_step(step, instrument_every):
          state, train_metrics = instrumented_train_step(state, batch)
          moments.add(step, train_metrics.pop('moments'))
        else:
          state, train_metrics = train_step(state, batch)
      except jax.errors.JaxRuntimeError as e:
        raise (_out_of_memory(e, step_memory) if cli.out_of_memory(e) else e) from None
      if moments is not None:
        moments.flush(before_step=step)  # Earlier steps' moments -> moments.jsonl and TensorBoard.
      if pending is not None:
        finish(pending)
      pending = {'step': step, 'train': train_metrics, 'eval': {}, 'batch': batch}
      if step % config.eval_every == 0 or step == config.total_steps:
        # The step runs asynchronously: wait for it, so that its time is not counted as evaluation's.
        jax.block_until_ready(train_metrics)
        t0 = time.perf_counter()
        pending['eval'] = last_eval = evaluate(eval_step, state, config, mesh, process)
        progress.exclude(time.perf_counter() - t0)
      if several_processes:
        stop_signal = 0 if stop_vote is None else sharding_lib.read_vote(stop_vote)
        stop_vote = sharding_lib.max_over_processes(int(signals.received or 0), mesh)
      else:
        stop_signal = int(signals.received or 0)
      stop = stop_signal > 0
      save_now = stop or step == config.total_steps
      if save_now or step % config.checkpoint_every == 0:
        finish(pending)  # Checked before its state is saved.
        pending = None
        t0 = time.perf_counter()
        checkpointer.save(step, state, train_data.get_state(), identity)
        last_saved = step
        progress.exclude(time.perf_counter() - t0)
      if stop:
        checkpointer.close()
        cause = signal.Signals(stop_signal).name + (
            '' if int(signals.received or 0) == stop_signal else ' to another process')
        raise cli.Exit(f'stopped by {cause} after step {step}; saved checkpoint {step}, rerun the same '
                       'command to resume', status=128 + stop_signal)
    if pending is not None:
      finish(pending)

  if not last_eval:  # Resumed at the end: report the final numbers again.
    last_eval = evaluate(eval_step, state, config, mesh, process)
  checkpointer.close()
  writer.close()
  if moments is not None:
    moments.close()
  if lock is not None:
    lock.release()
  logging.info('Done in %.1fs: %s', time.time() - t_start, last_eval)
  return last_eval
