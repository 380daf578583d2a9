r"""DNT (Qi et al. 2025, arXiv:2507.17501) Fig. 1: the distribution of |gradient| entries per weight type,
standard Pre-LN ViT vs V-DNT, at initialisation and after training, over seeds and batches.

  python experiments/dnt_gradients.py --out=experiments/results/dnt_gradients [--lrs=S1:0.01,S5:0.01] \
      [--seeds=0,1,2] [--batches=3]

Models: the ViT of `experiments/configs/dnt.py:vit,adamw` (4 × 64 on the embedded digits), setting S1
(standard Pre-Norm) and S5 (DNT), RMSNorm in both. Each seed (initialisation and data order) is trained
for 300 steps with AdamW at the learning rate --lrs gives it (default 0.01, the lr both arms' sweep
selected on held-out images, 3 seeds each), warm-up a tenth of the steps, cosine to 0; the seeds train
side by side as one population. The gradient of the loss on each of --batches batches of 512 training
images (no dropout; the same batches for every seed and arm) is taken at initialisation and after
training. Per weight type (q, k, v, o, ffn1, ffn2, norms; all layers pooled) the instrumentation's
heavy-tail statistics (`dsjax.instrument.stats.distribution_stats`): median |g|, p99.9 |g|, kurtosis
E[(g−μ)⁴]/σ⁴ — 3 for a Gaussian — and the tail ratio p99.9(|g|)/median(|g|) — 4.9 for a Gaussian.

A seed's value of a statistic is its mean over the batches; the seed is the unit of the comparison. DNT
against Pre-LN: the ratio of the scale statistics (median, p99.9; a difference of log10 means) and the
difference of the shape statistics (kurtosis, tail ratio), each with its 95% Welch interval over seeds.
The paper's direction is "DNT's smaller" for all four: a claim is reproduced where the interval lies
below zero (a ratio below 1), contradicted where it lies above, not resolved otherwise.

Writes OUT/summary.json (every seed's and batch's statistics, the intervals), OUT/summary.md and
OUT/histograms.png (seed 0, first batch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import data as data_lib  # noqa: E402
from dsjax.instrument import stats as stats_lib  # noqa: E402
from dsjax.train import population, protocol  # noqa: E402
from dsjax.train import state as state_lib  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments.configs import dnt as dnt_config  # noqa: E402

SETTINGS = ('S1', 'S5')
WHEN = ('init', 'trained')
TAIL_STATS = ('grad_abs_p50', 'grad_abs_p99.9', 'grad_kurtosis', 'grad_tail_ratio')
# Scale statistics are compared as ratios (on log10), shape statistics as differences.
SCALE_STATS = ('grad_abs_p50', 'grad_abs_p99.9')
STAT_NAMES = {
  'grad_abs_p50': 'median |g|',
  'grad_abs_p99.9': 'p99.9 |g|',
  'grad_kurtosis': 'kurtosis',
  'grad_tail_ratio': 'tail ratio',
}


def vit_config(setting: str, steps: int, seed: int = 0):
  config = dnt_config.get_config('vit,adamw')
  config.total_steps = config.eval_every = config.checkpoint_every = steps
  config.model.dnt_setting = setting
  config.optimizer.warmup_steps = steps // 10
  config.optimizer.min_lr_ratio = 0.0
  config.seed = seed
  return config


def gradient_groups(config, params, rest, graphdef, batch) -> dict[str, np.ndarray]:
  loss_fn = step_lib.LOSSES[config.model.name]
  grads = jax.jit(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch, None)[0]))(params)
  return {
    kind: np.concatenate([np.ravel(np.asarray(x)) for x in leaves])
    for kind, leaves in stats_lib.group_layer_grads(grads).items()
  }


def tail_stats(g: np.ndarray) -> dict[str, float]:
  stats = stats_lib.distribution_stats(jax.numpy.asarray(g))
  return {k: float(stats[k]) for k in TAIL_STATS}


def states(setting: str, lr: float, steps: int, seeds: list[int]) -> tuple[dict[str, list], list[float]]:
  """({'init': [state per seed], 'trained': [state per seed]}, each seed's final eval loss); the seeds
  train as one population."""
  result = population.train(vit_config(setting, steps), [population.Member(lr, s) for s in seeds])
  init = []
  for seed in seeds:
    config = vit_config(setting, steps, seed)
    init.append(jax.jit(state_lib.make_setup(config, data_lib.dataset_info(config.data)).create_state)())
  trained = [jax.tree.map(lambda x, k=k: x[k], result['state']) for k in range(len(seeds))]
  return {'init': init, 'trained': trained}, [m['final']['eval/loss'] for m in result['members']]


def measure(setting: str, lr: float, steps: int, seeds: list[int], batches: list) -> tuple[dict, dict, list]:
  """(statistics[when][kind][stat] as a seeds × batches list, the gradients of seed 0 on the first batch
  [when][kind] for the histograms, each seed's final eval loss)."""
  config = vit_config(setting, steps)
  graphdef = state_lib.make_setup(config, data_lib.dataset_info(config.data)).graphdef
  stats, first = {}, {}
  by_when, eval_losses = states(setting, lr, steps, seeds)
  for when, per_seed in by_when.items():
    rows = []  # [seed][batch] {kind: {stat: value}}
    for state in per_seed:
      grads = [gradient_groups(config, state['params'], state['rest'], graphdef, b) for b in batches]
      rows.append([{kind: tail_stats(g) for kind, g in by_kind.items()} for by_kind in grads])
      first.setdefault(when, grads[0])
    kinds = rows[0][0]
    stats[when] = {
      kind: {s: [[b[kind][s] for b in seed] for seed in rows] for s in TAIL_STATS} for kind in kinds
    }
  return stats, first, eval_losses


def seed_values(values_SB: list[list[float]], stat: str) -> list[float]:
  """A seed's value: the mean over batches (of log10 for a scale statistic)."""
  v = np.asarray(values_SB, np.float64)
  return (np.log10(v) if stat in SCALE_STATS else v).mean(axis=1).tolist()


def verdict(interval: dict | None) -> str:
  if interval is None:
    return 'no interval'
  if interval['high'] < 0:
    return 'DNT smaller'
  if interval['low'] > 0:
    return 'DNT larger'
  return 'not resolved'


def compare(stats: dict) -> dict:
  """[when][kind][stat]: each arm's spread over seeds and DNT − Pre-LN with its 95% Welch interval (on
  log10 for the scale statistics)."""
  out = {}
  for when in WHEN:
    out[when] = {}
    for kind in stats['S1'][when]:
      out[when][kind] = {}
      for stat in TAIL_STATS:
        per_arm = {s: seed_values(stats[s][when][kind][stat], stat) for s in SETTINGS}
        interval = protocol.welch_interval(per_arm['S5'], per_arm['S1'])
        out[when][kind][stat] = {
          'log10': stat in SCALE_STATS,
          **{s: protocol.spread(per_arm[s]) for s in SETTINGS},
          'dnt_minus_preln': interval,
          'verdict': verdict(interval),
        }
  return out


def _cell(c: dict, log10: bool) -> str:
  """'mean ± sd' of the two arms and DNT's ratio (scale) or difference (shape) with its interval."""
  i = c['dnt_minus_preln']
  if log10:
    arms = ' vs '.join(f'{10 ** c[s]["mean"]:.2g}' for s in SETTINGS)
    d = '' if i is None else f' ×{10 ** i["difference"]:.2f} [{10 ** i["low"]:.2f}, {10 ** i["high"]:.2f}]'
  else:
    arms = ' vs '.join(f'{c[s]["mean"]:.3g} ± {c[s]["sd"]:.2g}' for s in SETTINGS)
    d = '' if i is None else f' {i["difference"]:+.3g} [{i["low"]:+.3g}, {i["high"]:+.3g}]'
  return arms + d


def table(comparison: dict) -> str:
  lines = [
    '| weight type | when | ' + ' | '.join(STAT_NAMES[s] for s in TAIL_STATS) + ' |',
    '|---|---|' + '---|' * len(TAIL_STATS),
  ]
  for kind in comparison['init']:
    for when in WHEN:
      cells = [_cell(comparison[when][kind][s], s in SCALE_STATS) for s in TAIL_STATS]
      lines.append(f'| {kind} | {when} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def tally(comparison: dict) -> str:
  """How many (weight type, statistic) comparisons fall each way, per time point."""
  lines = []
  for when in WHEN:
    for stat in TAIL_STATS:
      verdicts = [comparison[when][kind][stat]['verdict'] for kind in comparison[when]]
      counts = ', '.join(f'{v} {verdicts.count(v)}' for v in sorted(set(verdicts)))
      lines.append(f'- {when}, {STAT_NAMES[stat]}: {counts} (of {len(verdicts)} weight types)')
  return '\n'.join(lines)


def loss_line(eval_losses: dict[str, list[float]]) -> str:
  """The trained models' eval loss ({setting: per seed}): the 'trained' rows compare models at these."""
  spreads = {s: protocol.spread(v) for s, v in eval_losses.items()}
  arms = ', '.join(f'{s} {v["mean"]:.3f} ± {v["sd"]:.3f}' for s, v in spreads.items())
  interval = protocol.welch_interval(eval_losses['S5'], eval_losses['S1'])
  if interval is None:
    return f"- trained models' eval loss: {arms}"
  d = f'{interval["difference"]:+.3f} [{interval["low"]:+.3f}, {interval["high"]:+.3f}]'
  return f"- trained models' eval loss: {arms}; S5 − S1 {d}"


def parse_lrs(text: str) -> dict[str, float]:
  lrs = {setting: float(lr) for setting, lr in (item.split(':') for item in text.split(','))}
  if set(lrs) != set(SETTINGS) or not all(math.isfinite(v) and v > 0 for v in lrs.values()):
    raise ValueError(f'--lrs must give a positive lr to each of {SETTINGS}, got {text!r}')
  return lrs


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--lrs', default='S1:0.01,S5:0.01', help='AdamW peak lr per setting.')
  parser.add_argument('--steps', type=int, default=300, help='Training steps.')
  parser.add_argument('--seeds', default='0,1,2', help='Seeds (initialisation and data order) per arm.')
  parser.add_argument('--batches', type=int, default=3, help='Batches of 512 training images per gradient.')
  args = parser.parse_args(argv)
  try:
    lrs = parse_lrs(args.lrs)
    seeds = [int(s) for s in args.seeds.split(',')]
  except ValueError as e:
    parser.exit(2, f'{e}\n')
  if args.steps < 1 or args.batches < 1 or len(seeds) < 1 or min(seeds) < 0:
    parser.exit(2, '--steps and --batches must be >= 1 and --seeds non-negative integers\n')
  os.makedirs(args.out, exist_ok=True)
  config = vit_config('S1', args.steps)
  pipeline = data_lib.make_pipeline(
    config.data, global_batch_size=512, seed=123, process_index=0, process_count=1, train=True
  )
  batches = list(itertools.islice(pipeline, args.batches))
  measured = {s: measure(s, lrs[s], args.steps, seeds, batches) for s in SETTINGS}
  stats = {s: measured[s][0] for s in SETTINGS}
  comparison = compare(stats)
  eval_losses = {s: measured[s][2] for s in SETTINGS}
  summary = {
    'eval_loss': {s: protocol.spread(v) for s, v in eval_losses.items()},
    'adamw_lr': lrs,
    'steps': args.steps,
    'seeds': seeds,
    'batches': args.batches,
    'statistics': stats,
    'comparison': comparison,
  }
  with open(os.path.join(args.out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1)
  text = (
    f'Pre-LN (S1) vs DNT (S5), {len(seeds)} seeds × {args.batches} batches of 512 images, '
    f'{args.steps} steps. Scale statistics: geometric means over seeds and DNT/Pre-LN ratio [95% CI]; '
    'shape statistics: mean ± sd and DNT − Pre-LN [95% CI].\n\n'
    + table(comparison)
    + '\n\n'
    + tally(comparison)
    + '\n'
    + loss_line(eval_losses)
    + '\n'
  )
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write(text)
  print(text)
  plot({s: measured[s][1] for s in SETTINGS}, os.path.join(args.out, 'histograms.png'))


def plot(grads, path: str):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  kinds = list(grads['S1']['init'])
  fig, axes = plt.subplots(2, len(kinds), figsize=(2.6 * len(kinds), 5), constrained_layout=True)
  for row, when in enumerate(WHEN):
    for col, kind in enumerate(kinds):
      ax = axes[row, col]
      for setting, name in zip(SETTINGS, ('Pre-LN (S1)', 'DNT (S5)')):
        g = np.abs(grads[setting][when][kind])
        ax.hist(np.log10(g[g > 0]), bins=80, histtype='step', density=True, label=name)
      ax.set_title(f'{kind}, {when}', fontsize=9)
      ax.set_xlabel('log10 |g|', fontsize=8)
      ax.set_yscale('log')
  axes[0, 0].legend(fontsize=7)
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == '__main__':
  main()
