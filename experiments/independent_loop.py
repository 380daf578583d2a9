r"""A training loop with none of dsjax's model, gradient or optimizer code on its path: an independent check.

Used by experiments/dnt_independent.py (DNT against Pre-LN with AdamW, experiments/README.md §1 and §11)
and experiments/member_independent.py (any sweep's member: §1's mSGDW half, DSLM against the vanilla
model in §4, the prior methods against DSLM in §7) to retrain a sweep's member and set its losses beside
the sweep's.

The model is `experiments/plain_reference.py` (plain `jnp`, `jax.grad` alone, no custom derivative rule),
started from dsjax's initial weights for the seed (the method's preparation included, as `dsjax.main`
builds them). The optimizer is written here from the config's settings: `clip_by_global_norm`, then AdamW
(optax's) or momentum SGD with decoupled weight decay, mSGDW (DNT's equation, Qi et al. 2025,
arXiv:2507.17501, §2: m ← μ·m + g, w ← w − α·m, with the decay w ← w − α·wd·w on the pre-update weights),
each with decoupled weight decay on the weight matrices and the token table, times the scheduled lr; the
lr warmed up linearly from 0 over `warmup_steps` updates and then decayed to `min_lr_ratio` of the peak
at the run's last update, by a cosine or linearly. What the loop shares with dsjax are its inputs: the
initial weights, the batches (`dsjax.data.make_pipeline` with the seed) and the random numbers of the
dropout masks (each update's key is the one dsjax draws for that update, so both loops drop the same
units; `plain_reference.dropout_masks` draws them in dsjax's order).

It runs in float32 and refuses what it does not implement: another optimizer, a warm-up that starts above
0, another schedule, per-parameter learning-rate multipliers (μP's), microbatches, another compute or
parameter dtype; `plain_reference.reference_spec` refuses the model parts the reference lacks. Unlike
the sweep (`on_nonfinite='skip'`), it applies a non-finite update as it is: a member that diverged in the
sweep is not one to retrain here. What it takes from the built dsjax model besides the weights: the
constants its method fixes at initialisation (λ, β, an output scale: `plain_reference.split_model`) and the
architecture's settings (norm placement, tying, the attention logit scale: `reference_spec`).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import data as data_lib  # noqa: E402
from dsjax import schemes  # noqa: E402
from dsjax.train import state as state_lib  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402

DECAYED = ('kernel', 'token_embed')  # the weight matrices and the token table


def check_supported(config) -> None:
  """Raises for an optimizer or precision setting the loop does not implement."""
  o = config.optimizer
  name, schedule, init_ratio = o.name, o.get('schedule', 'cosine'), o.get('init_lr_ratio', 0.0)
  microbatches = config.get('microbatches', 1)
  dtype, param_dtype = config.model.get('dtype', 'float32'), config.model.get('param_dtype', 'float32')
  float32 = dtype == 'float32' or (dtype == 'auto' and jax.default_backend() == 'cpu')
  unsupported = {
    f'model.dtype={dtype!r} (float32; auto is float32 on the CPU only)': not float32,
    f'model.param_dtype={param_dtype!r} (float32)': param_dtype != 'float32',
    f'optimizer.name={name!r} (adamw or msgdw)': name not in ('adamw', 'msgdw'),
    'optimizer.nesterov=True (heavy-ball momentum only)': name == 'msgdw' and bool(o.get('nesterov')),
    f'optimizer.schedule={schedule!r} (cosine or linear)': schedule not in ('cosine', 'linear'),
    f'optimizer.init_lr_ratio={init_ratio} (a warm-up from 0)': init_ratio != 0,
    f'microbatches={microbatches}': microbatches != 1,
  }
  missing = [name for name, present in unsupported.items() if present]
  if missing:
    raise ValueError(f'the independent loop does not implement: {", ".join(missing)}')


def learning_rate(config):
  """The lr of update t (0-based): t·lr/W while t < W, then a cosine or a straight line from lr at t = W to
  min_lr_ratio·lr at t = T (the run's steps), and that value beyond."""
  o, total = config.optimizer, config.total_steps
  if o.get('schedule', 'cosine') == 'cosine':
    return optax.warmup_cosine_decay_schedule(
      0.0, o.lr, o.warmup_steps, total, end_value=o.min_lr_ratio * o.lr
    )
  peak, warmup, end = o.lr, o.warmup_steps, o.min_lr_ratio * o.lr

  def linear(t):
    t = jnp.asarray(t, jnp.float32)
    decayed = peak + (end - peak) * jnp.clip((t - warmup) / (total - warmup), 0.0, 1.0)
    return jnp.where(t < warmup, peak * t / max(warmup, 1), decayed)

  return linear


def momentum_sgdw(lr, momentum: float, weight_decay: float, decayed) -> optax.GradientTransformation:
  """mSGDW as DNT's §2 writes momentum SGD, plus decoupled weight decay: with g the gradient and α the lr
  of update t, m ← μ·m + g and w ← w − α·m − α·wd·w (the decay on `decayed(params)` only, from the
  weights before the update, and never in the momentum)."""

  def init(params):
    return {'m': jax.tree.map(jnp.zeros_like, params), 't': jnp.zeros([], jnp.int32)}

  def update(grads, state, params):
    alpha = lr(state['t'])
    m = jax.tree.map(lambda m, g: momentum * m + g, state['m'], grads)
    decay = jax.tree.map(lambda w, on: weight_decay * w if on else jnp.zeros_like(w), params, decayed(params))
    updates = jax.tree.map(lambda m, d: -alpha * (m + d), m, decay)
    return updates, {'m': m, 't': state['t'] + 1}

  return optax.GradientTransformation(init, update)


def make_optimizer(config) -> optax.GradientTransformation:
  """Clipping by the global norm (unless `clip_norm` is 0 or None), then AdamW or mSGDW with
  `learning_rate`'s schedule, decay on `DECAYED` only."""
  check_supported(config)
  o = config.optimizer
  decayed = lambda params: jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key in DECAYED, params)  # noqa: E731
  if o.name == 'adamw':
    tx = optax.adamw(learning_rate(config), o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decayed)
  else:
    tx = momentum_sgdw(learning_rate(config), o.momentum, o.weight_decay, decayed)
  if not o.get('clip_norm'):  # 0 or None: no clipping, as in dsjax
    return tx
  return optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)


