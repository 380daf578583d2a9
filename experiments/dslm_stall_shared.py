r"""Which update moves the shared logits: the 64-layer Post-LN arm with DNT's momentum SGD, its logits'
gradient centred (experiments/README.md §12), its shared logits' loss attributed to the parts of each update.

  OUT=experiments/results/dslm_stall
  python experiments/dslm_stall_shared.py --scheme=vanilla --lr=0.3 --seed=0 --updates=31 \
      --out=$OUT/shared_vanilla_centred_msgdw_lr0.3_s0.json
  python experiments/dslm_stall_shared.py --summarize $OUT/shared_*.json

With the logits' gradient centred (`dslm_stall_bias.py --logit_grad=centred`) no parameter is moved by the
part of the gradient that would move every position's logits alike; under mSGDW the logits the positions
share (their mean over the batch's positions) move all the same, away from flat ones. This script trains
the same run as `dslm_stall_bias.py --optimizer=msgdw --logit_grad=centred` (the same loop and update: its
losses are that run's bit for bit) and, at every update, on that update's batch and dropout masks:
- the loss the shared logits alone give the batch's targets (`dslm_stall_bias.logit_parts`), before the
  update and after it: its change (the losses in float64 from the float32 logits);
- that change split by where the update came from, two ways: `alone`, the change with only one part of
  the update applied (exact, but the parts need not add up to the change), and `first_order`,
  ∇L_shared · Δθ_part (they add up to the change to first order). Δθ is the update the optimizer made, and
  the parts are
  - `head`: the token table's update from its use as the output layer (the tied head's gradient),
  - `input`: the token table's update from its use as the input embedding (the rest of its gradient),
  - `decay`: the token table's weight decay,
  - `trunk`: every layer's update,
  - `other`: the position table's (and any other parameter's) update.
  mSGDW's update is linear in the gradients it has seen (heavy-ball momentum of the clipped gradient, then
  decoupled decay, then the lr), so the token table's update splits exactly into the first three parts:
  each has its own momentum, fed its part of each clipped gradient. Where the first-order sum is far from
  the change, the update is too large for the first order, and only `alone` says what each part does.

Only mSGDW and no logit bias: Adam's update is not linear in the gradients.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.special
from absl import flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from dsjax.train import cli  # noqa: E402
from experiments import dslm_stall_bias  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402

PARTS = ('head', 'input', 'decay', 'trunk', 'other')


def make_shared_loss(spec, constants):
  """The cross-entropy the shared logits (the logits' mean over the batch's positions) give the batch's
  targets, as a function of (params, tokens_BL1, masks); its gradient is the true one (not centred). Also
  returns the shared logits alone, as a function of the same arguments."""
  logits = dslm_stall_bias.make_logits(spec, constants, 'full')

  def shared_logits(params, tokens_BL1, masks):
    return logits(params, tokens_BL1, masks).mean(axis=(0, 1))

  def shared_loss(params, tokens_BL1, masks):
    log_p_V = jax.nn.log_softmax(shared_logits(params, tokens_BL1, masks))
    return -log_p_V[tokens_BL1[:, 1:]].mean()

  return shared_loss, shared_logits


def shared_loss_float64(shared_V, tokens_BL1) -> float:
  """`shared_loss` from the shared logits, in float64 on the host. The losses (~5.5 nats) of a small lr's
  update differ by 1e-6–1e-4, a few float32 steps (4.8e-7 at 5.5): in float32 their differences would
  be the rounding of the means, here they are the logits'."""
  z_V = np.asarray(shared_V, np.float64)
  log_p_V = z_V - scipy.special.logsumexp(z_V)
  return float(-log_p_V[np.asarray(tokens_BL1)[:, 1:]].mean())


def make_head_grad(spec, constants, logit_grad: str):
  """The training loss's gradient with respect to the token table through its use as the output layer
  alone (the tied head), as a function of (params, tokens_BL1, masks): the table read as an untied head,
  everything else held fixed."""
  untied = dataclasses.replace(spec, tied=False)

  def loss_of_head(head_VD, params, tokens_BL1, masks):
    tree = dslm_stall_bias.reference_tree(jax.lax.stop_gradient(params), constants)
    tree['head'] = {'kernel': head_VD.T}
    z_BLV = ref.logits(tree, tokens_BL1[:, :-1], untied, masks)
    if logit_grad == 'centred':
      z_BLV = dslm_stall_bias.centred_gradient(z_BLV)
    return ref.cross_entropy(z_BLV, tokens_BL1[:, 1:])

  def head_grad(params, tokens_BL1, masks):
    return jax.grad(loss_of_head)(params['token_embed'], params, tokens_BL1, masks)

  return head_grad


