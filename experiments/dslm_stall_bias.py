r"""What drives the 64-layer Post-LN collapse? The GPU sweep's Post-LN arms (DSLM, or `--scheme=vanilla`)
trained by an independent loop, with one change at a time to what the logits carry and pass back.

  OUT=experiments/results/dslm_stall  # each run: 8–18 min on 2 CPU cores, by machine and load
  python experiments/dslm_stall_bias.py --bias=none --seed=0 --updates=41 --out=$OUT/bias_none_s0.json
  python experiments/dslm_stall_bias.py --bias=unigram --seed=0 --updates=41 --out=$OUT/bias_unigram_s0.json
  python experiments/dslm_stall_bias.py --logit_grad=centred --seed=0 --updates=41 --out=$OUT/centred_s0.json
  python experiments/dslm_stall_bias.py --summarize $OUT/bias_*_s?.json $OUT/centred_s?.json  # the tables
  # the committed runs and their flags: experiments/README.md §12

Why. A language model's first lesson is the tokens' frequencies: in every batch part of the logits'
gradient moves them towards the frequencies, the same way at every token. In the stalled run (experiments/
README.md §12) what the branches add becomes shared by the sequence's tokens, and the token
representations collapse onto it within the warm-up. The changes, each against the plain run:
- `--bias=unigram`: a logit bias (learnt, not decayed) that starts at the train split's log-frequencies of
  the tokens, so the layers have nothing to learn there.
- `--logit_grad=centred`: no bias; the gradient reaching the model from the logits is taken less its mean
  over the batch's token positions (the part that moves every position's logits the same way, towards the
  batch's frequencies), so no parameter is moved by that part; the loss itself is unchanged. With
  `--bias=unigram` as well, the bias still gets the whole gradient.
- `--logit_scale=s`: the logits multiplied by a constant s throughout (a fixed temperature), which scales
  how much they vary from token to token at initialisation by s.
- `--dslm_k=k`: DSLM's β² = k/N, λ² = 1 − β² (the paper's k is 2). With k = N/2, λ = β, and a Post-LN
  layer's norm makes its residual add the vanilla one (LN is scale-invariant); the initial weights and the
  output scale stay DSLM's.
- `--optimizer=msgdw`: DNT's momentum SGD in place of AdamW (its lr from `--lr`), the schedule, warm-up and
  clipping unchanged. Adam divides each parameter's step by that parameter's own gradient size, which
  could give what is the same at every token larger steps than its share of the gradient; momentum SGD's
  steps keep the gradient's proportions.

The loop is independent of dsjax's training code: the model is `experiments/plain_reference.py` (plain
`jnp`, dsjax's initial weights, λ, β and dropout masks), the step plain `jax.value_and_grad` and optax —
`clip_by_global_norm(1.0)` then `adamw` with the arm's schedule (warm-up from 0 over `warmup_steps`, linear
decay to 0.01 of the peak at `total_steps`), betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on the weight
matrices and the token table only (`--optimizer=msgdw`: momentum 0.9, weight decay 1e-4, as `MSGDW`) —
and dsjax's batches (`dsjax.data.make_pipeline` with the run's seed). With `--bias=none` it is the dsjax run
itself as the CPU computes it (in float32 throughout; on a GPU dsjax's arm computes in bfloat16, the loop
still in float32): on the CPU its training losses equal those
`dsjax.main` logged for the same arm and seed bit for bit at 7 of the 8 logged steps up to 29, and within
1e-7 at the other (tests/test_dslm_stall_bias.py checks the same on a tiny model). `--scheme=vanilla` trains
the sweep's other arm. Every `--measure_every` updates, on that
update's batch and masks and before the update, it records the gradient of the loss with respect to each
layer's output (`jax.grad`; its variance at layer 1 over that at the last layer, and the share of it that is
the same at every token of a sequence), the token correlation of the layer outputs (explicit L×L products)
and the residual sums' parts (`residual_sum_parts`), and how the logits split into what the positions
share and what varies between them (`logit_parts`); every update, the gradient's norm before clipping.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs'))
import gpu_stdlib as configs  # noqa: E402  (experiments/configs/gpu_stdlib.py)

from dsjax import data as data_lib  # noqa: E402
from dsjax import schemes  # noqa: E402
from dsjax.train import cli, optimizers, protocol  # noqa: E402
from dsjax.train import config as config_lib  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments import dslm_stall, gpu_decisive  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402

TOKENIZER = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), 'results/gpu_decisive/tokenizer/tokenizer.json'
)
BIASES = ('none', 'unigram')
LOGIT_GRADS = ('full', 'centred')
DECAYED = ('kernel', 'token_embed')  # dsjax's weight-decay mask on this model
OPTIMIZERS = ('adamw', 'msgdw')
# mSGDW as DNT's GPT-2 runs set it (Qi et al. 2025, arXiv:2507.17501, Table 5: heavy-ball momentum 0.9,
# decoupled weight decay 1e-4), taken from dsjax's defaults for the paper. Its lr is the run's --lr; the
# table's 1.0 is for its own model and batch.
MSGDW = {
  key: optimizers.default_optimizer_config('msgdw', 'gpt')[key]
  for key in ('momentum', 'nesterov', 'weight_decay')
}


def _define_flags():
  flags.DEFINE_enum('bias', 'none', BIASES, "'unigram': a logit bias starting at the log-frequencies.")
  flags.DEFINE_enum(
    'logit_grad', 'full', LOGIT_GRADS, "'centred': the logits' gradient less its mean over positions."
  )
  flags.DEFINE_float('logit_scale', 1.0, 'A constant the logits are multiplied by (a fixed temperature).')
  flags.DEFINE_float(
    'dslm_k', None, 'DSLM only: model.dslm.k (β² = k/N, λ² = 1 − β²; the paper: 2). With k = N/2, λ = β.'
  )
  flags.DEFINE_string('shape', '64x32', 'DEPTHxWIDTH of the GPU sweep (experiments/configs/gpu_stdlib.py).')
  flags.DEFINE_enum('block', 'postln', ('postln', 'preln'), 'model.block')
  flags.DEFINE_enum(
    'optimizer', 'adamw', OPTIMIZERS, "'msgdw': DNT's momentum SGD in place of the arm's AdamW (set --lr)."
  )
  flags.DEFINE_enum('scheme', 'dslm', ('dslm', 'vanilla'), "model.scheme: the sweep's two arms.")
  flags.DEFINE_float('lr', 3e-3, 'Peak learning rate.')
  flags.DEFINE_integer('seed', 0, 'Parameter, data and dropout seed, as config.seed.')
  flags.DEFINE_integer('updates', 41, 'Updates to train.')
  flags.DEFINE_integer('measure_every', 5, 'Measure before every this many updates (and the last).')
  flags.DEFINE_string('tokenizer', TOKENIZER, "The sweep's tokenizer.json.")
  flags.DEFINE_string('out', None, 'The JSON to write.')
  flags.DEFINE_bool('summarize', False, 'Print the table of the JSONs named as arguments; train nothing.')
  flags.DEFINE_bool('initial_logits', False, "Print the arm's initial_logit_spread; train nothing.")
  flags.DEFINE_string('baseline', 'none', "--summarize: the variant the others' differences are from.")
  flags.DEFINE_integer('at_update', 40, '--summarize: the update the contrasts are taken at.')


def arm_config(
  shape: str,
  block: str,
  scheme: str,
  lr: float,
  seed: int,
  tokenizer: str,
  dslm_k: float | None = None,
  optimizer: str = 'adamw',
):
  """The GPU sweep's arm; with `optimizer='msgdw'` DNT's mSGDW in place of its AdamW (`MSGDW`), the
  schedule, warm-up and clipping unchanged."""
  c = configs.get_config(f'depth,{shape}')
  c.model.scheme, c.model.block, c.optimizer.lr, c.seed = scheme, block, lr, seed
  c.data.tokenizer = tokenizer
  if dslm_k is not None:
    if scheme != 'dslm':
      raise ValueError(f'--dslm_k: only with --scheme=dslm, got --scheme={scheme}')
    c.model.dslm.k = dslm_k
  if optimizer == 'msgdw':
    c.optimizer.update(name='msgdw', **MSGDW)
  config_lib.validate_config(c, num_devices=1)
  return c


def reference_tree(params, constants):
  """The plain reference's tree: the parameters with the constants put back in (the logit bias apart)."""
  return ref.merge({k: v for k, v in params.items() if k != 'logit_bias'}, constants)


