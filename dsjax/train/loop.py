"""The training loop, top to bottom: setup → the method's preparation → data → model and optimizer →
restore → the logs continued → compile → train → finish.

`train_and_evaluate(config, workdir)` is what `python -m dsjax.main` runs. Rerunning it with the same
workdir resumes from the latest checkpoint, bit-for-bit (input position and dropout keys included).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging
from flax import nnx

from dsjax import data as data_lib
from dsjax import instrument as instrument_lib
from dsjax.instrument import monitor as monitor_lib
from dsjax.instrument import theory_adapter
from dsjax.models.transformer import no_probe
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import cli, host_memory, interrupts, run_guard
from dsjax.train import config as config_lib
from dsjax.train import history as history_lib
from dsjax.train import metrics as metrics_lib
from dsjax.train import sharding as sharding_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib


def sharded_loss(loss_fn: Callable, mesh) -> Callable:
  """`loss_fn(model, batch, key, probe)` with the batch's rows on data × fsdp
  (`sharding.constrain_batch_axis`) and the model's embedding tables and heads gathered over fsdp where
  they are used (`sharding.gather_tables_over_fsdp`). The model lays out its own activations
  (`dsjax.models.partitioning`, under the rules of `sharding.use_mesh`)."""

  def loss(model, batch, dropout_key, probe=no_probe):
    model = sharding_lib.gather_tables_over_fsdp(model, mesh)
    batch = jax.tree.map(lambda x: sharding_lib.constrain_batch_axis(x, mesh), batch)
    return loss_fn(model, batch, dropout_key, probe)

  return loss


def make_train_step(config, setup: state_lib.TrainSetup, mesh, state_shardings, **step_kwargs):
  """The run's jitted train step: `step.make_train_step` on the sharded loss (`sharded_loss`), with the
  state on its shardings (donated), the batch split over data × fsdp and the metrics replicated. Trace
  and run it inside `sharding.use_mesh(mesh)`: the model lays out its activations by the mesh and the
  logical axis rules it finds there (without them it constrains nothing).
  `step_kwargs` go to `step.make_train_step` (instrument, moments_receiver, moments_per_site,
  moments_sample_rows)."""
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0
  loss_fn = sharded_loss(step_lib.LOSSES[config.model.name], mesh)
  step_fn = step_lib.make_train_step(
    setup.graphdef,
    setup.tx,
    loss_fn,
    config.seed,
    setup.schedule,
    use_dropout,
    on_nonfinite=config.on_nonfinite,
    microbatches=config.microbatches,
    **step_kwargs,
  )
  return jax.jit(
    step_fn,
    in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh)),
    out_shardings=(state_shardings, sharding_lib.replicated(mesh)),
    donate_argnums=0,
  )


def make_eval_step(config, setup: state_lib.TrainSetup, mesh, state_shardings):
  """The run's jitted eval step (summed statistics, replicated)."""
  loss_fn = sharded_loss(step_lib.LOSSES[config.model.name], mesh)
  return jax.jit(
    step_lib.make_eval_step(setup.graphdef, loss_fn),
    in_shardings=(state_shardings, sharding_lib.batch_sharding(mesh)),
    out_shardings=sharding_lib.replicated(mesh),
  )


def evaluate(eval_step, state, eval_data, mesh, model_name: str) -> dict[str, float]:
  """One pass over the evaluation pipeline `eval_data` (padded rows masked out, so averages are exact;
  each pass starts from its first batch), on `mesh`: called inside `sharding.use_mesh(mesh)`, as the
  whole run is. Text adds `eval/bits_per_byte`: the loss summed over the pass (nats) over the UTF-8 bytes
  of the tokens it predicts (`TextPipeline.target_num_bytes`) and ln 2, which compares across
  tokenizers."""
  totals: dict[str, float] = {}
  for batch in eval_data:
    sums = jax.device_get(eval_step(state, sharding_lib.global_batch(batch, mesh)))
    for k, v in sums.items():
      totals[k] = totals.get(k, 0.0) + float(v)
  metrics = step_lib.summarize_eval(model_name, totals)
  num_bytes = getattr(eval_data, 'target_num_bytes', None)
  if num_bytes:
    metrics['eval/bits_per_byte'] = totals['loss_sum'] / (num_bytes * math.log(2))
  return metrics


