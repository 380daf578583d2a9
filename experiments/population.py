r"""Train a population of runs of one config — peak learning rates × seeds — in lockstep, one vmapped step.

On a small CPU a sweep of small models is dominated by what every run pays once (start-up, compiling
the step, dispatching many small kernels). Stacking the K runs on a leading axis and `jax.vmap`-ing
the project's own train step pays it once. Member k is the run

  python -m dsjax.main --config=... --config.optimizer.lr=LR_k --config.seed=SEED_k

up to float rounding: the same model built and initialised by its method from SEED_k, the same
optimizer and schedule (`dsjax.train.step.make_train_step` itself, with the optimizer built for a peak
learning rate of 1 and its updates multiplied by LR_k — exact, because both optimizers end in
`scale_by_learning_rate` and every transformation after it is linear), the pipeline of SEED_k (data
order), the dropout keys of SEED_k. A member whose loss or gradient turns non-finite keeps its last
finite state (`on_nonfinite='skip'` semantics) and is reported as diverged.

Used by the experiment scripts beside it; `tests/test_population.py` checks a member against the
real loop.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsjax import data as data_lib
from dsjax.train import config as config_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib


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
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


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


def train(
  config,
  members: Sequence[Member],
  *,
  eval_steps: Sequence[int] = (),
  log_every: int = 10,
  verbose: bool = True,
  final_variants: dict[str, Callable[[Any], Any]] | None = None,
) -> dict[str, Any]:
  """Trains every member for `config.total_steps` steps; evaluates all at `eval_steps` and at the end.
  `final_variants` {name: params → params} are also evaluated at the end, as 'final/<name>' (e.g. the
  trained weights cast to FP8 and back).

  Returns {'members': [{'lr', 'seed', 'diverged', 'nonfinite_steps', 'eval': {step: metrics},
  'final': metrics of the last step, 'train_loss': [(step, mean loss over the last `log_every` steps)]}],
  'seconds': wall time, 'steps': total_steps}."""
  config_lib.validate_config(config, num_devices=1)
  data_info = data_lib.dataset_info(config.data)
  config_lib.validate_against_data(config, data_info)
  seeds = sorted({m.seed for m in members})
  use_dropout = config.model.dropout > 0 or config.model.attn_dropout > 0
  loss_fn = step_lib.LOSSES[config.model.name]

  # Initial states, one per seed (each seed's method preparation runs on that seed's first batches).
  setups, states = {}, {}
  for seed in seeds:
    c = _member_config(config, seed)
    prepared = state_lib.method_preparation(c, data_info)
    setups[seed] = state_lib.make_setup(c, data_info, prepared)
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

  train_step = jax.jit(jax.vmap(member_step), donate_argnums=0)
  eval_step = jax.jit(jax.vmap(step_lib.make_eval_step(setup.graphdef, loss_fn), in_axes=(0, None)))
  pipelines = {
    seed: data_lib.make_pipeline(
      config.data,
      global_batch_size=config.batch_size,
      seed=seed,
      process_index=0,
      process_count=1,
      train=True,
    )
    for seed in seeds
  }

  def evaluate(state_K) -> list[dict[str, float]]:
    totals: dict[str, np.ndarray] = {}
    for batch in data_lib.make_pipeline(
      config.data,
      global_batch_size=config.eval_batch_size,
      seed=0,
      process_index=0,
      process_count=1,
      train=False,
    ):
      for k, v in jax.device_get(eval_step(state_K, batch)).items():
        totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
    return [
      step_lib.summarize_eval(config.model.name, {k: float(v[i]) for k, v in totals.items()})
      for i in range(len(members))
    ]

  records = [{'lr': m.lr, 'seed': m.seed, 'eval': {}, 'train_loss': []} for m in members]
  window: list[np.ndarray] = []
  t0 = time.time()
  metrics = None
  for step in range(1, config.total_steps + 1):
    by_seed = {seed: next(p) for seed, p in pipelines.items()}
    batch_K = {k: np.stack([by_seed[m.seed][k] for m in members]) for k in by_seed[seeds[0]]}
    state_K, metrics = train_step(state_K, batch_K, lr_K, seed_K)
    window.append(metrics['train/loss'])
    if step % log_every == 0 or step == config.total_steps:
      losses_K = _finite_mean(np.stack(jax.device_get(window)))
      window = []
      for r, loss in zip(records, losses_K):
        r['train_loss'].append((step, float(loss)))
      if verbose:
        print(
          f'  step {step}/{config.total_steps} ({time.time() - t0:.0f}s): train loss '
          + ' '.join(f'{x:.3f}' for x in losses_K),
          flush=True,
        )
    if step in eval_steps or step == config.total_steps:
      for r, ev in zip(records, evaluate(state_K)):
        r['eval'][step] = ev
  nonfinite_K = np.asarray(jax.device_get(metrics['train/nonfinite_steps']))
  for r, n in zip(records, nonfinite_K):
    r['nonfinite_steps'] = int(n)
    r['final'] = r['eval'][config.total_steps]
    r['diverged'] = bool(n > 0 or not math.isfinite(r['final']['eval/loss']))
  for name, transform in (final_variants or {}).items():
    variant_K = dict(state_K, params=jax.jit(transform)(state_K['params']))
    for r, ev in zip(records, evaluate(variant_K)):
      r[f'final/{name}'] = ev
  return {'members': records, 'seconds': time.time() - t0, 'steps': config.total_steps, 'state': state_K}


def sweep_then_seeds(
  config, lrs: Sequence[float], num_seeds: int, final_variants: dict[str, Callable[[Any], Any]] | None = None
) -> dict[str, Any]:
  """The sweep protocol of the experiments: every lr with seed 0, then the lr with the lowest final eval
  loss with seeds 1..num_seeds-1. Returns {'grid', 'best_lr', 'best_at_edge', 'sweep': members,
  'best_seeds': the best lr's members (seed 0 first), 'seconds'}; `final_variants` are evaluated on the
  seeds 1.. members."""
  t0 = time.time()
  sweep = train(config, grid(lrs, [0]))['members']
  losses = np.asarray([m['final']['eval/loss'] for m in sweep], np.float64)
  best = int(np.nanargmin(np.where(np.isfinite(losses), losses, np.nan)))
  seeds = (
    train(config, grid([lrs[best]], range(1, num_seeds)), final_variants=final_variants)['members']
    if num_seeds > 1
    else []
  )
  for r in sweep + seeds:
    r['eval'] = {str(k): v for k, v in r['eval'].items()}
  return {
    'grid': [float(x) for x in lrs],
    'best_lr': float(lrs[best]),
    'best_at_edge': best in (0, len(lrs) - 1),
    'sweep': sweep,
    'best_seeds': [sweep[best]] + seeds,
    'seconds': time.time() - t0,
  }


def spread(values: Sequence[float]) -> dict[str, Any]:
  """mean, sample sd, min, max and the values."""
  v = np.asarray(values, np.float64)
  return {
    'mean': float(v.mean()),
    'sd': float(v.std(ddof=1)) if len(v) > 1 else 0.0,
    'min': float(v.min()),
    'max': float(v.max()),
    'values': v.tolist(),
  }


def load_results(out: str, key: str) -> tuple[str, dict[str, list]]:
  """OUT/results.json (created with an empty list under `key` if missing) and its path: an experiment
  appends each finished cell and rewrites the file, so a rerun resumes after the last finished cell."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'results.json')
  if not os.path.exists(path):
    return path, {key: []}
  with open(path) as f:
    return path, json.load(f)


def gpt_config(scheme: str, block: str, depth: int, width: int, steps: int, tie_embeddings: bool = True):
  """The deep-narrow GPT of these experiments (byte-level, seq 64, batch 16, dropout 0.1, AdamW wd 0.01,
  clip 1, warmup over the first tenth, cosine to 0) with `model.scheme` = scheme in `block`."""
  c = config_lib.base_config('gpt', optimizer_name='adamw')
  c.total_steps = c.eval_every = c.checkpoint_every = steps
  c.data.seq_len, c.batch_size, c.eval_batch_size = 64, 16, 256
  c.model.depth, c.model.width, c.model.num_heads = depth, width, max(1, width // 16)
  c.model.block, c.model.scheme = block, scheme
  c.model.dropout = 0.1
  c.model.tie_embeddings = tie_embeddings
  c.optimizer.weight_decay, c.optimizer.clip_norm = 0.01, 1.0
  c.optimizer.warmup_steps, c.optimizer.min_lr_ratio = steps // 10, 0.0
  return c
