"""Loss functions and the jitted train / eval steps.

The steps are pure functions of a *train state* — a plain dict of arrays

    {'params': trainable nnx.Param values, 'rest': non-trainable model values (fixed λ/β, sincos
     position table, output scale), 'opt_state': optax state, 'step': int32 scalar,
     'nonfinite_steps': int32 scalar (steps whose loss or gradient was NaN/Inf)}

— and are jitted once with explicit shardings (see `loop.py`). The model is rebuilt from its static
`graphdef` inside the trace with `nnx.merge`, so there is no NNX graph traversal per step (a bare
`nnx.jit` would walk the whole module graph at every call, which grows with depth).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsjax import instrument as instrument_lib
from dsjax import models
from dsjax.models import model_inputs
from dsjax.models.transformer import Probe, no_probe
from dsjax.train import optimizers

TrainState = dict[str, Any]
Metrics = dict[str, jax.Array]


def _softmax_xent_BN(logits_BNC: jax.Array, labels_BN: jax.Array) -> jax.Array:
  logits_BNC = logits_BNC.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits_BNC, labels_BN)


def classification_loss(model, batch, dropout_key, probe: Probe = no_probe):
  """Mean cross-entropy over the (masked) batch; sums for exact evaluation averages."""
  logits_BC = model(model_inputs('vit', batch), dropout_key=dropout_key, probe=probe)
  mask_B = batch.get('mask', jnp.ones(logits_BC.shape[:1], jnp.float32))
  xent_B = _softmax_xent_BN(logits_BC, batch['label'])
  correct_B = (jnp.argmax(logits_BC, -1) == batch['label']).astype(jnp.float32)
  count = mask_B.sum()
  sums = {'loss_sum': (xent_B * mask_B).sum(), 'correct_sum': (correct_B * mask_B).sum(), 'count': count}
  return sums['loss_sum'] / jnp.maximum(count, 1.0), sums


def lm_loss(model, batch, dropout_key, probe: Probe = no_probe):
  """Next-token cross-entropy in nats per token (= per byte for the byte-level corpora)."""
  tokens_BL = batch['tokens']
  logits_BLV = model(model_inputs('gpt', batch), dropout_key=dropout_key, probe=probe)
  xent_BL = _softmax_xent_BN(logits_BLV, tokens_BL[:, 1:])
  mask_B = batch.get('mask', jnp.ones(tokens_BL.shape[:1], jnp.float32))
  mask_BL = jnp.broadcast_to(mask_B[:, None], xent_BL.shape)
  count = mask_BL.sum()
  sums = {'loss_sum': (xent_BL * mask_BL).sum(), 'count': count}
  return sums['loss_sum'] / jnp.maximum(count, 1.0), sums


LOSSES: dict[str, Callable] = {'vit': classification_loss, 'gpt': lm_loss}


def dropout_key_for_step(seed: int, step: jax.Array) -> jax.Array:
  """Dropout randomness is a function of (seed, step) only, so a resumed run replays it exactly."""
  return jax.random.fold_in(jax.random.key(seed + 1), step)


NONFINITE_POLICIES = ('stop', 'skip')


def guard_nonfinite(
  state: TrainState, updated: TrainState, finite: jax.Array, on_nonfinite: str
) -> TrainState:
  """The state after a step whose loss and gradient norm are `finite` (a bool scalar) or not.

  A non-finite step never reaches the state: its update is dropped (params and optimizer state keep
  their values) and `nonfinite_steps` counts it. With 'skip' the run goes on (the step counter advances);
  with 'stop' the state freezes from the first non-finite step on (the step counter included, so the
  step can be replayed exactly for a diagnosis) until the loop sees it, one step later, and stops.
  """
  apply = finite if on_nonfinite == 'skip' else finite & (state['nonfinite_steps'] == 0)
  keep = lambda new, old: jnp.where(apply, new, old)
  return {
    'params': jax.tree.map(keep, updated['params'], state['params']),
    'rest': state['rest'],
    'opt_state': jax.tree.map(keep, updated['opt_state'], state['opt_state']),
    'step': state['step'] + 1 if on_nonfinite == 'skip' else keep(updated['step'], state['step']),
    'nonfinite_steps': state['nonfinite_steps'] + jnp.logical_not(apply).astype(jnp.int32),
  }


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """Each array (B, ...) as (microbatches, B / microbatches, ...). Microbatch m holds rows m, m + M,
  m + 2M, …: under the batch sharding every device holds a contiguous block of rows, so when M divides
  the per-device batch each microbatch takes the same number of rows from every device and no device
  idles or exchanges rows (contiguous microbatches would sit on a fraction of the devices each)."""

  def split(x):
    return jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)

  return jax.tree.map(split, batch)


def microbatch_dropout_key(key: jax.Array | None, index) -> jax.Array | None:
  """Every microbatch draws its own dropout masks: the step's key with the microbatch index folded in."""
  return None if key is None else jax.random.fold_in(key, index)


