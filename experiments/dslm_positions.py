r"""Where along the sequence a deep model's gradient grows toward the input, per token position.

  python experiments/dslm_positions.py --out=experiments/results/dslm_positions [--seed=0 --batches=8]

`dsjax.theory` describes one element of a layer's output, alike at every token position; under causal
attention the positions differ (every later query reads the first key). This measures, for three DSLM
cases of `experiments/dslm_moments.py` and its two Xavier (vanilla) ones at 192 layers × d 256 (ReLU,
dropout 0.1, seq 128, batch 4), the
mean squared gradient at the output of layers 1 and 192 per token position, averaged over batches,
sequences and hidden units. The gradients come from `experiments/plain_reference.py` (the model in plain
`jnp`, differentiated by `jax.grad` alone, dropout masks as dsjax draws them), so no dsjax derivative
rule is on the path. The average over positions gives the layer-1 / layer-192 gradient ratio of
`dslm_moments.py` (2.381 for the Pre-LN full init at seed 0, as there).

Written to OUT/seed<S>.json: per case the overall ratio, per band of positions (0, 1–3, 4–15, 16–63,
64–127) the band's share of the layer's gradient energy at layers 1 and 192 and its own layer-1 /
layer-192 ratio, and the per-position values. Results and reading: experiments/dslm_results.md §1.
Runtime: ~2 minutes per case on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import data, schemes  # noqa: E402
from dsjax.train import state, step  # noqa: E402
from experiments import dslm_moments  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402

CASES = ('dslm_preln_full', 'dslm_postln_full', 'dslm_preln_simple', 'xavier_postln', 'xavier_preln')
SHAPE = {'depth': 192, 'width': 256, 'num_heads': 4, 'seq_len': 128, 'batch_size': 4, 'activation': 'relu'}
BANDS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 128))


def gradient_energy_NL(case: str, seed: int, num_batches: int) -> np.ndarray:
  """Mean squared gradient at each layer's output, per layer and token position: (layers, positions)."""
  c = dslm_moments.case_config(case, **SHAPE, seed=seed)
  info = data.dataset_info(c.data)
  model = schemes.build_model(c, info, nnx.Rngs(params=c.seed), state.method_preparation(c, info))
  spec, tree = ref.reference_spec(model), ref.reference_tree(model)
  energy_NL = 0.0
  batches = itertools.islice(state.whole_train_batches(c), num_batches)
  for k, batch in enumerate(batches, start=1):  # dropout keyed by step k, as dsjax.moments keys it
    tokens = jnp.asarray(batch['tokens'])
    masks = ref.dropout_masks(spec, step.dropout_key_for_step(c.seed, k), *tokens[:, :-1].shape)
    g_NBLD = np.asarray(ref.layer_output_grads(tree, tokens, spec, masks), np.float64)
    energy_NL = energy_NL + (g_NBLD**2).mean(axis=(1, 3)) / num_batches
  return energy_NL


def summarize(energy_NL: np.ndarray) -> dict:
  first, last = energy_NL[0], energy_NL[-1]
  bands = {
    f'{lo}-{hi - 1}': {
      'layer1_share': float(first[lo:hi].sum() / first.sum()),
      'layer192_share': float(last[lo:hi].sum() / last.sum()),
      'ratio_layer1_over_layer192': float(first[lo:hi].mean() / last[lo:hi].mean()),
    }
    for lo, hi in BANDS
  }
  return {
    'ratio_layer1_over_layer192': float(first.mean() / last.mean()),
    'bands': bands,
    'layer1_per_position': first.tolist(),
    'layer192_per_position': last.tolist(),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--seed', type=int, default=0, help='Initial weights, batches and dropout masks.')
  parser.add_argument('--batches', type=int, default=8, help='Batches averaged.')
  args = parser.parse_args()
  if args.batches < 1:
    sys.exit(f'--batches must be >= 1, got {args.batches}')
  os.makedirs(args.out, exist_ok=True)
  result = {
    'shape': SHAPE,
    'seed': args.seed,
    'batches': args.batches,
    'statistic': 'mean over batches, sequences and hidden units of the squared gradient at a layer output, '
    'per token position (plain jnp, jax.grad)',
    'cases': {},
  }
  for case in CASES:
    result['cases'][case] = summarize(gradient_energy_NL(case, args.seed, args.batches))
    bands = result['cases'][case]['bands']
    print(case, f'{result["cases"][case]["ratio_layer1_over_layer192"]:.3f}', flush=True)
    for name, b in bands.items():
      print(
        f'  positions {name}: layer-1 share {b["layer1_share"]:.3f}, layer-192 share '
        f'{b["layer192_share"]:.3f}, ratio {b["ratio_layer1_over_layer192"]:.2f}',
        flush=True,
      )
  with open(os.path.join(args.out, f'seed{args.seed}.json'), 'w') as f:
    json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