@jax.custom_vjp
def centred_gradient(z_BLV):
  """The identity, whose gradient is the incoming one less its mean over the batch's token positions."""
  return z_BLV


def _centred_gradient_fwd(z_BLV):
  return z_BLV, None


def _centred_gradient_bwd(_, g_BLV):
  return (g_BLV - g_BLV.mean(axis=(0, 1), keepdims=True),)


centred_gradient.defvjp(_centred_gradient_fwd, _centred_gradient_bwd)


def make_logits(spec, constants, logit_grad: str = 'full', logit_scale: float = 1.0):
  """The logits the loss reads, as a function of (params, tokens_BL1, masks, deltas_NBLD=None): the plain
  reference's, times `logit_scale`, plus the logit bias where the run has one; with `logit_grad='centred'`
  the gradient passed back through them is `centred_gradient`'s."""

  def logits(params, tokens_BL1, masks, deltas_NBLD=None):
    z_BLV = ref.logits(reference_tree(params, constants), tokens_BL1[:, :-1], spec, masks, deltas_NBLD)
    if logit_scale != 1.0:
      z_BLV = logit_scale * z_BLV
    if logit_grad == 'centred':
      z_BLV = centred_gradient(z_BLV)
    if 'logit_bias' in params:
      z_BLV = z_BLV + params['logit_bias']
    return z_BLV

  return logits


