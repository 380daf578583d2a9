r"""Train a population of runs of one config — peak learning rates × seeds — in lockstep, one vmapped step.

On a small CPU a sweep of small models is dominated by what every run pays once (start-up, compiling
the step, dispatching many small kernels). Stacking the K runs on a leading axis and `jax.vmap`-ing
the project's own train step pays it once. Member k is the run

  python -m dsjax.main --config=... --config.optimizer.lr=LR_k --config.seed=SEED_k

up to float rounding: the same model built and initialised by its method from SEED_k, the same
optimizer and schedule (`dsjax.train.step.make_train_step` itself, with the optimizer built for a peak
learning rate of 1 and its updates multiplied by LR_k — exact, because both optimizers end in
`scale_by_learning_rate` and every transformation after it is linear), the pipeline of SEED_k (data
order, on `data.train_split`), the dropout keys of SEED_k, and the evaluation on `data.eval_split`. A
member whose loss or gradient turns non-finite keeps its last finite state (`on_nonfinite='skip'`
semantics) and is reported as diverged.

`python -m dsjax.sweep` runs its arms with it (docs/sweeps.md); `tests/train/test_population.py` and
`tests/test_sweep.py` check members against the real loop.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsjax import data as data_lib
from dsjax.models.config import RESUMABLE_KEYS
from dsjax.train import config as config_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib

# progress(step, mean train loss of each member over the last window (K,), seconds since the start)
Progress = Callable[[int, np.ndarray, float], None]


@dataclasses.dataclass(frozen=True)
class Member:
  lr: float
  seed: int


def grid(lrs: Sequence[float], seeds: Sequence[int]) -> list[Member]:
  return [Member(float(lr), int(seed)) for lr in lrs for seed in seeds]


def _scaled(tx: optax.GradientTransformation, factor: jax.Array) -> optax.GradientTransformation:
  """`tx` with its updates multiplied by `factor` (the member's peak learning rate)."""

  def update(grads, opt_state, params=None):
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda u: factor * u, updates), opt_state

  return optax.GradientTransformation(tx.init, update)


def _stack(trees: Sequence[Any]) -> Any:
  # One compiled program for the whole tree: op by op, each leaf's stack would be compiled on its own.
  return jax.jit(lambda *ts: jax.tree.map(lambda *xs: jnp.stack(xs), *ts))(*trees)


def _finite_mean(losses_WK: np.ndarray) -> np.ndarray:
  """Mean over the window of each member's finite losses (NaN for a member with none)."""
  finite_WK = np.isfinite(losses_WK)
  total_K = np.where(finite_WK, losses_WK, 0.0).sum(axis=0)
  count_K = finite_WK.sum(axis=0)
  return np.where(count_K > 0, total_K / np.maximum(count_K, 1), np.nan)


def _member_config(config, seed: int):
  c = copy.deepcopy(config)
  c.seed = seed
  c.optimizer.lr = 1.0
  return c


def _print_progress(total_steps: int) -> Progress:
  def show(step, losses_K, seconds):
    losses = ' '.join(f'{x:.3f}' for x in losses_K)
    print(f'  step {step}/{total_steps} ({seconds:.0f}s): train loss {losses}', flush=True)

  return show