def initial_model(config) -> nnx.Module:
  """dsjax's model for the config's seed, as `dsjax.main` initialises it; refused where a parameter has
  its own learning-rate multiplier (the loop's AdamW has one lr for all)."""
  info = data_lib.dataset_info(config.data)
  prepared = state_lib.method_preparation(config, info)
  model = schemes.build_model(config, info, nnx.Rngs(params=config.seed), prepared)
  scaled = {scale for scale in jax.tree.leaves(state_lib.param_lr_scales(model) or {}) if scale != 1.0}
  if scaled:
    raise ValueError(
      f'the independent loop does not implement per-parameter lr multipliers ({sorted(scaled)})'
    )
  return model


def dropout_key(seed: int, t) -> jax.Array:
  """The key of update t's dropout masks: the one dsjax uses (a function of seed and update only)."""
  return jax.random.fold_in(jax.random.key(seed + 1), t)


def report_loss(params, constants, spec, config, split: str) -> float:
  """Mean next-token loss over `split`, padded rows masked out as dsjax's evaluation does."""

  @jax.jit
  def sums(params, tokens_BL1, mask_B):
    z_BLV = ref.logits(ref.merge(params, constants), tokens_BL1[:, :-1], spec)
    xent_BL = ref.token_losses(z_BLV, tokens_BL1[:, 1:])
    mask_BL = jnp.broadcast_to(mask_B[:, None], xent_BL.shape)
    return (xent_BL * mask_BL).sum(), mask_BL.sum()

  pipeline = data_lib.make_pipeline(
    config.data,
    split=split,
    global_batch_size=config.eval_batch_size,
    seed=0,
    process_index=0,
    process_count=1,
    train=False,
  )
  total, count = 0.0, 0.0
  for batch in pipeline:
    tokens = jnp.asarray(batch['tokens'])
    mask = jnp.asarray(batch.get('mask', np.ones(tokens.shape[:1], np.float32)), jnp.float32)
    s, n = sums(params, tokens, mask)
    total, count = total + float(s), count + float(n)
  return total / count


def train(config, report_split: str, steps: int | None = None) -> dict:
  """A member trained by the loop: its training loss averaged over each `config.log_every` steps, its
  loss on `report_split` and how many steps were clipped. With `steps`, the first `steps` steps of the
  run only (the schedule still the whole run's), and no report loss (None)."""
  steps = config.total_steps if steps is None else steps
  seed = config.seed
  model = initial_model(config)
  spec = ref.reference_spec(model)
  params, constants = ref.split_model(model)
  tx = make_optimizer(config)
  opt_state = tx.init(params)

  def loss(params, tokens_BL1, key):
    batch, length = tokens_BL1[:, :-1].shape
    masks = ref.dropout_masks(spec, key, batch, length)
    return ref.loss(ref.merge(params, constants), tokens_BL1, spec, masks)

  @jax.jit
  def update(params, opt_state, tokens_BL1, t):
    key = dropout_key(seed, t) if spec.dropout > 0 else None
    value, grads = jax.value_and_grad(loss)(params, tokens_BL1, key)
    deltas, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, deltas), opt_state, value, optax.tree.norm(grads)

  pipeline = data_lib.make_pipeline(
    config.data, global_batch_size=config.batch_size, seed=seed, process_index=0, process_count=1
  )
  logged, window, clipped, start = [], [], 0, time.time()
  for step, batch in zip(range(1, steps + 1), pipeline):
    params, opt_state, value, norm = update(params, opt_state, jnp.asarray(batch['tokens']), step - 1)
    window.append(float(value))
    clip = config.optimizer.get('clip_norm')
    clipped += int(bool(clip) and float(norm) > clip)
    if step % config.log_every == 0:
      logged.append([step, float(np.mean(window))])
      window = []
      print(f'seed {seed}: step {step}, train loss {logged[-1][1]:.4f} ({time.time() - start:.0f} s)')
  seconds = time.time() - start
  finished = steps == config.total_steps
  return {
    'train_loss': logged,
    'steps': steps,
    'total_steps': config.total_steps,
    'report_loss': report_loss(params, constants, spec, config, report_split) if finished else None,
    'clipped_steps': clipped,
    'seconds': seconds,
  }