def _zero_with_gradient(params: Any, grads: Any) -> jax.Array:
  """A scalar whose value is exactly 0 and whose gradient with respect to `params` is `grads`."""
  dot = optax.tree.vdot(params, jax.lax.stop_gradient(grads))
  return dot - jax.lax.stop_gradient(dot)


def accumulate_microbatches(
  sums_fn: Callable,
  params: Any,
  batch: dict,
  microbatches: int,
  key: jax.Array | None,
  instrumented: Callable | None = None,
) -> tuple[jax.Array, Any, Any]:
  """(loss, grads, moments) of the whole batch, computed one microbatch at a time.

  `sums_fn(params, batch, key, probe)` returns a loss function's sums ('loss_sum' and 'count', the
  masked count of what the mean is over). The loss and gradient are those of the whole batch's mean,
  sum(loss_sum) / sum(count), whatever the masks: each microbatch contributes the gradient of its
  loss *sum* (so a microbatch with more unmasked rows or tokens weighs more, as in the one big batch),
  and the sums are divided by the total count at the end. A `jax.lax.scan` over the microbatches keeps
  one microbatch's activations alive at a time; the gradient sum is accumulated in float32.

  `instrumented(loss_of_params, params)`, when given, is `dsjax.instrument.value_and_grad` (with its
  receiver): microbatches 1…M−1 run first in the scan, then microbatch 0 through `instrumented`, with
  a loss whose value is the whole batch's mean and whose gradient is the whole batch's gradient. The
  moments are therefore those of the one-big-batch step restricted to microbatch 0's rows: forward
  statistics of its activations, gradient statistics of the whole-batch loss's gradient at them (the
  same scale as without microbatches), and weight-gradient statistics of the whole gradient. Each
  probe site is visited once per step, so the instrumentation still delivers exactly one record per
  site and step. Returns moments None without `instrumented`.
  """
  split = split_microbatches(batch, microbatches)
  first = 0 if instrumented is None else 1

  def grad_of_sum(index, microbatch):
    def loss_sum(params):
      sums = sums_fn(params, microbatch, microbatch_dropout_key(key, index), no_probe)
      return sums['loss_sum'], sums

    return jax.grad(loss_sum, has_aux=True)(params)

  def add(carry, xs):
    grad_sum, loss_sum, count = carry
    grads, sums = grad_of_sum(*xs)
    grad_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_sum, grads)
    return (grad_sum, loss_sum + sums['loss_sum'], count + sums['count']), None

  zero = jnp.zeros((), jnp.float32)
  carry = (jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params), zero, zero)
  carry, _ = jax.lax.scan(
    add, carry, (jnp.arange(first, microbatches), jax.tree.map(lambda x: x[first:], split))
  )
  grad_sum, loss_sum, count = carry
  as_params = lambda grads: jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

  if instrumented is None:
    total = jnp.maximum(count, 1.0)
    return loss_sum / total, as_params(jax.tree.map(lambda g: g / total, grad_sum)), None

  first_microbatch = jax.tree.map(lambda x: x[0], split)

  def whole_batch_loss(params, probe):
    sums = sums_fn(params, first_microbatch, microbatch_dropout_key(key, 0), probe)
    total = jnp.maximum(jax.lax.stop_gradient(sums['count']) + count, 1.0)
    # The other microbatches' gradient joins as a term of value 0, so that the gradient the
    # instrumentation returns, and measures the weight statistics of, is the whole batch's.
    rest = _zero_with_gradient(params, jax.tree.map(lambda g: g / total, grad_sum))
    return (sums['loss_sum'] + loss_sum) / total + rest

  loss, grads, moments = instrumented(whole_batch_loss, params)
  return loss, grads, moments


