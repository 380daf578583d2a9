r"""What a 64-layer Post-LN GPT looks like while it stalls at the unigram loss: the instrumentation's
per-layer moments during training, and the same quantities recomputed at a checkpoint by the plain-`jnp`
reference (`experiments/plain_reference.py`, `jax.grad` alone) as an independent check.

  # a run, instrumented and checkpointed every 50 steps, stopped (Ctrl-C) after step 50 (~4 min here):
  python -m dsjax.main --config=experiments/configs/gpu_stdlib.py:depth,64x32 --config.model.scheme=dslm \
      --config.optimizer.lr=3e-3 --config.seed=0 --config.model.remat=full --config.instrument.every=50 \
      --config.checkpoint_every=50 --workdir=/tmp/stall \
      --config.data.tokenizer=experiments/results/gpu_decisive/tokenizer/tokenizer.json
  python experiments/dslm_stall.py --workdir=/tmp/stall --out=experiments/results/dslm_stall/NAME.json

For every instrumented step of the run (`moments.jsonl`, `metrics.jsonl`) it records the training loss,
the gradient variance of each layer's output relative to the last layer's (the vanishing gradient), the
token correlation r^l of the layer outputs (rank collapse) and the branch variances. Where the workdir has
a checkpoint at an instrumented step, it restores the model there (the latest such) and computes, on
`--batches` training batches with the run's dropout masks, each layer output's gradient variance and
token correlation with the plain reference — the token correlation from explicit L×L products in float64
(the instrumentation sums instead) — beside what the instrumentation recorded at that step. The two see
different batches and the checkpoint holds the weights after the step's update, so agreement means the
same order of magnitude, not the same digits. It also records the variance of the residual sums that a
Post-LN layer's norms divide by, and what the gradient keeps along the skip connections alone
(`skip_path_gain`), and each sum's variance split into skip, branch and their covariance, the covariance
into the part the sequence's tokens share and the tokens' own (`plain_reference.residual_sum_parts`), for
the checkpoint and for a freshly initialised model of the same config.
experiments/README.md §12 reads the results.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from dsjax import data as data_lib  # noqa: E402
from dsjax import export, schemes  # noqa: E402
from dsjax.train import checkpoint as checkpoint_lib  # noqa: E402
from dsjax.train import cli  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402

LAYERS_SHOWN = (0, 1, 4, 16, 32, 48, -1)  # -1: the last layer
SITE = 'ffn_residual'  # the layer output: the residual stream entering the next layer


def _define_flags():
  flags.DEFINE_string('workdir', None, 'A dsjax.main workdir run with instrument.every > 0.')
  flags.DEFINE_string('out', None, 'The JSON to write.')
  flags.DEFINE_integer('batches', 2, 'Training batches for the reference check at the checkpoint.')


def read_moments(workdir: str) -> dict[int, dict[tuple[str, int, str], float]]:
  by_step = collections.defaultdict(dict)
  with open(os.path.join(workdir, 'moments.jsonl')) as f:
    for line in f:
      r = json.loads(line)
      if 'stat' in r:
        by_step[r['step']][(r['site'], r['layer'], r['stat'])] = r['value']
  return dict(by_step)


def read_losses(workdir: str) -> dict[int, float]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  return {r['step']: r['train/loss'] for r in records if 'train/loss' in r}


def layers_shown(depth: int) -> list[int]:
  return sorted({layer % depth for layer in LAYERS_SHOWN if layer < depth})


def instrumented(m: dict, depth: int, shown: list[int]) -> dict:
  """One step's recorded layer-output gradient variance (over the last layer's) and token correlation."""
  last = m[(SITE, depth - 1, 'grad_var')]
  return {
    'grad_var_over_last': [m[(SITE, layer, 'grad_var')] / last for layer in shown],
    'corr_seq': [m[(SITE, layer, 'corr_seq')] for layer in shown],
  }


def trajectory(moments, losses, depth: int) -> list[dict]:
  """Per instrumented step: the loss (of the nearest logged step) and the per-layer quantities."""
  rows, shown = [], layers_shown(depth)
  for step, m in sorted(moments.items()):
    nearest = min(losses, key=lambda s: abs(s - step))
    rows.append(
      {
        'step': step,
        'train_loss': losses[nearest],
        'loss_step': nearest,
        'layers': shown,
        **instrumented(m, depth, shown),
        'attn_branch_var': [m[('attn_branch', layer, 'var')] for layer in shown],
        'ffn_branch_var': [m[('ffn_branch', layer, 'var')] for layer in shown],
      }
    )
  return rows


def corr_seq_explicit(x_BLD: np.ndarray) -> float:
  """r^l from the L×L token Gram matrices: the mean over examples, hidden units and token pairs t ≠ t' of
  (x_t − μ)(x_t' − μ), over σ², with μ and σ² pooled over the whole tensor (the theory's convention)."""
  c = x_BLD.astype(np.float64) - x_BLD.mean(dtype=np.float64)
  var = (c**2).mean()
  b, l, d = c.shape
  gram_BLL = np.einsum('bti,bsi->bts', c, c)
  off_diagonal = gram_BLL.sum() - np.trace(gram_BLL, axis1=1, axis2=2).sum()
  return float(off_diagonal / (b * d * l * (l - 1)) / var)


def checkpoint_steps(workdir: str) -> list[int]:
  if not os.path.isdir(os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR)):
    return []
  checkpointer = checkpoint_lib.Checkpointer(workdir, keep=1, create=False)
  try:
    return checkpointer.steps()
  finally:
    checkpointer.close()


def reference_check(workdir: str, step: int, batches: int, moments) -> dict:
  model, config = export.restore_run(workdir, step)
  spec, tree = ref.reference_spec(model), ref.cast(ref.reference_tree(model), jnp.float32)
  pipeline = data_lib.make_pipeline(
    config.data, global_batch_size=config.batch_size, seed=config.seed, process_index=0, process_count=1
  )
  grad_vars, corrs, losses, sum_vars, parts = [], [], [], [], []
  for i, batch in zip(range(batches), pipeline):
    tokens_BL1 = jnp.asarray(batch['tokens'])
    b, l1 = tokens_BL1.shape
    masks = ref.dropout_masks(spec, step_lib.dropout_key_for_step(config.seed, step + 1 + i), b, l1 - 1)
    losses.append(float(jax.jit(ref.loss, static_argnums=2)(tree, tokens_BL1, spec, masks)))
    g_NBLD = np.asarray(jax.jit(ref.layer_output_grads, static_argnums=2)(tree, tokens_BL1, spec, masks))
    x_NBLD, sum_vars_N2, parts_N2P = jax.jit(ref.layer_outputs_and_sums, static_argnums=2)(
      tree, tokens_BL1[:, :-1], spec, masks
    )
    grad_vars.append(g_NBLD.astype(np.float64).var(axis=(1, 2, 3)))
    corrs.append([corr_seq_explicit(x) for x in np.asarray(x_NBLD)])
    sum_vars.append(np.asarray(sum_vars_N2, np.float64))
    parts.append(np.asarray(parts_N2P))
  grad_var_N, corr_N, sum_vars_N2 = (
    np.mean(grad_vars, axis=0),
    np.mean(corrs, axis=0),
    np.mean(sum_vars, axis=0),
  )
  shown = layers_shown(spec.depth)
  return {
    'checkpoint_step': step,
    'batches': batches,
    'reference_loss': float(np.mean(losses)),
    'layers': shown,
    'reference': {
      'grad_var_over_last': [float(grad_var_N[layer] / grad_var_N[-1]) for layer in shown],
      'corr_seq': [float(corr_N[layer]) for layer in shown],
    },
    'instrumentation': instrumented(moments[step], spec.depth, shown),
    'residual_sum_var': {'attn': sum_vars_N2[shown, 0].tolist(), 'ffn': sum_vars_N2[shown, 1].tolist()},
    'skip_path_gain': skip_path_gain(tree, sum_vars_N2) if spec.post_norm else None,
    'residual_sum_parts': sum_parts_shown(np.mean(parts, axis=0), shown),
    'at_init': at_init(config, spec, masks, tokens_BL1[:, :-1], shown),
  }


def at_init(config, spec, masks, tokens_BL, shown: list[int]) -> dict:
  """The residual sums' variances and the skip path's gain of a freshly initialised model of the run's
  config (params seed = the run's seed), on the last batch of the check."""
  info = data_lib.dataset_info(config.data)
  tree = ref.cast(
    ref.reference_tree(schemes.build_model(config, info, nnx.Rngs(params=config.seed))), jnp.float32
  )
  _, sum_vars_N2, parts_N2P = jax.jit(ref.layer_outputs_and_sums, static_argnums=2)(
    tree, tokens_BL, spec, masks
  )
  sum_vars_N2, parts_N2P = np.asarray(sum_vars_N2, np.float64), np.asarray(parts_N2P)
  return {
    'residual_sum_var': {'attn': sum_vars_N2[shown, 0].tolist(), 'ffn': sum_vars_N2[shown, 1].tolist()},
    'skip_path_gain': skip_path_gain(tree, sum_vars_N2) if spec.post_norm else None,
    'residual_sum_parts': sum_parts_shown(parts_N2P, shown),
  }


def sum_parts_shown(parts_N2P: np.ndarray, shown: list[int]) -> dict:
  """`plain_reference.residual_sum_parts` at the layers shown: {'attn'|'ffn': {part: [one per layer]}}."""
  return {
    site: {name: parts_N2P[shown, i, j].astype(float).tolist() for j, name in enumerate(ref.SUM_PARTS)}
    for i, site in enumerate(('attn', 'ffn'))
  }


def skip_path_gain(tree, sum_vars_N2: np.ndarray) -> float:
  """Post-LN: what the gradient's variance keeps from the last layer's output to the first's along the
  skip connections alone. Each norm divides the gradient by its input's standard deviation and each skip
  multiplies it by λ, so layer n passes λ_attn²·λ_ffn² / (var of its attention sum · var of its FFN sum);
  the product over layers 2 … N (the norms' gains left out). The branches carry the rest of the measured
  gradient back."""
  layers = tree['trunk']['stack']['layers']
  skip_attn = np.asarray(layers['skip_attn'], np.float64).reshape(-1)
  skip_ffn = np.asarray(layers.get('skip_ffn', layers['skip_attn']), np.float64).reshape(-1)
  per_layer = skip_attn**2 * skip_ffn**2 / (sum_vars_N2[:, 0] * sum_vars_N2[:, 1])
  return float(np.prod(per_layer[1:]))


def main(argv):
  del argv
  args = flags.FLAGS
  if not args.workdir or not os.path.exists(os.path.join(args.workdir, 'moments.jsonl')):
    raise ValueError(f'--workdir={args.workdir}: a dsjax.main workdir with moments.jsonl is required')
  if not args.out:
    raise ValueError('--out: the JSON to write is required')
  moments, losses = read_moments(args.workdir), read_losses(args.workdir)
  with open(os.path.join(args.workdir, 'config.json')) as f:
    config = json.load(f)
  depth = config['model']['depth']
  result = {
    'workdir_config': {
      'model': {k: config['model'][k] for k in ('depth', 'width', 'num_heads', 'block', 'scheme', 'dropout')},
      'optimizer': {k: config['optimizer'][k] for k in ('name', 'lr', 'warmup_steps')},
      'seed': config['seed'],
      'batch_size': config['batch_size'],
      'platform': jax.devices()[0].platform,
    },
    'trajectory': trajectory(moments, losses, depth),
  }
  checked = [step for step in checkpoint_steps(args.workdir) if step in moments]
  if checked:
    result['reference_check'] = reference_check(args.workdir, max(checked), args.batches, moments)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == '__main__':
  _define_flags()
  cli.run(main)  # user errors as one line, without a traceback