def _memory_summary(compiled) -> str:
  """The compiled step's device memory per device, from XLA (empty where the backend does not say)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return ''
  gib = lambda n: n / 2**30
  total = (
    analysis.argument_size_in_bytes
    + analysis.output_size_in_bytes
    + analysis.temp_size_in_bytes
    - analysis.alias_size_in_bytes
  )
  return (
    f'{gib(total):.2f} GiB per device (arguments {gib(analysis.argument_size_in_bytes):.2f}, '
    f'temporaries {gib(analysis.temp_size_in_bytes):.2f})'
  )


def _compile(name: str, step_fn, state, batch):
  """Ahead-of-time compilation with a progress line before and after (compiling a deep model can take
  minutes, which should not look like a hang); returns the compiled step and its memory summary."""
  logging.info('Compiling the %s…', name)
  t0 = time.perf_counter()
  compiled = step_fn.lower(state, batch).compile()
  memory = _memory_summary(compiled)
  logging.info(
    'Compiled the %s in %.1fs%s', name, time.perf_counter() - t0, f'; it needs {memory}' if memory else ''
  )
  return compiled, memory


def _out_of_memory(error: Exception, memory: str) -> ValueError:
  return ValueError(
    f'out of device memory running the train step (compiled estimate: '
    f'{memory or "unknown"}); {cli.OUT_OF_MEMORY_ADVICE}'
  )


def _nonfinite_message(step: int, metrics: dict[str, float], where: tuple | None, last_saved) -> str:
  quantity = 'loss' if not np.isfinite(metrics['train/loss']) else 'gradient norm'
  value = metrics['train/loss'] if quantity == 'loss' else metrics['train/grad_norm']
  place = (
    'the embedding'
    if where and where[0] == 'embedding'
    else f'layer {where[0]}, site {where[1]}'
    if where
    else ''
  )
  site = f' (first non-finite statistic: {place}, {where[2]})' if where else ''
  saved = f'the last checkpoint is step {last_saved}' if last_saved else 'no checkpoint was written'
  return (
    f'step {step}: the {quantity} is {value}{site}; stopped without saving this state '
    f"(on_nonfinite='stop'; 'skip' skips such steps), {saved}"
  )


def train_and_evaluate(config, workdir: str, devices=None, fresh: bool = False) -> dict[str, float]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns the final eval metrics.

  `devices` defaults to all devices; tests pass a subset to compare meshes in one process. SIGTERM or
  SIGINT at any point (setup and compilation included) ends the run after its next step, saved (with
  several processes, after the step that follows: the processes' vote on it is read a step late). A
  check that fails leaves the workdir as it was found (`run_guard.RunGuard`). `fresh`: train from step 0
  over the history of an earlier run that no intact checkpoint continues (`dsjax.train.history`;
  `--fresh`).
  """
  with interrupts.StopSignals() as signals, run_guard.RunGuard(workdir) as guard:
    return _train_and_evaluate(config, workdir, devices, signals, guard, fresh)


def _train_and_evaluate(
  config, workdir: str, devices, signals: interrupts.StopSignals, guard: run_guard.RunGuard, fresh: bool
) -> dict[str, float]:
  run = _setup(config, workdir, devices, guard, fresh)
  prepared = _method_preparation(run)
  train_data, eval_data = _pipelines(run)
  model = _model(run, prepared)
  state = _restore_or_create(run, model, train_data)
  first_step = int(state['step'])
  # The logs must continue from `first_step`: a damaged tail is cut back to it, a damaged row before it
  # is an error; then, every check passed, the workdir may change.
  start = history_lib.Start.check(
    workdir, first_step, run.checkpointer, fresh=fresh, enabled=run.is_chief, all_ok=run.all_processes
  )
  start.apply(run.checkpointer, enabled=run.is_chief, barrier=run.all_processes)
  guard.record_run_start(config, prepared)
  # The steps are traced, compiled and run on the mesh, with the logical axis rules the model lays out
  # its activations by. What comes before places its arrays on explicit shardings and stays outside:
  # the method's preparation runs its model on one device (every process alike, on the same rows), and
  # Orbax's restore under a current mesh leaves the reads of a corrupt checkpoint unawaited.
  with sharding_lib.use_mesh(run.mesh):
    first_batch = (
      sharding_lib.global_batch(next(train_data), run.mesh) if first_step < config.total_steps else None
    )
    moments = (
      instrument_lib.Collector(  # Files only.
        workdir,
        enabled=run.is_chief,
        keep_records=False,
        monitor=_stability_monitor(run, model, state, first_step),
      )
      if config.instrument.every
      else None
    )
    steps = _compile_steps(run, model, state, first_batch, moments)
    training = Training(run, steps, train_data, eval_data, moments, signals, first_step, model.num_params)
    with host_memory.built_objects_frozen():
      state = training.run_steps(state, first_step, first_batch)
    return training.finish(state, guard)


