r"""DSLM (Kedia et al. 2024, arXiv:2403.09635) §4.6, Table 12: models cast directly to FP8 — the vanilla
Post-LN baseline against DSLM — evaluated in float32 and with every weight matmul's inputs (activations
and weights, the tied embedding too) rounded to float8_e4m3fn or float8_e5m2, unscaled
(`model.matmul_cast`, `dsjax.models.layers.direct_cast`).

  python experiments/fp8_cast.py --out=experiments/results/fp8_cast

Models: §4's two Post-LN arms of the same shape, `vanilla_postln` (BERT's init) and `dslm_postln`, at
4 × 64 (`experiments/results/dslm_depth_4x64`) and 16 × 32 (§7's `experiments/results/prior_methods`),
each retrained at the lr its sweep selected, with the sweep's seeds and training split (nothing is
selected here), and evaluated on the sweep's report split. Per seed, the loss a cast adds
(cast − float32, nats per byte); per shape and format, DSLM's added loss minus vanilla's with its 95%
Welch interval: the paper's direction is below zero (DSLM loses less). Also, per arm, the share of the
trained weight-matrix entries (embedding included) that each format rounds to zero or holds only as a
subnormal — the range half of the paper's mechanism, on the weights; the activations' share is not
measured.

Writes OUT/summary.json and OUT/summary.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import sweep as sweep_lib  # noqa: E402
from dsjax.train import population, protocol  # noqa: E402
from experiments.configs import dslm_bert  # noqa: E402

SHAPES = {'4x64': 'experiments/results/dslm_depth_4x64', '16x32': 'experiments/results/prior_methods'}
ARMS = ('vanilla_postln', 'dslm_postln')
FORMATS = ('float8_e4m3fn', 'float8_e5m2')
# The parameters a weight matmul reads: every dense kernel and the embedding tables.
MATMUL_WEIGHTS = ('kernel', 'token_embed', 'pos_embedding')


def sweep_arms(results_dir: str) -> tuple[dict, list[int], dict[str, dict]]:
  """(the sweep's splits, its seeds, {arm: its record}) for the arms of `ARMS`."""
  with open(os.path.join(results_dir, 'results.json')) as f:
    results = json.load(f)
  return results['splits'], results['seeds'], {a['name']: a for a in results['arms'] if a['name'] in ARMS}


def arm_config(shape: str, record: dict, splits: dict):
  """The sweep's arm config, trained on its training split and evaluated on its report split."""
  spec = record['name'] + ':' + ','.join(f'{k}={v}' for k, v in record['changes'].items())
  config = sweep_lib.parse_arm(spec, dslm_bert.get_config(shape)).config  # a copy of the base
  config.data.train_split, config.data.eval_split = splits['train'], splits['report']
  return config


def weight_range(state_K, fmt: str) -> dict[str, float]:
  """Share of the entries of the weight matrices (`MATMUL_WEIGHTS`, all members pooled) that `fmt` rounds
  to zero, and that it holds only as subnormals (below its smallest normal number)."""
  dtype = getattr(jax.numpy, fmt)
  leaves = [
    np.abs(np.asarray(x)).ravel()
    for path, x in jax.tree_util.tree_leaves_with_path(state_K['params'])
    if str(getattr(path[-1], 'key', '')) in MATMUL_WEIGHTS
  ]
  w = np.concatenate(leaves)
  zero = float(np.mean(w.astype(dtype).astype(np.float32) == 0))
  return {'to_zero': zero, 'subnormal': float(np.mean(w < float(np.finfo(dtype).smallest_normal))) - zero}


def run_arm(shape: str, record: dict, splits: dict, seeds: list[int]) -> dict:
  config = arm_config(shape, record, splits)
  members = [population.Member(record['selected_lr'], s) for s in seeds]
  variants = {fmt: {'matmul_cast': fmt} for fmt in FORMATS}
  result = population.train(config, members, model_variants=variants, verbose=False)
  losses = {'float32': [m['final']['eval/loss'] for m in result['members']]}
  for fmt in FORMATS:
    losses[fmt] = [m[f'final/{fmt}']['eval/loss'] for m in result['members']]
  sweep_loss = {
    m['seed']: m['report']['eval/loss'] for m in record['members'] if m['lr'] == record['selected_lr']
  }
  return {
    'lr': record['selected_lr'],
    'seeds': seeds,
    'loss': losses,
    'sweep_report_loss': [sweep_loss.get(s) for s in seeds],
    'weights': {fmt: weight_range(result['state'], fmt) for fmt in FORMATS},
    'seconds': result['seconds'],
  }


def added(arm: dict, fmt: str) -> list[float]:
  return [c - f for c, f in zip(arm['loss'][fmt], arm['loss']['float32'])]


def compare(arms: dict) -> dict:
  """Per format: each arm's added loss (spread over seeds) and DSLM's minus vanilla's, 95% Welch."""
  out = {}
  for fmt in FORMATS:
    per_arm = {a: added(arms[a], fmt) for a in ARMS}
    finite = all(math.isfinite(x) for v in per_arm.values() for x in v)
    interval = protocol.welch_interval(per_arm['dslm_postln'], per_arm['vanilla_postln']) if finite else None
    out[fmt] = {**{a: protocol.spread(per_arm[a]) for a in ARMS}, 'dslm_minus_vanilla': interval}
  return out


def table(summary: dict) -> str:
  lines = [
    '| shape | arm | lr | float32 loss | + e4m3 | + e5m2 | weights to zero / subnormal, e4m3 | e5m2 |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for shape, by_arm in summary['arms'].items():
    for name, arm in by_arm.items():
      f32 = protocol.spread(arm['loss']['float32'])
      cells = [f'{f32["mean"]:.3f} ± {f32["sd"]:.3f}']
      for fmt in FORMATS:
        s = summary['comparison'][shape][fmt][name]
        cells.append(f'{s["mean"]:+.4f} ± {s["sd"]:.4f}')
      for fmt in FORMATS:
        w = arm['weights'][fmt]
        cells.append(f'{w["to_zero"]:.1%} / {w["subnormal"]:.1%}')
      lines.append(f'| {shape} | {name} | {arm["lr"]:g} | ' + ' | '.join(cells) + ' |')
  lines += ['', '| shape | format | DSLM − vanilla, added loss [95% CI] |', '|---|---|---|']
  for shape, by_fmt in summary['comparison'].items():
    for fmt, c in by_fmt.items():
      i = c['dslm_minus_vanilla']
      text = 'non-finite loss' if i is None else f'{i["difference"]:+.4f} [{i["low"]:+.4f}, {i["high"]:+.4f}]'
      lines.append(f'| {shape} | {fmt} | {text} |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--shapes', default=','.join(SHAPES), help=f'Shapes among {list(SHAPES)}.')
  args = parser.parse_args(argv)
  shapes = args.shapes.split(',')
  if not shapes or any(s not in SHAPES for s in shapes):
    parser.exit(2, f'--shapes must be among {list(SHAPES)}, got {args.shapes!r}\n')
  os.makedirs(args.out, exist_ok=True)
  summary = {'arms': {}, 'comparison': {}}
  for shape in shapes:
    splits, seeds, records = sweep_arms(SHAPES[shape])
    summary['arms'][shape] = {a: run_arm(shape, records[a], splits, seeds) for a in ARMS}
    summary['comparison'][shape] = compare(summary['arms'][shape])
    print(f'{shape}: done', flush=True)
  with open(os.path.join(args.out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1)
  text = table(summary)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  print(text)


if __name__ == '__main__':
  main()