def make_train_step(
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformation,
  loss_fn: Callable,
  seed: int,
  schedule: optax.Schedule,
  use_dropout: bool,
  instrument: bool = False,
  moments_receiver: Any = None,
  moments_per_site: bool = True,
  on_nonfinite: str = 'stop',
  microbatches: int = 1,
  moments_sample_rows: int = 0,
) -> Callable[[TrainState, dict], tuple[TrainState, Metrics]]:
  """`instrument=True`: the step also measures per-layer moments (`dsjax.instrument`) and returns them
  as metrics['moments'], packed into one float32 vector that reads as the moments
  (`instrument.PackedMoments`: one transfer to the host); the default step computes none of it. With a
  `moments_receiver` (instrument.delivery='callback', e.g. a `Collector`) the per-site statistics go to
  it by `jax.debug.callback`, tagged with the loop step, and metrics['moments'] keeps the weight
  statistics: one callback per probe site, or with `moments_per_site=False` (a step on one device) one
  per step (`dsjax.instrument.value_and_grad`). `moments_sample_rows` > 0 (instrument.sample_rows): the
  statistics from a fixed sample of rows of each probed tensor and weight-gradient leaf
  (`value_and_grad` again).
  `on_nonfinite`: what a NaN/Inf loss or gradient does to the state (see `guard_nonfinite`).

  `microbatches` > 1 (gradient accumulation): the batch is split on axis 0 (`split_microbatches`), the
  gradient summed over the microbatches inside the step, and one optimizer update applied with the
  whole batch's mean gradient — the update of the one big batch, with one microbatch's activations in
  memory (`accumulate_microbatches`; it also says what the moments are). Dropout masks differ from the
  one big batch's (each microbatch folds its index into the step's key), so without dropout the two
  agree up to float rounding. `microbatches` must divide the per-device batch.

  What the model's plan makes depend on the training step (a warm-up of the attention logit scale) is
  set from state['step'] on the model rebuilt inside the step (`models.set_training_step`); the eval
  step leaves the model as built, at the end of any warm-up."""

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, Metrics]:
    key = dropout_key_for_step(seed, state['step']) if use_dropout else None
    # The loop numbers steps from 1: the step that starts from state['step'] = t is loop step t + 1.
    instrumented = (
      functools.partial(
        instrument_lib.value_and_grad,
        receiver=moments_receiver,
        step=state['step'] + 1,
        per_site=moments_per_site,
        sample_rows=moments_sample_rows,
      )
      if instrument
      else None
    )

    def losses(params, batch, key, probe: Probe = no_probe):  # (mean loss, sums)
      model = nnx.merge(graphdef, params, state['rest'])
      models.set_training_step(model, state['step'])  # e.g. a warm-up of the attention logit scale
      return loss_fn(model, batch, key, probe)

    if microbatches > 1:
      loss, grads, moments = accumulate_microbatches(
        lambda *args: losses(*args)[1], state['params'], batch, microbatches, key, instrumented
      )
    else:
      loss_of_params = lambda params, probe=no_probe: losses(params, batch, key, probe)[0]
      if instrument:
        loss, grads, moments = instrumented(loss_of_params, state['params'])
      else:
        loss, grads = jax.value_and_grad(loss_of_params)(state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    grad_norm = optax.tree.norm(optimizers.as_float32(grads))  # float32 also for bf16 parameters
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updated = {
      'params': optax.apply_updates(state['params'], updates),
      'opt_state': opt_state,
      'step': state['step'] + 1,
    }
    new_state = guard_nonfinite(state, updated, finite, on_nonfinite)
    metrics = {
      'train/loss': loss,
      'train/grad_norm': grad_norm,
      'train/param_norm': optax.tree.norm(optimizers.as_float32(state['params'])),
      'train/lr': schedule(state['step']),
      'train/nonfinite': jnp.logical_not(finite).astype(jnp.float32),
      'train/nonfinite_steps': new_state['nonfinite_steps'].astype(jnp.float32),
    }
    if instrument:  # one array to fetch, not one per statistic (instrument.PackedMoments)
      metrics['moments'] = instrument_lib.pack_moments(moments)
    return new_state, metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: Callable) -> Callable[[TrainState, dict], Metrics]:

  def eval_step(state: TrainState, batch: dict) -> Metrics:
    model = nnx.merge(graphdef, state['params'], state['rest'])
    _, sums = loss_fn(model, batch, None)
    return sums

  return eval_step


def summarize_eval(model_name: str, sums: dict[str, float]) -> dict[str, float]:
  """Turns summed eval statistics into the reported metrics."""
  loss = sums['loss_sum'] / max(sums['count'], 1.0)
  out = {'eval/loss': loss}
  if model_name == 'vit':
    out['eval/accuracy'] = sums['correct_sum'] / max(sums['count'], 1.0)
  else:
    out['eval/bits_per_byte'] = loss / float(jnp.log(2.0))
    out['eval/perplexity'] = float(jnp.exp(loss))
  return out