def table_update_parts(config, schedule):
  """The token table's mSGDW update split into `head`, `input` and `decay`, as (init(table), step(state,
  count, clip_factor, head_grad, input_grad, table) -> (parts, state)). Each gradient part has its own
  momentum, fed that part of each clipped gradient; the three parts add up to the optimizer's update of
  the table (up to rounding)."""
  o = config.optimizer

  def init(table):
    return {'head': jnp.zeros_like(table), 'input': jnp.zeros_like(table)}

  def step(state, count, clip_factor, head_grad, input_grad, table):
    lr = schedule(count)
    parts, new_state = {}, {}
    for name, grad in (('head', head_grad), ('input', input_grad)):
      g = clip_factor * grad
      new_state[name] = o.momentum * state[name] + g
      direction = g + o.momentum * new_state[name] if o.nesterov else new_state[name]
      parts[name] = -lr * direction
    parts['decay'] = -lr * o.weight_decay * table
    return parts, new_state

  return init, step


def train(config, updates: int, logit_grad: str = 'centred') -> dict:
  """`dslm_stall_bias.train`'s loop (the same update, so the same losses), with the shared logits' loss
  attributed at every update."""
  if config.optimizer.name != 'msgdw':
    raise ValueError(f'the attribution needs mSGDW (linear in the gradients), got {config.optimizer.name}')
  _, model, spec = dslm_stall_bias.arm_model(config)
  params, constants = ref.split_model(model)
  loss = dslm_stall_bias.make_loss(spec, constants, logit_grad)
  shared_loss, shared_logits = make_shared_loss(spec, constants)
  head_grad = make_head_grad(spec, constants, logit_grad)
  tx = dslm_stall_bias.make_optimizer(config)
  schedule = dslm_stall_bias.make_schedule(config)
  table_init, table_step = table_update_parts(config, schedule)
  opt_state, table_state = tx.init(params), table_init(params['token_embed'])
  clip = config.optimizer.clip_norm

  @jax.jit
  def update(params, opt_state, tokens_BL1, masks):  # dslm_stall_bias.train's update
    value, grads = jax.value_and_grad(loss)(params, tokens_BL1, masks)
    deltas, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, deltas), opt_state, value, grads, deltas

  @jax.jit
  def attribute(params, new_params, grads, deltas, table_state, count, tokens_BL1, masks):
    shared_grads = jax.grad(shared_loss)(params, tokens_BL1, masks)
    head_g = head_grad(params, tokens_BL1, masks)
    norm = optax.tree.norm(grads)
    clip_factor = jnp.minimum(1.0, clip / norm)  # optax.clip_by_global_norm's factor
    parts, table_state = table_step(
      table_state, count, clip_factor, head_g, grads['token_embed'] - head_g, params['token_embed']
    )
    table_g = shared_grads['token_embed']
    first_order = {name: jnp.vdot(table_g, parts[name]) for name in ('head', 'input', 'decay')}
    first_order['trunk'] = sum(
      jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(shared_grads['trunk']), jax.tree.leaves(deltas['trunk']))
    )
    others = [k for k in shared_grads if k not in ('token_embed', 'trunk')]
    first_order['other'] = sum(jnp.vdot(shared_grads[k], deltas[k]) for k in others)
    table_parts_sum = parts['head'] + parts['input'] + parts['decay']
    split_error = jnp.linalg.norm(table_parts_sum - deltas['token_embed']) / jnp.maximum(
      jnp.linalg.norm(deltas['token_embed']), 1e-30
    )  # 0 where the update is 0 (the warm-up's first)
    applied = {name: {**params, 'token_embed': params['token_embed'] + parts[name]} for name in parts}
    applied['trunk'] = {**params, 'trunk': new_params['trunk']}
    applied['other'] = {**params, **{k: new_params[k] for k in others}}
    # The shared logits of the model before, after, and with each part alone applied: their losses are
    # taken in float64 (`shared_loss_float64`).
    shared_V = {name: shared_logits(p, tokens_BL1, masks) for name, p in applied.items()}
    shared_V['before'], shared_V['after'] = (
      shared_logits(p, tokens_BL1, masks) for p in (params, new_params)
    )
    return shared_V, first_order, split_error, norm, table_state

  losses, norms, rows, start = [], [], [], time.time()
  for done, (tokens_BL1, masks) in zip(range(updates), dslm_stall_bias.batches(config, spec)):
    new_params, opt_state, value, grads, deltas = update(params, opt_state, tokens_BL1, masks)
    shared_V, first_order, split_error, norm, table_state = attribute(
      params, new_params, grads, deltas, table_state, done, tokens_BL1, masks
    )
    shared = {name: shared_loss_float64(z_V, tokens_BL1) for name, z_V in shared_V.items()}
    before, after = shared.pop('before'), shared.pop('after')
    params = new_params
    losses.append(float(value))
    norms.append(float(norm))
    rows.append(
      {
        'update': done + 1,
        'shared_loss_before': before,
        'shared_loss_after': after,
        'first_order': {k: float(v) for k, v in first_order.items()},
        'alone': {name: loss - before for name, loss in shared.items()},
        'table_split_error': float(split_error),
      }
    )
    print(
      f'update {done + 1}: loss {losses[-1]:.4f}, shared {before:.3f} -> {after:.3f} '
      f'({time.time() - start:.0f} s)',
      flush=True,
    )
  return {'train_losses': losses, 'grad_norms': norms, 'attribution': rows}


