r"""DNT (Qi et al. 2025, arXiv:2507.17501) Fig. 1: the distribution of |gradient| entries per weight type,
standard Pre-LN ViT vs V-DNT, at initialisation and after training.

  python experiments/dnt_gradients.py --out=experiments/results/dnt_gradients [--lrs=S1:0.01,S5:0.01]

Models: the ViT of `experiments/configs/dnt.py:vit,adamw` (4 × 64 on the embedded digits), setting S1
(standard Pre-Norm) and S5 (DNT), RMSNorm in both. Each is trained for 300 steps with AdamW at the
learning rate --lrs gives it (default 0.01, the best lr of both in an earlier sweep on the digits; seed
0), cosine to 0 as those numbers were measured. The gradient of the loss on 512 training images
(no dropout) is taken at initialisation and after training; per weight type (q, k, v, o, ffn1, ffn2,
norms; all layers pooled) the instrumentation's heavy-tail statistics (`dsjax.instrument.stats.
distribution_stats`: |g| quantiles, kurtosis E[(g−μ)⁴]/σ⁴ — 3 for a Gaussian — and the tail ratio
p99.9(|g|)/median(|g|) — 4.9 for a Gaussian) and a histogram of log10|g|.

Writes OUT/summary.json, OUT/summary.md, OUT/histograms.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import data as data_lib  # noqa: E402
from dsjax.instrument import stats as stats_lib  # noqa: E402
from dsjax.train import population  # noqa: E402
from dsjax.train import state as state_lib  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments.configs import dnt as dnt_config  # noqa: E402

SETTINGS = ('S1', 'S5')
TAIL_STATS = ('grad_abs_p50', 'grad_abs_p99.9', 'grad_kurtosis', 'grad_tail_ratio')


def vit_config(setting: str, steps: int):
  config = dnt_config.get_config('vit,adamw')
  config.total_steps = config.eval_every = config.checkpoint_every = steps
  config.model.dnt_setting = setting
  config.optimizer.warmup_steps = steps // 10
  config.optimizer.min_lr_ratio = 0.0
  return config


def gradient_groups(config, params, rest, graphdef, batch) -> dict[str, np.ndarray]:
  loss_fn = step_lib.LOSSES[config.model.name]
  grads = jax.jit(jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch, None)[0]))(params)
  return {
    kind: np.concatenate([np.ravel(np.asarray(x)) for x in leaves])
    for kind, leaves in stats_lib.group_layer_grads(grads).items()
  }


def measure(setting: str, lr: float, steps: int, batch) -> dict[str, dict]:
  config = vit_config(setting, steps)
  setup = state_lib.make_setup(config, data_lib.dataset_info(config.data))
  initial = jax.jit(setup.create_state)()
  trained = jax.tree.map(lambda x: x[0], population.train(config, [population.Member(lr, 0)])['state'])
  out = {}
  for when, state in (('init', initial), ('trained', trained)):
    out[when] = gradient_groups(config, state['params'], state['rest'], setup.graphdef, batch)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--lrs', default='S1:0.01,S5:0.01', help='AdamW peak lr per setting.')
  parser.add_argument('--steps', type=int, default=300, help='Training steps.')
  args = parser.parse_args(argv)
  lrs = {setting: float(lr) for setting, lr in (item.split(':') for item in args.lrs.split(','))}
  os.makedirs(args.out, exist_ok=True)
  config = vit_config('S1', args.steps)
  pipeline = data_lib.make_pipeline(
    config.data, global_batch_size=512, seed=123, process_index=0, process_count=1, train=True
  )
  batch = next(itertools.islice(pipeline, 1))
  grads = {s: measure(s, lrs[s], args.steps, batch) for s in SETTINGS}

  summary = {
    s: {
      when: {
        kind: {
          k: float(v)
          for k, v in stats_lib.distribution_stats(jax.numpy.asarray(g)).items()
          if k in TAIL_STATS
        }
        for kind, g in by_kind.items()
      }
      for when, by_kind in grads[s].items()
    }
    for s in SETTINGS
  }
  summary['adamw_lr'] = lrs
  with open(os.path.join(args.out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1)
  lines = [
    '| weight type | when | '
    + ' | '.join(f'{s}: median |g| / p99.9 / kurtosis / tail ratio' for s in SETTINGS)
    + ' |',
    '|---|---|' + '---|' * len(SETTINGS),
  ]
  for kind in grads['S1']['init']:
    for when in ('init', 'trained'):
      cells = [' / '.join(f'{summary[s][when][kind][k]:.3g}' for k in TAIL_STATS) for s in SETTINGS]
      lines.append(f'| {kind} | {when} | ' + ' | '.join(cells) + ' |')
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  plot(grads, os.path.join(args.out, 'histograms.png'))


def plot(grads, path: str):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  kinds = list(grads['S1']['init'])
  fig, axes = plt.subplots(2, len(kinds), figsize=(2.6 * len(kinds), 5), constrained_layout=True)
  for row, when in enumerate(('init', 'trained')):
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