def make_loss(spec, constants, logit_grad: str = 'full', logit_scale: float = 1.0):
  logits = make_logits(spec, constants, logit_grad, logit_scale)

  def loss(params, tokens_BL1, masks, deltas_NBLD=None):
    z_BLV = logits(params, tokens_BL1, masks, deltas_NBLD)
    return ref.cross_entropy(z_BLV, tokens_BL1[:, 1:])

  return loss


def logit_parts(z_BLV, targets_BL) -> dict:
  """How the logits split into what every position shares and what varies between positions: their
  variance over the vocabulary averaged over the positions; the part of it that is shared (the variance
  over the vocabulary of their mean over positions); and the cross-entropy the shared logits alone would
  give the batch's targets (every position given the mean logits) — the unigram loss where the shared part
  is the batch's log-frequencies, ln V where it is flat."""
  z_BLV = np.asarray(z_BLV, np.float64)
  shared_V = z_BLV.mean(axis=(0, 1))
  log_p_V = shared_V - shared_V.max() - np.log(np.exp(shared_V - shared_V.max()).sum())
  return {
    'logit_variance': float(z_BLV.var(axis=-1).mean()),
    'logit_shared': float(shared_V.var()),
    'shared_logit_loss': float(-log_p_V[np.asarray(targets_BL)].mean()),
  }


def make_schedule(config) -> optax.Schedule:
  """The lr at each update (counted from 0): warmed up linearly from 0 over `warmup_steps`, then decayed
  linearly to `min_lr_ratio` of the peak at `total_steps`."""
  o = config.optimizer
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, o.lr, o.warmup_steps),
      optax.linear_schedule(o.lr, o.min_lr_ratio * o.lr, config.total_steps - o.warmup_steps),
    ],
    [o.warmup_steps],
  )


