r"""Gradient of a 192-layer Xavier Post-LN transformer at initialisation, measured two independent ways.

  python experiments/xavier_postln_grad.py --out=experiments/results/xavier_postln_grad

`dsjax.moments` measures the gradient at each layer output through the instrumentation probe (a
`jax.custom_vjp` identity that records the cotangent passing through it). This script measures the same
quantity without it: the probe adds a zero tensor δ_n to each layer's output (= the next layer's input) and
`jax.grad` of the loss with respect to every δ_n gives ∂loss/∂x_n directly. Same model (vanilla scheme:
Xavier init, λ = β = 1, Post-LN), same batches and dropout masks; GPT 192 × 256, 4 heads, dropout 0.1,
seq 128, batch 4, 2 batches of the embedded Python-documentation corpus; ReLU and GeLU; causal (the GPT)
and bidirectional (the same weights with the causal mask switched off — the loss is still next-token
cross-entropy, which is only a scalar read-out here: the model is at initialisation).

Writes OUT/results.json (per case and layer: the two measurements, per token position the jax.grad one,
the theory's prediction — `dsjax.theory` with the attention mask of the case — and measured and predicted
token correlations of the activations and of the gradient), OUT/summary.md and OUT/grad.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import data as data_lib  # noqa: E402
from dsjax import moments, schemes  # noqa: E402
from dsjax.instrument import theory_adapter  # noqa: E402
from dsjax.models import layers  # noqa: E402
from dsjax.train import state as state_lib  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments import dslm_moments  # noqa: E402


def set_causal(model: nnx.Module, causal: bool) -> nnx.Module:
  for _, module in model.iter_modules():
    if isinstance(module, layers.Attention):
      module.causal = causal
  return model


def grad_by_perturbation(model, config, batches) -> tuple[np.ndarray, np.ndarray]:
  """Variance of ∂loss/∂(layer n output) for n = 0..N-1, by `jax.grad` w.r.t. an added zero tensor:
  pooled (N,) and per token position (N, L) (over batch and hidden units)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  depth = config.model.depth

  @jax.jit
  def layer_grads(batch, key):
    x_BL = batch['tokens'][:, :-1]
    deltas_NBLD = jnp.zeros((depth, *x_BL.shape, config.model.width), jnp.float32)

    def loss_of_deltas(deltas_NBLD):
      def probe(site, x, layer):
        return x + deltas_NBLD[layer].astype(x.dtype) if site == 'ffn_residual' else x

      return step_lib.lm_loss(nnx.merge(graphdef, params, rest), batch, key, probe)[0]

    g_NBLD = jax.grad(loss_of_deltas)(deltas_NBLD)
    return jnp.var(g_NBLD, axis=(1, 2, 3)), jnp.var(g_NBLD, axis=(1, 3))

  per_batch = [
    jax.device_get(layer_grads(b, step_lib.dropout_key_for_step(config.seed, i)))
    for i, b in enumerate(batches, start=1)
  ]
  return (
    np.mean([pooled for pooled, _ in per_batch], axis=0),
    np.mean([by_position for _, by_position in per_batch], axis=0),
  )


def run_case(activation: str, causal: bool, num_batches: int, depth: int = 192) -> dict:
  """One model: both measurements, per-position gradient variances, and the theory."""
  config = dslm_moments.case_config(
    'xavier_postln', depth=depth, width=256, num_heads=4, seq_len=128, batch_size=4, activation=activation
  )
  data_info = data_lib.dataset_info(config.data)
  model = set_causal(schemes.build_model(config, data_info, nnx.Rngs(params=config.seed), None), causal)
  pipeline = state_lib.whole_train_batches(config)
  batches = [jax.device_put(b) for b in itertools.islice(pipeline, num_batches)]
  t0 = time.time()
  plain, by_position_NL = grad_by_perturbation(model, config, batches)
  measured, _ = moments.measure(model, config, batches)
  probe = np.asarray([measured[('ffn_residual', 'grad_var')][n] for n in range(config.model.depth)])
  row = {
    'activation': activation,
    'causal': causal,
    'plain_grad_var': plain.tolist(),
    'probe_grad_var': probe.tolist(),
    'grad_var_by_position': by_position_NL.tolist(),
    'corr_seq': [measured[('ffn_residual', 'corr_seq')][n] for n in range(config.model.depth)],
    'grad_corr_seq': [measured[('ffn_residual', 'grad_corr_seq')][n] for n in range(config.model.depth)],
  }
  predicted, _ = theory_adapter.predict(config, model, data_info, measured, causal=causal)
  row.update(
    predicted_grad_var=np.asarray(predicted['grad_var']).tolist(),
    predicted_corr_seq=np.asarray(predicted['corr_seq']).tolist(),
    predicted_grad_corr_seq=np.asarray(predicted['grad_corr_seq']).tolist(),
  )
  row['seconds'] = time.time() - t0
  return row