# ------------------------------------------------------------------------------------------------
# Setup: every check runs before anything is compiled or written — the config, the data, the
# workdir's lock, the architecture of a checkpoint it holds. (The lock file and Orbax's checkpoint
# directory come first; `run_guard.RunGuard` removes them again if a check fails.)
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
  """What the setup of a run established, for every later phase."""

  config: Any  # the whole config (run keys, model section; written to the workdir)
  validated: config_lib.ValidatedConfig  # its typed sections, each checked once
  workdir: str
  mesh: jax.sharding.Mesh
  process: dict[str, int]  # process_index and process_count, for the input pipelines
  is_chief: bool  # process 0: the one that writes files
  data_info: Any  # the dataset's description (`dsjax.data.DatasetInfo`)
  checkpointer: checkpoint_lib.Checkpointer
  identity: dict[str, Any]  # what a checkpoint records of the run (`checkpoint.run_identity`)
  fresh: bool  # start from step 0 over an earlier run's history (`--fresh`)

  def all_processes(self, ok: bool) -> bool:
    """True on every process when `ok` is on all of them (`run_guard.all_processes`)."""
    return run_guard.all_processes(ok, self.mesh)


def _setup(config, workdir: str, devices, guard: run_guard.RunGuard, fresh: bool) -> Run:
  devices = jax.devices() if devices is None else list(devices)
  validated = config_lib.validate_config(config, num_devices=len(devices), process_count=jax.process_count())
  mesh = sharding_lib.mesh_over(validated.mesh_shape, devices)
  process = dict(process_index=jax.process_index(), process_count=jax.process_count())
  data_info = data_lib.dataset_info(validated.data)  # A one-line error if the data is missing.
  config_lib.validate_against_data(config, data_info)
  is_chief = jax.process_index() == 0
  guard.take_lock(is_chief, mesh)
  history_lib.check_layout(workdir, enabled=is_chief, all_ok=lambda ok: run_guard.all_processes(ok, mesh))
  checkpointer = checkpoint_lib.Checkpointer(workdir, keep=config.keep_checkpoints)
  checkpointer.check_compatible(config, data_info=data_info)
  logging.info('Mesh %s over %d devices (%s)', dict(mesh.shape), len(devices), devices[0].platform)
  return Run(
    config=config,
    validated=validated,
    workdir=workdir,
    mesh=mesh,
    process=process,
    is_chief=is_chief,
    data_info=data_info,
    checkpointer=checkpointer,
    identity=checkpoint_lib.run_identity(config, data_info),
    fresh=fresh,
  )


def _method_preparation(run: Run):
  """The result of the method's data-dependent step (DSLM's measured input correlation, ADMIN's
  profiling pass), run on the first training batches or read back from the workdir when resuming;
  None for a method without one."""
  config = run.config
  # Read back only by a run that continues a checkpoint; a fresh start computes it again.
  resumes = run.checkpointer.latest_step() is not None and not run.fresh
  prepared = state_lib.method_preparation(
    config, run.data_info, run.workdir if resumes else None, run.validated.data
  )
  if prepared is not None:
    logging.info('Preparation of model.scheme=%s: %s', config.model.scheme, prepared)
  return prepared


# ------------------------------------------------------------------------------------------------
# Data: this process's share of each global batch, with a saveable position; the evaluation split.
# ------------------------------------------------------------------------------------------------


def _pipelines(run: Run):
  """(the training pipeline, the evaluation pipeline) of this process."""
  config, data = run.config, run.validated.data
  train_data = data_lib.make_pipeline(
    data, global_batch_size=config.batch_size, seed=config.seed, train=True, **run.process
  )
  eval_data = data_lib.make_pipeline(
    data, global_batch_size=config.eval_batch_size, seed=config.seed, train=False, **run.process
  )
  return train_data, eval_data