def make_optimizer(config) -> optax.GradientTransformation:
  """The arm's optimizer written with optax alone: clipping, then AdamW (or mSGDW) with decoupled weight
  decay on the matrices and the token table, the lr warmed up from 0 and decayed linearly to
  `min_lr_ratio`. mSGDW is heavy-ball momentum, then the decay, then the lr (decay and lr coupled, as
  PyTorch's AdamW couples them)."""
  o = config.optimizer
  if o.schedule != 'linear' or o.name not in OPTIMIZERS or o.init_lr_ratio != 0 or not o.clip_norm:
    raise ValueError(
      "the loop implements the depth sweep's optimizer only: adamw or msgdw, a linear schedule from 0, "
      'clipping on'
    )
  schedule = make_schedule(config)

  def decayed(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in DECAYED, params)

  if o.name == 'msgdw':
    update = optax.chain(
      optax.trace(decay=o.momentum, nesterov=o.nesterov),
      optax.add_decayed_weights(o.weight_decay, decayed),
      optax.scale_by_learning_rate(schedule),
    )
  else:
    update = optax.adamw(schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decayed)
  return optax.chain(optax.clip_by_global_norm(o.clip_norm), update)


def measure(layer_grads, params, constants, tokens_BL1, spec, masks, shown, logits=None) -> dict:
  """`layer_grads(params, tokens_BL1, masks, deltas_NBLD)`: the loss's gradient with respect to the deltas
  added to the layer outputs (`jax.grad` of `make_loss`'s loss in its last argument). With `logits`
  (`make_logits`' function, jitted) the row also holds the logits' `logit_parts`."""
  b, l1 = tokens_BL1.shape
  grads_NBLD = layer_grads(params, tokens_BL1, masks, jnp.zeros((spec.depth, b, l1 - 1, spec.width)))
  grads_NBLD = np.asarray(grads_NBLD, np.float64)
  grad_var_N = grads_NBLD.var(axis=(1, 2, 3))
  # the share of each layer's gradient that is the same at every token of a sequence (its mean over them)
  grad_shared_N = (
    (grads_NBLD.mean(axis=2) ** 2).sum(axis=(1, 2)) * (l1 - 1) / (grads_NBLD**2).sum(axis=(1, 2, 3))
  )
  tree = reference_tree(params, constants)
  outputs_NBLD, _, parts_N2P = jax.jit(ref.layer_outputs_and_sums, static_argnums=2)(
    tree, tokens_BL1[:, :-1], spec, masks
  )
  outputs_NBLD, parts_N2P = np.asarray(outputs_NBLD), np.asarray(parts_N2P)
  return {
    'grad_var_over_last': [float(grad_var_N[layer] / grad_var_N[-1]) for layer in shown],
    'grad_shared_fraction': [float(grad_shared_N[layer]) for layer in shown],
    'corr_seq': [dslm_stall.corr_seq_explicit(outputs_NBLD[layer]) for layer in shown],
    'residual_sum_parts': dslm_stall.sum_parts_shown(parts_N2P, shown),
    **({} if logits is None else logit_parts(logits(params, tokens_BL1, masks), tokens_BL1[:, 1:])),
  }


def arm_model(config):
  """The arm's dataset info, its dsjax model as initialised for the run's seed, and the model's spec for
  the plain reference."""
  info = data_lib.dataset_info(config.data)
  model = schemes.build_model(config, info, nnx.Rngs(params=config.seed))
  return info, model, ref.reference_spec(model)


def batches(config, spec):
  """The run's batches in order, each as (tokens_BL1, the dropout masks of its update)."""
  pipeline = data_lib.make_pipeline(
    config.data, global_batch_size=config.batch_size, seed=config.seed, process_index=0, process_count=1
  )
  for done, batch in enumerate(pipeline):
    tokens_BL1 = jnp.asarray(batch['tokens'])
    b, l1 = tokens_BL1.shape
    yield tokens_BL1, ref.dropout_masks(spec, step_lib.dropout_key_for_step(config.seed, done), b, l1 - 1)


def initial_logit_spread(config) -> dict:
  """The `logit_parts` of the arm at initialisation, on the run's first batch and dropout masks."""
  _, model, spec = arm_model(config)
  tokens_BL1, masks = next(batches(config, spec))
  z_BLV = ref.logits(ref.reference_tree(model), tokens_BL1[:, :-1], spec, masks)
  return logit_parts(z_BLV, tokens_BL1[:, 1:])


