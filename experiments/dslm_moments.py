r"""Per-layer moments at initialisation: DSLM vs Xavier, Pre-LN and Post-LN, measured vs `dsjax.theory`.

  python experiments/dslm_moments.py --out=/tmp/dslm_moments [--depth=192 --width=256 --seq_len=128]

The DSLM paper's Figures 1–4 (Kedia et al. 2024) and the project's acceptance check: a GPT with dropout
0.1 at initialisation, forward + backward on real batches of the embedded Python-documentation corpus, for
six models — DSLM Pre-LN / Post-LN × full / simple init, and the vanilla Xavier Pre-LN / Post-LN models of
the same shape. Each case runs `dsjax.moments.run` (the instrumentation tool: per-layer statistics of the
layer output under the `dsjax.instrument` probe, and the theory's prediction for the same model) into
OUT/<case>/ (moments.json, moments.png). This script adds the summary:

  forward_var_max_err   max over layers of |predicted − measured| / measured of the layer-output variance
  grad_ratio_1_N        measured gradient variance at the output of layer 1 / at layer N
  forward_growth_N_1    measured forward variance at layer N / at layer 1 (and the theory's)

written to OUT/summary.json and OUT/summary.md. Acceptance criteria: DSLM forward_var_max_err ≤ 0.2
and 1/2 ≤ grad_ratio_1_N ≤ 2; Xavier Pre-LN forward_growth_N_1 ≥ 50 at N = 192.
Runtime: ~1–2 minutes per case at 192 × 256 on a 2-core CPU (model init dominates).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

# name -> (scheme, block, dslm init or None)
CASES = {
  'dslm_preln_full': ('dslm', 'preln', 'full'),
  'dslm_preln_simple': ('dslm', 'preln', 'simple'),
  'dslm_postln_full': ('dslm', 'postln', 'full'),
  'dslm_postln_simple': ('dslm', 'postln', 'simple'),
  'xavier_preln': ('vanilla', 'preln', None),
  'xavier_postln': ('vanilla', 'postln', None),
}


def case_config(
  name: str,
  *,
  depth: int,
  width: int,
  num_heads: int,
  seq_len: int,
  batch_size: int,
  activation: str,
  dropout: float = 0.1,
  input_corr: str = 'zipf',
  attention_var: str = 'table2',
  seed: int = 0,
):
  from dsjax.train.config import base_config

  scheme, block, init = CASES[name]
  c = base_config('gpt')
  c.batch_size = batch_size
  c.seed = seed  # The model's initialisation, the batches' order and the dropout masks.
  c.data.seq_len = seq_len
  m = c.model
  m.depth, m.width, m.num_heads = depth, width, num_heads
  m.block, m.scheme, m.dropout, m.activation = block, scheme, dropout, activation
  m.remat = 'nothing_saveable'  # Keeps the 192-layer backward pass within a laptop's memory.
  if init is not None:
    m.dslm.init = init
    m.dslm.attention_var = attention_var
  if scheme == 'dslm' and input_corr == 'measure':
    # Measured on the first training batches and handed over as a number: moments.json then records
    # the correlation the full init was built from.
    import itertools

    from dsjax import data as data_lib
    from dsjax.schemes import dslm
    from dsjax.train import state

    m.dslm.input_corr = 'measure'
    moments = dslm.measure_input_moments(
      c, data_lib.dataset_info(c.data), itertools.islice(state.first_model_inputs(c), 4)
    )
    m.dslm.input_corr = moments['corr_seq']
  return c


def summarize(result: dict) -> dict:
  """The acceptance numbers of one dsjax.moments result."""
  rows, forward_errors = result['layers'], result['summary']['forward_var']
  fwd = lambda key: [r['forward_var'][key] for r in rows]
  measured, predicted = fwd('measured'), fwd('predicted')
  errors = [abs(p - m) / m for p, m in zip(predicted, measured)]  # Only for the worst layer's index.
  worst = max(range(len(errors)), key=errors.__getitem__)
  grads = [r['grad_var']['measured'] for r in rows]
  predicted_grads = [r['grad_var']['predicted'] for r in rows]
  return {
    'forward_var_max_err': forward_errors['max_rel_error'],
    'forward_var_max_err_layer': worst + 1,
    'forward_var_mean_err': forward_errors['mean_rel_error'],
    'forward_var_first_last': [measured[0], measured[-1]],
    'grad_ratio_1_N': grads[0] / grads[-1],
    'predicted_grad_ratio_1_N': predicted_grads[0] / predicted_grads[-1],
    'forward_growth_N_1': measured[-1] / measured[0],
    'predicted_growth_N_1': predicted[-1] / predicted[0],
    'grad_var_mean_err': result['summary']['grad_var']['mean_rel_error'],
    # Median relative error over layers (the instrumentation's acceptance numbers).
    **{
      f'{name}_median_err': result['summary'][name]['median_rel_error']
      for name in ('forward_var', 'grad_var', 'attn_branch_var', 'ffn_branch_var')
    },
  }


def run_cases(out: str, names, *, num_batches: int, **shape) -> dict[str, dict]:
  from dsjax import moments

  summary = {}
  for name in names:
    t0 = time.time()
    config = case_config(name, **shape)
    result = moments.run(config, os.path.join(out, name), num_batches)
    summary[name] = {**summarize(result), 'seconds': time.time() - t0}
    logging.info('%s: %s', name, summary[name])
  return summary


def markdown(summary: dict[str, dict], shape: dict) -> str:
  lines = [
    f'GPT at initialisation, {shape["depth"]} layers × d {shape["width"]}, dropout 0.1, '
    f'{shape["activation"]}, seq {shape["seq_len"]}, batch {shape["batch_size"]}, DSLM input '
    f"correlation: {shape.get('input_corr', 'zipf')}, full init's attention_var: "
    f'{shape.get("attention_var", "table2")}, seed {shape.get("seed", 0)}.',
    '',
    '| case | fwd var max err (layer) | grad var L1/LN measured (theory) | '
    'fwd var LN/L1 measured (theory) | median err: fwd var | grad var | attn branch var | '
    'FFN branch var |',
    '|---|---|---|---|---|---|---|---|',
  ]
  pct = lambda x: f'{100 * x:.1f}%'
  for name, s in summary.items():
    lines.append(
      f'| {name} | {pct(s["forward_var_max_err"])} ({s["forward_var_max_err_layer"]}) | '
      f'{s["grad_ratio_1_N"]:.3g} ({s["predicted_grad_ratio_1_N"]:.3g}) | '
      f'{s["forward_growth_N_1"]:.3g} ({s["predicted_growth_N_1"]:.3g}) | '
      f'{pct(s["forward_var_median_err"])} | {pct(s["grad_var_median_err"])} | '
      f'{pct(s["attn_branch_var_median_err"])} | {pct(s["ffn_branch_var_median_err"])} |'
    )
  return '\n'.join(lines) + '\n'


def parse_args(argv=None):
  # argparse, not absl flags: dsjax.moments defines (and requires) its own absl flags at import.
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default='/tmp/dslm_moments', help='Output directory.')
  parser.add_argument('--depth', type=int, default=192, help='Number of layers.')
  parser.add_argument('--width', type=int, default=256, help='Model width d.')
  parser.add_argument('--num_heads', type=int, default=4, help='Attention heads.')
  parser.add_argument('--seq_len', type=int, default=128, help='Tokens per sequence.')
  parser.add_argument('--batch_size', type=int, default=4, help='Sequences per batch.')
  parser.add_argument('--batches', type=int, default=2, help='Batches averaged per case.')
  parser.add_argument(
    '--activation',
    default='relu',
    choices=['relu', 'gelu'],
    help='FFN activation (the paper and its reference code use ReLU).',
  )
  parser.add_argument(
    '--input_corr',
    default='zipf',
    choices=['zipf', 'measure'],
    help="DSLM's token correlation of the embedded input: the Zipf estimate (paper, "
    'text) or measured on the data (used by the full init only).',
  )
  parser.add_argument(
    '--attention_var',
    default='table2',
    choices=['table2', 'exact'],
    help="model.dslm.attention_var of the full init: the paper's Table 2 (C1·r = 1, "
    "default) or the theory's exact attention moments.",
  )
  parser.add_argument(
    '--seed', type=int, default=0, help='config.seed: initialisation, batch order and dropout masks.'
  )
  parser.add_argument('--cases', default=','.join(CASES), help='Comma-separated subset of the cases.')
  return parser.parse_args(argv)


def main():
  args = parse_args()
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(lambda record: '/orbax/' not in record.pathname)
  shape = dict(
    depth=args.depth,
    width=args.width,
    num_heads=args.num_heads,
    seq_len=args.seq_len,
    batch_size=args.batch_size,
    activation=args.activation,
    input_corr=args.input_corr,
    attention_var=args.attention_var,
    seed=args.seed,
  )
  summary = run_cases(args.out, args.cases.split(','), num_batches=args.batches, **shape)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'summary.json'), 'w') as f:
    json.dump({'shape': shape, 'cases': summary}, f, indent=1)
  table = markdown(summary, shape)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write(table)
  print(table)


if __name__ == '__main__':
  main()