# ------------------------------------------------------------------------------------------------
# Model, optimizer and the sharded train state (created directly on its shardings, or restored from
# the newest intact checkpoint).
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
  """The run's model and optimizer (`state.TrainSetup`) with the shapes and shardings of its state."""

  setup: state_lib.TrainSetup
  abstract_state: Any
  state_shardings: Any
  num_params: int


def _model(run: Run, prepared) -> Model:
  config = run.config
  setup = state_lib.make_setup(config, run.data_info, prepared, optimizer=run.validated.optimizer)
  abstract_state = jax.eval_shape(setup.create_state)
  model_axes = sharding_lib.logical_axes(setup.abstract_model)
  state_shardings = sharding_lib.state_shardings(abstract_state, model_axes, run.mesh)
  for undivided in sharding_lib.undivided_dimensions(abstract_state, model_axes, run.mesh):
    logging.warning('Not sharded (size does not divide the mesh axis): %s', undivided)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_state['params']))
  logging.info(
    'Model %s: %.2fM parameters, %d layers', config.model.name, num_params / 1e6, config.model.depth
  )
  return Model(
    setup=setup, abstract_state=abstract_state, state_shardings=state_shardings, num_params=num_params
  )


def _restore_or_create(run: Run, model: Model, train_data) -> dict[str, Any]:
  """The newest intact checkpoint's state (and the input position, set on `train_data`), or the
  initial state."""
  abstract = checkpoint_lib.abstract_with_shardings(model.abstract_state, model.state_shardings)
  restored = run.checkpointer.restore(
    abstract, set_aside=run.is_chief, fresh=run.fresh, all_ok=run.all_processes
  )
  if restored is None:
    return jax.jit(model.setup.create_state, out_shardings=model.state_shardings)()
  state, data_state = restored
  train_data.set_state(data_state)
  logging.info('Resumed from step %d', int(state['step']))
  return state


def _stability_monitor(run: Run, model: Model, state, first_step: int) -> monitor_lib.Monitor:
  """The stability monitor of an instrumented run (`dsjax.instrument.monitor`; process 0 writes). Its
  comparison with the theory happens at step 1 only (the model at initialisation), so the model is
  described (`theory_adapter.describe`: the mean square of every kernel, fetched once) only when the run
  starts there, the theory covers it and one process holds every kernel."""
  config = run.config
  settings = config.instrument.monitor
  predictor = None
  one_process = run.process['process_count'] == 1  # Else a kernel may be split over processes.
  if one_process and settings.enabled and settings.theory_factor and first_step == 0:
    nnx_model = nnx.merge(model.setup.graphdef, state['params'], state['rest'])
    gap = theory_adapter.coverage_gap(config, nnx_model)
    if gap is None:
      description = theory_adapter.describe(config, nnx_model, run.data_info)
      predictor = lambda measured: theory_adapter.predict_described(description, measured)[0]
    else:
      logging.info('stability monitor: no comparison with the theory, which does not cover %s', gap)
  return monitor_lib.Monitor(
    settings,
    config.model.depth,
    config.model.dropout,
    predictor=predictor,
    workdir=run.workdir,
    enabled=run.is_chief,
  )


# ------------------------------------------------------------------------------------------------
# Compile: one jitted train step with explicit shardings and a donated state, compiled ahead of time
# on the first batch (with its time and memory in the log).
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Steps:
  """The run's jitted steps, the train steps compiled on the first batch (not compiled when the run has
  no step left)."""

  train: Callable
  instrumented: Callable | None  # also returns the per-layer moments; None without instrument.every
  eval: Callable
  memory: str  # the compiled train step's memory, for an out-of-memory error
  jit_train_step: Callable  # (**step_kwargs) -> a jitted train step, for a replay