def train(
  config, bias: str, updates: int, measure_every: int, logit_grad: str = 'full', logit_scale: float = 1.0
) -> dict:
  info, model, spec = arm_model(config)
  params, constants = ref.split_model(model)
  if bias == 'unigram':
    params['logit_bias'] = jnp.asarray(
      gpu_decisive.train_log_frequencies(config, info.vocab_size), jnp.float32
    )
  loss = make_loss(spec, constants, logit_grad, logit_scale)
  layer_grads = jax.jit(jax.grad(loss, argnums=3))  # compiled once, for every measurement
  logits = jax.jit(make_logits(spec, constants, logit_grad, logit_scale))
  tx = make_optimizer(config)
  opt_state = tx.init(params)

  @jax.jit
  def update(params, opt_state, tokens_BL1, masks):
    value, grads = jax.value_and_grad(loss)(params, tokens_BL1, masks)
    deltas, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, deltas), opt_state, value, optax.tree.norm(grads)

  shown, rows, losses, norms, start = dslm_stall.layers_shown(spec.depth), [], [], [], time.time()
  for done, (tokens_BL1, masks) in zip(range(updates), batches(config, spec)):
    if done % measure_every == 0 or done == updates - 1:
      rows.append(
        {
          'updates': done,
          'layers': shown,
          **measure(layer_grads, params, constants, tokens_BL1, spec, masks, shown, logits),
        }
      )
    params, opt_state, value, norm = update(params, opt_state, tokens_BL1, masks)
    losses.append(float(value))
    norms.append(float(norm))
    print(f'update {done + 1}: loss {losses[-1]:.4f} ({time.time() - start:.0f} s)', flush=True)
  # grad_norms: each update's global gradient norm before clipping (clipped where above clip_norm)
  return {'rows': rows, 'train_losses': losses, 'grad_norms': norms}


SUMMARY_UPDATES = (10, 20, 40)  # the rows of a run the table shows, where it has them


def variant(run: dict) -> str:
  """What a run changed: its bias ('none', 'unigram'), with ' centred' where the layers got the logits'
  gradient less its mean, the logits' scale where it is not 1, DSLM's k where it is not the paper's 2, and
  ' mSGDW' where that replaced AdamW (runs written before these flags existed had the full gradient,
  scale 1, k = 2 and AdamW)."""
  scale, k = run.get('logit_scale', 1.0), run.get('dslm_k', 2.0)
  return (
    run['bias']
    + (' centred' if run.get('logit_grad', 'full') == 'centred' else '')
    + (f' logits ×{scale:g}' if scale != 1.0 else '')
    + (f' k={k:g}' if k != 2.0 else '')
    + (' mSGDW' if run.get('optimizer', 'adamw') == 'msgdw' else '')
  )


def read_run(path: str) -> tuple[dict, dict, str]:
  """A run's JSON, its measured rows by update, and its arm's name."""
  with open(path) as f:
    run = json.load(f)
  rows = {row['updates']: row for row in run['rows']}
  return run, rows, '{scheme} {block} {shape}, lr {lr:g}'.format(**run['arm'])


def summary_table(paths: list[str]) -> str:
  """Markdown: per run, layer 1's gradient variance over the last layer's at the updates of
  `SUMMARY_UPDATES` it has, the token correlation of layers 17, 33 and the last at its last measured
  update, and its mean training loss over its last 5 updates."""
  lines = [
    '| run | variant | seed | gradient ratio at ' + ' / '.join(map(str, SUMMARY_UPDATES)) + ' updates '
    '| token correlation, layers 17 / 33 / last (last row) | train loss, last 5 updates |',
    '|---|---|---|---|---|---|',
  ]
  for path in paths:
    r, rows, arm = read_run(path)
    ratios = ' / '.join(
      f'{rows[u]["grad_var_over_last"][0]:.2g}' if u in rows else '–' for u in SUMMARY_UPDATES
    )
    last = rows[max(rows)]
    corr = dict(zip(last['layers'], last['corr_seq']))
    corrs = ' / '.join(f'{corr[layer]:.2f}' if layer in corr else '–' for layer in (16, 32, max(corr)))
    name = f'{arm}, update {max(rows)}'
    loss = np.mean(r['train_losses'][-5:])
    lines.append(f'| {name} | {variant(r)} | {r["arm"]["seed"]} | {ratios} | {corrs} | {loss:.3f} |')
  return '\n'.join(lines)