def summary(paths: list[str], windows=((1, 10), (11, 20), (21, 30))) -> str:
  """Per run and window of updates: the shared logits' loss at its start and end and its change summed
  over the window; per part of the updates, the changes with that part alone applied, summed, and (in
  brackets) the first-order parts summed."""
  lines = [
    "| run | updates | shared logits' loss, start → end | change | sum of the parts alone | "
    + ' | '.join(PARTS)
    + ' |',
    '|---|---|---|---|---|' + '---|' * len(PARTS),
  ]
  for path in paths:
    with open(path) as f:
      run = json.load(f)
    rows = {r['update']: r for r in run['attribution']}
    name = os.path.basename(path).removesuffix('.json')
    for first, last in windows:
      window = [rows[u] for u in range(first, last + 1) if u in rows]
      if len(window) < last - first + 1:
        continue
      change = sum(r['shared_loss_after'] - r['shared_loss_before'] for r in window)
      alone = {p: sum(r['alone'][p] for r in window) for p in PARTS}
      first_order = {p: sum(r['first_order'][p] for r in window) for p in PARTS}
      cells = [f'{alone[p]:+.3f} ({first_order[p]:+.3f})' for p in PARTS]
      lines.append(
        f'| {name} | {first}–{last} | {window[0]["shared_loss_before"]:.3f} → '
        f'{window[-1]["shared_loss_after"]:.3f} | {change:+.3f} | {sum(alone.values()):+.3f} | '
        + ' | '.join(cells)
        + ' |'
      )
  return '\n'.join(lines)


def _define_flags():
  flags.DEFINE_string('shape', '64x32', "the depth sweep's model shape")
  flags.DEFINE_enum('scheme', 'vanilla', ['vanilla', 'dslm'], 'the arm')
  flags.DEFINE_float('lr', 0.3, "mSGDW's peak lr")
  flags.DEFINE_integer('seed', 0, 'the run seed')
  flags.DEFINE_integer('updates', 31, 'updates to train')
  flags.DEFINE_enum('logit_grad', 'centred', dslm_stall_bias.LOGIT_GRADS, "the logits' gradient")
  flags.DEFINE_string('tokenizer', dslm_stall_bias.TOKENIZER, "the GPU sweep's tokenizer")
  flags.DEFINE_string('out', None, 'the JSON to write')
  flags.DEFINE_bool('summarize', False, 'print the summary of the JSONs given as arguments')


def main(argv):
  args = flags.FLAGS
  if args.summarize:
    print(summary(argv[1:]))
    return
  if len(argv) > 1:
    raise ValueError(f'{argv[1]!r}: JSON paths are read with --summarize only')
  if not args.out:
    raise ValueError('--out: the JSON to write is required')
  if args.updates < 1:
    raise ValueError(f'--updates must be ≥ 1, got {args.updates}')
  config = dslm_stall_bias.arm_config(
    args.shape, 'postln', args.scheme, args.lr, args.seed, args.tokenizer, optimizer='msgdw'
  )
  cli.create_output_file('--out', args.out)  # A bad path now, not after the training.
  result = {
    'arm': {'shape': args.shape, 'block': 'postln', 'scheme': args.scheme, 'lr': args.lr, 'seed': args.seed},
    'optimizer': 'msgdw',
    'logit_grad': args.logit_grad,
    **dslm_stall_bias.run_facts(config),
    **train(config, args.updates, args.logit_grad),
  }
  dslm_stall_bias.write_json(args.out, result)


if __name__ == '__main__':
  _define_flags()
  cli.run(main)  # user errors as one line, without a traceback