def train(
  config,
  members: Sequence[Member],
  *,
  eval_steps: Sequence[int] = (),
  report_split: str | None = None,
  log_every: int = 10,
  verbose: bool = True,
  progress: Progress | None = None,
  final_variants: dict[str, Callable[[Any], Any]] | None = None,
  model_variants: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
  """Trains every member for `config.total_steps` steps; evaluates all on the evaluation split
  (`data.eval_split`, else the dataset's) at `eval_steps` and at the end, and at the end also on
  `report_split` if given. `final_variants` {name: params → params} are also evaluated at the end, as
  'final/<name>' (e.g. the trained weights cast to FP8 and back); `model_variants` {name: {model key:
  value}} evaluate the final state in the model those keys build instead — keys that change how a step is
  computed, not the parameters (`RESUMABLE_KEYS`, e.g. {'matmul_cast': 'float8_e4m3fn'}) — also as
  'final/<name>'. `progress` is called every `log_every`
  steps and at the last (default: a printed line when `verbose`).

  Returns {'members': [{'lr', 'seed', 'diverged', 'nonfinite_steps', 'eval': {step: metrics},
  'final': metrics of the last step, 'report': metrics on `report_split` (if given), 'train_loss':
  [(step, mean loss over the last `log_every` steps)], 'clipped_steps': steps whose gradient norm
  exceeded `optimizer.clip_norm` (so that clipping scaled it down; 0 without clipping)}], 'seconds':
  wall time, 'steps': total_steps, 'state': the stacked final states}."""
  data_config = config_lib.validate_config(config, num_devices=1).data
  data_info = data_lib.dataset_info(data_config)
  config_lib.validate_against_data(config, data_info)
  seeds = sorted({m.seed for m in members})
  variant_configs = {}
  for name, keys in (model_variants or {}).items():
    if not set(keys) <= set(RESUMABLE_KEYS):
      raise ValueError(f'model_variants: only {list(RESUMABLE_KEYS)} may change, got {sorted(keys)}')
    if name in (final_variants or {}):
      raise ValueError(f'model_variants: {name!r} is also a final_variants name')
    variant_configs[name] = _member_config(config, seeds[0])
    variant_configs[name].model.update(keys)
    config_lib.validate_config(variant_configs[name], num_devices=1)  # checked before anything trains
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0
  loss_fn = step_lib.LOSSES[config.model.name]
  if progress is None and verbose:
    progress = _print_progress(config.total_steps)

  # Initial states, one per seed (each seed's method preparation runs on that seed's first batches).
  setups, states, prepared = {}, {}, {}
  for seed in seeds:
    c = _member_config(config, seed)
    prepared[seed] = state_lib.method_preparation(c, data_info)
    setups[seed] = state_lib.make_setup(c, data_info, prepared[seed])
    states[seed] = jax.jit(setups[seed].create_state)()
  setup = setups[seeds[0]]
  state_K = _stack([states[m.seed] for m in members])
  lr_K = jnp.asarray([m.lr for m in members], jnp.float32)
  seed_K = jnp.asarray([m.seed for m in members], jnp.int32)

  def member_step(state, batch, lr, seed):
    step_fn = step_lib.make_train_step(
      setup.graphdef,
      _scaled(setup.tx, lr),
      loss_fn,
      seed,
      setup.schedule,
      use_dropout,
      on_nonfinite='skip',
      microbatches=config.microbatches,
    )
    return step_fn(state, batch)

  def vmapped_eval_step(graphdef):
    return jax.jit(jax.vmap(step_lib.make_eval_step(graphdef, loss_fn), in_axes=(0, None)))

  train_step = jax.jit(jax.vmap(member_step), donate_argnums=0)
  eval_step = vmapped_eval_step(setup.graphdef)
  pipelines = {seed: state_lib.whole_train_batches(config, data_config, seed) for seed in seeds}

  def evaluate(state_K, split: str | None = None, step_fn=None) -> list[dict[str, float]]:
    """Every member's metrics on `split` (default: the evaluation split), as `loop.evaluate` gives them;
    `step_fn`: another vmapped eval step than the run's (a model variant's)."""
    step_fn = eval_step if step_fn is None else step_fn
    eval_data = data_lib.make_pipeline(
      data_config,
      split=split,
      global_batch_size=config.eval_batch_size,
      seed=0,
      process_index=0,
      process_count=1,
      train=False,
    )
    totals: dict[str, np.ndarray] = {}
    for batch in eval_data:
      for k, v in jax.device_get(step_fn(state_K, batch)).items():
        totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
    num_bytes = getattr(eval_data, 'target_num_bytes', None)
    results = []
    for i in range(len(members)):
      sums = {k: float(v[i]) for k, v in totals.items()}
      metrics = step_lib.summarize_eval(config.model.name, sums)
      if num_bytes:
        metrics['eval/bits_per_byte'] = sums['loss_sum'] / (num_bytes * math.log(2))
      results.append(metrics)
    return results

  records = [{'lr': m.lr, 'seed': m.seed, 'eval': {}, 'train_loss': []} for m in members]
  window: list[np.ndarray] = []
  clip_norm = config.optimizer.get('clip_norm') or 0.0
  clipped_K = jnp.zeros(len(members), jnp.int32)  # counted on the device: no transfer per step
  t0 = time.time()
  metrics = None
  for step in range(1, config.total_steps + 1):
    by_seed = {seed: next(p) for seed, p in pipelines.items()}
    batch_K = {k: np.stack([by_seed[m.seed][k] for m in members]) for k in by_seed[seeds[0]]}
    state_K, metrics = train_step(state_K, batch_K, lr_K, seed_K)
    window.append(metrics['train/loss'])
    if clip_norm:
      clipped_K = clipped_K + (metrics['train/grad_norm'] > clip_norm)
    if step % log_every == 0 or step == config.total_steps:
      losses_K = _finite_mean(np.stack(jax.device_get(window)))
      window = []
      for r, loss in zip(records, losses_K):
        r['train_loss'].append((step, float(loss)))
      if progress is not None:
        progress(step, losses_K, time.time() - t0)
    if step in eval_steps or step == config.total_steps:
      for r, ev in zip(records, evaluate(state_K)):
        r['eval'][step] = ev
  nonfinite_K = np.asarray(jax.device_get(metrics['train/nonfinite_steps']))
  for r, n, clipped in zip(records, nonfinite_K, np.asarray(jax.device_get(clipped_K))):
    r['nonfinite_steps'] = int(n)
    r['clipped_steps'] = int(clipped)
    r['final'] = r['eval'][config.total_steps]
    r['diverged'] = bool(n > 0 or not math.isfinite(r['final']['eval/loss']))
  if report_split is not None:
    for r, ev in zip(records, evaluate(state_K, report_split)):
      r['report'] = ev
  for name, transform in (final_variants or {}).items():
    variant_K = dict(state_K, params=jax.jit(transform)(state_K['params']))
    for r, ev in zip(records, evaluate(variant_K)):
      r[f'final/{name}'] = ev
  for name, variant in variant_configs.items():
    graphdef = state_lib.make_setup(variant, data_info, prepared[seeds[0]]).graphdef
    for r, ev in zip(records, evaluate(state_K, step_fn=vmapped_eval_step(graphdef))):
      r[f'final/{name}'] = ev
  return {'members': records, 'seconds': time.time() - t0, 'steps': config.total_steps, 'state': state_K}