def clip_norm(run: dict) -> float:
  """The gradient norm above which a run's updates were clipped (runs written before the JSON recorded
  it all clipped at the sweep's 1.0)."""
  return run.get('clip_norm', 1.0)


def last_layer_correlation(row: dict) -> float:
  """A measured row's token correlation at the deepest layer it lists."""
  return dict(zip(row['layers'], row['corr_seq']))[max(row['layers'])]


def contrast_lines(paths: list[str], update: int = 40, baseline: str = 'none') -> str:
  """Per arm, at `update`, over the seeds of each variant (mean ± sd, min–max), and each variant's
  difference from `baseline` ('none': no bias, the full gradient) with its 95% Welch interval: log10 of
  the gradient ratio, the token correlation of layer 33 and of the last layer, and the most positive
  2λβ·Cov(shared) of the FFN sums at the layers shown; where the run recorded them, the loss on the
  update's batch, the loss of the shared logits alone (`logit_parts`) and how many of the first `update`
  updates were clipped. Over the measured updates up to `update`: the lowest and the highest log10
  gradient ratio and the highest token correlation of the last layer, which show a collapse the run has
  left again by `update`."""
  by_arm = {}
  for path in paths:
    r, rows, arm = read_run(path)
    if update not in rows:
      continue
    row = rows[update]
    corr = dict(zip(row['layers'], row['corr_seq']))
    so_far = [rows[u] for u in sorted(rows) if u <= update]
    log_ratios = [math.log10(past['grad_var_over_last'][0]) for past in so_far]
    measures = {
      'log10 gradient ratio': log_ratios[-1],  # so_far ends at `update`
      'token correlation, layer 33': corr.get(32, math.nan),
      'token correlation, last layer': last_layer_correlation(row),
      'most positive shared covariance term of an FFN sum': max(
        row['residual_sum_parts']['ffn']['cross_shared']
      ),
      **(
        {
          "loss on the update's batch": r['train_losses'][update],
          'loss of the shared logits alone (each position given their mean)': row['shared_logit_loss'],
        }
        if 'shared_logit_loss' in row
        else {}
      ),
      **(
        {'updates clipped so far': sum(n > clip_norm(r) for n in r['grad_norms'][:update])}
        if 'grad_norms' in r
        else {}
      ),
      'lowest log10 gradient ratio so far': min(log_ratios),
      'highest log10 gradient ratio so far': max(log_ratios),
      'highest token correlation of the last layer so far': max(map(last_layer_correlation, so_far)),
    }
    for name, value in measures.items():
      by_arm.setdefault((arm, name), {}).setdefault(variant(r), []).append(value)
  lines = []
  text = lambda v: '{mean:.2f} ± {sd:.2f} ({min:.2f}–{max:.2f}), n {n}'.format(**protocol.spread(v))  # noqa: E731
  for (arm, name), by_variant in sorted(by_arm.items()):
    base = by_variant.get(baseline, [])
    parts = [f'{baseline} {text(base) if base else "–"}']
    for other in sorted(set(by_variant) - {baseline}):
      interval = protocol.welch_interval(by_variant[other], base)
      difference = (
        'n < 2' if interval is None else '{difference:+.2f} [{low:+.2f}, {high:+.2f}]'.format(**interval)
      )
      parts.append(f'{other} {text(by_variant[other])}; {other} − {baseline} {difference}')
    lines.append(f'{arm} at update {update}, {name}: ' + '; '.join(parts))
  return '\n'.join(lines)