def _compile_steps(run: Run, model: Model, state, batch, moments) -> Steps:
  """`moments`: the Collector that receives the per-layer moments with instrument.delivery='callback'."""
  config, mesh = run.config, run.mesh
  jit_train_step = lambda **kw: make_train_step(config, model.setup, mesh, model.state_shardings, **kw)
  # A run resumed at its end has no batch to compile on, and no step to run.
  compiled = lambda name, step_fn: (step_fn, '') if batch is None else _compile(name, step_fn, state, batch)
  train_step, memory = compiled('train step', jit_train_step())
  # Per-layer moments (dsjax.instrument): a second step that also returns them, run at step 1 (the
  # model at initialisation) and every `instrument.every` steps; `every = 0` compiles none of it.
  instrumented = None
  if config.instrument.every:
    receiver = moments if config.instrument.delivery == 'callback' else None
    # A callback after the layer scan can deadlock a step on several devices (instrument/README.md):
    # there each probe site sends its own statistics; on one device the step sends its table once.
    instrumented, _ = compiled(
      'instrumented train step',
      jit_train_step(
        instrument=True,
        moments_receiver=receiver,
        moments_per_site=mesh.size > 1,
        moments_sample_rows=config.instrument.sample_rows,
      ),
    )
  return Steps(
    train=train_step,
    instrumented=instrumented,
    eval=make_eval_step(config, model.setup, mesh, model.state_shardings),
    memory=memory,
    jit_train_step=jit_train_step,
  )


# ------------------------------------------------------------------------------------------------
# Train. Metrics of step t are fetched after step t+1 is dispatched, so the host never stalls the
# device; that is where a non-finite loss is caught, one step late (the state never takes the
# non-finite update, see `step.guard_nonfinite`). Before a checkpoint the step's metrics are checked
# first, so no checkpoint holds a non-finite step. Evaluation and checkpoints happen at their
# intervals and always at the last step; SIGTERM/SIGINT save the current step and stop.
# ------------------------------------------------------------------------------------------------