def ratio_text(ratio: float) -> str:
  return f'{ratio:.3g}' if ratio > 0 else '0 (float32 underflow)'


def summary_lines(rows) -> list[str]:
  lines = [
    '| activation | attention | grad var layer 1 / layer N, jax.grad | same, probe | theory | '
    'max |jax.grad/probe − 1| over layers | grad token corr layer 1 / N (theory) | '
    'layer 1 / N at position 0 | same, positions ≥ 16 |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    plain, probe = np.asarray(r['plain_grad_var']), np.asarray(r['probe_grad_var'])
    position = np.asarray(r['grad_var_by_position'])
    theory = (
      f'{r["predicted_grad_var"][0] / r["predicted_grad_var"][-1]:.3g}' if 'predicted_grad_var' in r else '–'
    )
    gc = r['grad_corr_seq']
    gc_theory = (
      f' ({r["predicted_grad_corr_seq"][0]:.2f} / {r["predicted_grad_corr_seq"][-1]:.2f})'
      if 'predicted_grad_corr_seq' in r
      else ''
    )
    lines.append(
      f'| {r["activation"]} | {"causal" if r["causal"] else "bidirectional"} | '
      f'{plain[0] / plain[-1]:.3g} | {probe[0] / probe[-1]:.3g} | {theory} | '
      f'{np.max(np.abs(plain / probe - 1)):.2e} | {gc[0]:.2f} / {gc[-1]:.2f}{gc_theory} | '
      f'{position[0, 0] / position[-1, 0]:.3g} | '
      f'{ratio_text(position[0, 16:].mean() / position[-1, 16:].mean())} |'
    )
  return lines


def plot(rows, path: str):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
  for r in rows:
    name = f'{r["activation"]}, {"causal" if r["causal"] else "bidirectional"}'
    plain = np.asarray(r['plain_grad_var'])
    layers_N = np.arange(1, len(plain) + 1)
    (line,) = axes[0].plot(layers_N, plain / plain[-1], label=f'{name}: jax.grad')
    axes[0].plot(layers_N, np.asarray(r['probe_grad_var']) / r['probe_grad_var'][-1], ':', color='k', lw=0.8)
    if 'predicted_grad_var' in r:
      pred = np.asarray(r['predicted_grad_var'])
      axes[0].plot(layers_N, pred / pred[-1], '--', color=line.get_color(), label=f'{name}: theory')
    axes[1].plot(layers_N, r['grad_corr_seq'], color=line.get_color(), label=f'{name}: measured')
    if 'predicted_grad_corr_seq' in r:
      axes[1].plot(
        layers_N, r['predicted_grad_corr_seq'], '--', color=line.get_color(), label=f'{name}: theory'
      )
  axes[0].set_yscale('log')
  axes[0].set_ylabel('gradient variance / value at layer 192')
  axes[1].set_ylabel('token correlation of the gradient')
  for ax in axes:
    ax.set_xlabel('layer')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0].set_title('Xavier Post-LN, 192 layers (dotted: probe)')
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--batches', type=int, default=2, help='Batches averaged per case.')
  parser.add_argument('--depth', type=int, default=192, help='Layers.')
  parser.add_argument(
    '--cases',
    default='relu_causal,relu_bidirectional,gelu_causal,gelu_bidirectional',
    help='Comma-separated <activation>_<causal|bidirectional>; others are kept from OUT/results.json.',
  )
  args = parser.parse_args(argv)
  cases = args.cases.split(',')
  for case in cases:
    if case.split('_')[0] not in ('relu', 'gelu') or case.split('_')[-1] not in ('causal', 'bidirectional'):
      parser.error(f'--cases: {case!r} is not <relu|gelu>_<causal|bidirectional>')
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, 'results.json')
  kept = json.load(open(path)) if os.path.exists(path) else []
  name = lambda r: f'{r["activation"]}_{"causal" if r["causal"] else "bidirectional"}'
  new = {c: run_case(c.split('_')[0], c.endswith('_causal'), args.batches, args.depth) for c in cases}
  rows = [new.pop(name(r), r) for r in kept] + list(new.values())
  with open(path, 'w') as f:
    json.dump(rows, f)
  lines = summary_lines(rows)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  plot(rows, os.path.join(args.out, 'grad.png'))


if __name__ == '__main__':
  main()