def logit_parts_lines(paths: list[str], collapsed: float = 0.97, from_update: int = 15) -> str:
  """Per run that recorded `logit_parts`: over its measured updates from `from_update` on, the range of
  the shared logits' loss and at how many it is above flat logits' (ln V); and at the measured updates
  where the last layer's token correlation is ≥ `collapsed`, the least share of the logits' variance that
  is shared, the range of the loss and of the shared logits' loss, and their largest difference."""
  lines, flat = [], math.log(configs.VOCAB_SIZE)  # the sweep's tokenizer
  for path in paths:
    r, rows, arm = read_run(path)
    measured = [row for _, row in sorted(rows.items()) if 'shared_logit_loss' in row]
    later = [row['shared_logit_loss'] for row in measured if row['updates'] >= from_update]
    if not later:
      continue
    line = (
      f"{arm}, {variant(r)}, seed {r['arm']['seed']}: shared logits' loss from update {from_update} on "
      f'{min(later):.2f}–{max(later):.2f}, above ln V = {flat:.2f} at {sum(v > flat for v in later)} of '
      f'{len(later)} measured updates'
    )
    down = [row for row in measured if last_layer_correlation(row) >= collapsed]
    if down:
      share = min(row['logit_shared'] / row['logit_variance'] for row in down)
      losses = [r['train_losses'][row['updates']] for row in down]
      shared = [row['shared_logit_loss'] for row in down]
      gap = max(abs(loss - s) for loss, s in zip(losses, shared))
      line += (
        f'; at the {len(down)} with the last layer at ≥ {collapsed:g}: shared share ≥ {share:.3f}, '
        f"loss {min(losses):.2f}–{max(losses):.2f}, shared logits' loss {min(shared):.2f}–{max(shared):.2f}, "
        f'|difference| ≤ {gap:.3f}'
      )
    lines.append(line)
  return '\n'.join(lines)


def run_facts(config) -> dict:
  """What a run's JSON records of its schedule and machine besides its arm."""
  return {
    'warmup_steps': config.optimizer.warmup_steps,
    'clip_norm': config.optimizer.clip_norm,
    'total_steps': config.total_steps,
    'platform': jax.devices()[0].platform,
    'jax': jax.__version__,
  }


def write_json(path: str, result: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w') as f:
    json.dump(result, f, indent=1)


def main(argv):
  args = flags.FLAGS
  if args.summarize:
    print(summary_table(argv[1:]))
    print(contrast_lines(argv[1:], update=args.at_update, baseline=args.baseline))
    print(logit_parts_lines(argv[1:]))
    return
  if len(argv) > 1:
    raise ValueError(f'{argv[1]!r}: JSON paths are read with --summarize only')
  config = arm_config(
    args.shape, args.block, args.scheme, args.lr, args.seed, args.tokenizer, args.dslm_k, args.optimizer
  )
  if args.initial_logits:
    print(json.dumps(initial_logit_spread(config)))
    return
  if not args.out:
    raise ValueError('--out: the JSON to write is required')
  if args.updates < 1 or args.measure_every < 1:
    raise ValueError(
      f'--updates and --measure_every must be ≥ 1, got {args.updates} and {args.measure_every}'
    )
  cli.create_output_file('--out', args.out)  # A bad path now, not after the training.
  result = {
    'arm': {
      'shape': args.shape,
      'block': args.block,
      'scheme': args.scheme,
      'lr': args.lr,
      'seed': args.seed,
    },
    'bias': args.bias,
    'optimizer': args.optimizer,
    'logit_grad': args.logit_grad,
    'logit_scale': args.logit_scale,
    **({'dslm_k': config.model.dslm.k} if args.scheme == 'dslm' else {}),
    **run_facts(config),
    **train(config, args.bias, args.updates, args.measure_every, args.logit_grad, args.logit_scale),
  }
  write_json(args.out, result)


if __name__ == '__main__':
  _define_flags()
  cli.run(main)  # user errors as one line, without a traceback