class Training:
  """The training steps of a run, from its first step to `total_steps`, and what they write."""

  def __init__(
    self,
    run: Run,
    steps: Steps,
    train_data,
    eval_data,
    moments,
    signals: interrupts.StopSignals,
    first_step: int,
    num_params: int,
  ):
    self.run, self.config, self.steps = run, run.config, steps
    self.num_params = num_params
    self.train_data, self.eval_data, self.moments = train_data, eval_data, moments
    self.writer = metrics_lib.MetricWriter(run.workdir, enabled=run.is_chief)
    self.progress = metrics_lib.Progress(first_step, self.config.total_steps)
    self.stop_vote = run_guard.StopVote(signals, run.mesh)
    self.last_saved = run.checkpointer.latest_step()
    self.last_eval: dict[str, float] = {}
    self.t_start = time.time()

  def run_steps(self, state, first_step: int, batch) -> Any:
    """Trains from `first_step` on (`batch`: the first one, already read); returns the final state."""
    config, pending = self.config, None  # pending: {'step', 'train' (device arrays), 'eval', 'batch'}
    for step in range(first_step + 1, config.total_steps + 1):
      if step > first_step + 1:
        batch = sharding_lib.global_batch(next(self.train_data), self.run.mesh)
      state, train_metrics = self._step(step, state, batch)
      if pending is not None:
        self._report(pending, state)
      pending = {'step': step, 'train': train_metrics, 'eval': {}, 'batch': batch}
      if step % config.eval_every == 0 or step == config.total_steps:
        # The step runs asynchronously: wait for it, so that its time is not counted as evaluation's.
        jax.block_until_ready(train_metrics)
        t0 = time.perf_counter()
        pending['eval'] = self.last_eval = self._evaluate(state)
        self.progress.exclude(time.perf_counter() - t0)
      stop_signal = self.stop_vote.after_step()
      if stop_signal or step == config.total_steps or step % config.checkpoint_every == 0:
        self._report(pending, state)  # Checked before its state is saved.
        pending = None
        self._save(step, state)
      if stop_signal:
        self._stop(step, stop_signal)
    if pending is not None:
      self._report(pending, state)
    return state

  def _step(self, step: int, state, batch):
    """One train step (the instrumented one where its moments are due)."""
    try:
      if instrument_lib.is_instrumented_step(step, self.config.instrument.every):
        state, train_metrics = self.steps.instrumented(state, batch)
        self.moments.add(step, train_metrics.pop('moments'))
      else:
        state, train_metrics = self.steps.train(state, batch)
      instrument_lib.start_host_copy(train_metrics)  # read after the next step is dispatched
    except jax.errors.JaxRuntimeError as e:
      raise (_out_of_memory(e, self.steps.memory) if cli.out_of_memory(e) else e) from None
    if self.moments is not None:
      self.moments.flush(before_step=step)  # Earlier steps' moments -> moments.jsonl and TensorBoard.
    return state, train_metrics

  def _report(self, record, state):
    """Fetches step `record['step']`'s metrics: stops on a non-finite step (or counts it), logs."""
    config, step = self.config, record['step']
    metrics = {k: float(v) for k, v in jax.device_get(record['train']).items()}
    if metrics['train/nonfinite']:
      if config.on_nonfinite == 'stop':
        where = self._first_nonfinite_site(state, record['batch'])
        raise cli.Exit(_nonfinite_message(step, metrics, where, self.last_saved), status=3)
      logging.warning(
        'step %d: non-finite loss or gradient; update skipped (%d so far)',
        step,
        int(metrics['train/nonfinite_steps']),
      )
    if not (self.progress.due(step, config.log_every) or record['eval']):
      return
    steps_per_sec, eta_s = self.progress.mark(step)
    metrics['train/steps_per_sec'] = steps_per_sec
    metrics.update(self._tokens_seen(step))
    self.writer.write(step, {**metrics, **record['eval']})
    eta_s = int(eta_s)
    logging.info(
      'step %d/%d | loss %.4f | grad_norm %.3g | lr %.3g | %.2f steps/s | ETA %dm%02ds%s',
      step,
      config.total_steps,
      metrics['train/loss'],
      metrics['train/grad_norm'],
      metrics['train/lr'],
      steps_per_sec,
      eta_s // 60,
      eta_s % 60,
      ''.join(f' | {k} {v:.4f}' for k, v in record['eval'].items()),
    )

  def _tokens_seen(self, step: int) -> dict[str, float]:
    """Text: the tokens predicted in steps 1..`step` and per parameter (what compares runs of different
    sizes and tokenizers: Hoffmann et al. 2022, arXiv:2203.15556, train about 20 per parameter)."""
    if self.run.data_info.kind != 'text':
      return {}
    tokens = step * self.config.batch_size * self.config.data.seq_len
    return {'train/tokens': float(tokens), 'train/tokens_per_param': tokens / self.num_params}

  def _first_nonfinite_site(self, state, batch):
    """Replays a non-finite step with the instrumentation (with on_nonfinite='stop' the state is still
    the one before that step) and names the first layer and site whose statistics are NaN/Inf."""
    if not self.config.instrument.every:
      return None
    # The instrumented step returns the statistics unless they go to a callback; then compile one
    # that returns them. Either may consume the state: the run ends here.
    replay = (
      self.steps.instrumented
      if self.config.instrument.delivery == 'return'
      else self.steps.jit_train_step(instrument=True, moments_sample_rows=self.config.instrument.sample_rows)
    )
    _, replayed = jax.device_get(replay(state, batch))
    return instrument_lib.first_nonfinite(replayed['moments'])

  def _evaluate(self, state) -> dict[str, float]:
    return evaluate(self.steps.eval, state, self.eval_data, self.run.mesh, self.config.model.name)

  def _save(self, step: int, state):
    t0 = time.perf_counter()
    self.run.checkpointer.save(step, state, self.train_data.get_state(), self.run.identity)
    self.last_saved = step
    self.progress.exclude(time.perf_counter() - t0)

  def _stop(self, step: int, stop_signal: int):
    self.run.checkpointer.close()
    cause = signal.Signals(stop_signal).name + (
      '' if self.stop_vote.received_here(stop_signal) else ' to another process'
    )
    raise cli.Exit(
      f'stopped by {cause} after step {step}; saved checkpoint {step}, rerun the same command to resume',
      status=128 + stop_signal,
    )

  def finish(self, state, guard: run_guard.RunGuard) -> dict[str, float]:
    """Closes the run's files and hands the workdir back; returns the final eval metrics."""
    if not self.last_eval:  # Resumed at the end: report the final numbers again.
      self.last_eval = self._evaluate(state)
    self.run.checkpointer.close()
    self.writer.close()
    if self.moments is not None:
      self.moments.close()
    guard.release()
    step = int(state['step'])
    seen = ''.join(f', {k} {v:.4g}' for k, v in self._tokens_seen(step).items())
    logging.info('Done in %.1fs: %s%s', time.time() - self.t_start, self.last_eval, seen)
    if self.moments is not None and self.moments.monitor.enabled:
      logging.info('%s', self.moments.monitor.summary())  # The run's last line: its stability flags.
    return self.last_eval
