r"""DNT (Qi et al. 2025, arXiv:2507.17501) at CPU scale: the 2×2 of Table 1 and the S1–S5 ablation of Fig. 6.

  python experiments/dnt_sweeps.py --task=gpt --out=experiments/results/dnt_gpt            # 2×2, GPT
  python experiments/dnt_sweeps.py --task=vit --out=experiments/results/dnt_vit            # 2×2, ViT
  python experiments/dnt_sweeps.py --task=vit --settings=S2,S3,S4 --optimizers=msgdw \
      --out=experiments/results/dnt_vit_ablation                                          # Fig. 6 rest

Arms. 'Pre-LN' is DNT setting S1 (the standard Pre-Norm transformer) and 'DNT' is S5 (InputNorm, one
PreNorm before attention, MidNorm on both branches, QKNorm), both with RMSNorm, so the norm placement
is the only difference between them (`model.block='dnt'`, `model.dnt_setting`). Each arm is trained with
AdamW and with mSGDW (Qi et al. 2025, Tables 3–5 settings: betas, weight decay, momentum 0.9, cosine
schedule to 0; `configs/*_dnt.py`).

Protocol, identical for every (setting, optimizer) cell: a sweep of 5 log-spaced peak learning rates
with seed 0; the learning rate with the lowest final eval loss is then run with seeds 1 and 2 (a seed
sets the initialisation, the data order and the dropout masks). Reported: best-of-sweep mean ± sd over
the 3 seeds, min–max, and the lr curve (final eval loss against lr). A best lr at the edge of its grid is
flagged. Members of one cell train in one vmapped step (`experiments/population.py`).

Tasks (both offline, shipped with the install):
  gpt  byte-level GPT on the embedded Python-documentation corpus: 4 layers × 64, 4 heads, seq 64,
       batch 16, 300 steps; eval = the validation split (nats/byte).
  vit  ViT on the embedded 8×8 digits (1,497 train / 300 test): 4 layers × 64, 4 heads, patch 2,
       batch 64, 300 steps (~13 epochs); eval = the test split (loss and accuracy).

Writes OUT/results.json (every member's curves and final metrics), OUT/summary.md and OUT/lr_curves.png.
Runtime on the 2-core CPU: stated in experiments/README.md per command.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax.train import config as config_lib  # noqa: E402
from experiments import population  # noqa: E402

_TASK = flags.DEFINE_enum('task', 'gpt', ['gpt', 'vit'], 'Model and dataset.')
_OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
_SETTINGS = flags.DEFINE_list('settings', ['S1', 'S5'], 'DNT settings (S1 = standard Pre-LN, S5 = DNT).')
_OPTIMIZERS = flags.DEFINE_list('optimizers', ['adamw', 'msgdw'], 'Optimizers.')
_STEPS = flags.DEFINE_integer('steps', 300, 'Training steps of every run.')
_SEEDS = flags.DEFINE_integer('seeds', 3, "Seeds at the best learning rate (seed 0 is the sweep's).")

LR_GRIDS = {'adamw': (3e-4, 1e-3, 3e-3, 1e-2, 3e-2), 'msgdw': (0.01, 0.03, 0.1, 0.3, 1.0)}
NAMES = {'S1': 'Pre-LN (S1)', 'S5': 'DNT (S5)'}


def task_config(task: str, setting: str, optimizer: str, steps: int):
  c = config_lib.base_config(task, optimizer_name=optimizer)
  c.total_steps = c.eval_every = c.checkpoint_every = steps
  c.model.depth, c.model.width, c.model.num_heads = 4, 64, 4
  c.model.block, c.model.dnt_setting, c.model.norm = 'dnt', setting, 'rmsnorm'
  c.optimizer.min_lr_ratio = 0.0
  if task == 'gpt':
    c.data.seq_len, c.batch_size, c.eval_batch_size = 64, 16, 256
    c.optimizer.warmup_steps = steps // 10 if optimizer == 'adamw' else 0  # Table 5: mSGDW none.
  else:
    c.model.patch_size = 2
    c.model.init_distribution = 'truncated_normal'  # Table 4.
    c.batch_size, c.eval_batch_size = 64, 300
    c.optimizer.warmup_steps = steps // 10
  return c


def run_cell(task, setting, optimizer, steps, num_seeds) -> dict:
  print(f'{task} {setting} {optimizer}: sweep {LR_GRIDS[optimizer]}', flush=True)
  cell = population.sweep_then_seeds(
    task_config(task, setting, optimizer, steps), LR_GRIDS[optimizer], num_seeds
  )
  return {'setting': setting, 'optimizer': optimizer, **cell}


def cell_summary(cell: dict) -> dict:
  finals = [m['final'] for m in cell['best_seeds']]
  return {
    key: population.spread([f[key] for f in finals])
    for key in ('eval/loss', 'eval/accuracy')
    if key in finals[0]
  }


def write_summary(task: str, cells: list[dict], out: str):
  lines = [
    f'# DNT {task}: best-of-sweep over {len(cells[0]["best_seeds"])} seeds',
    '',
    '| setting | optimizer | best lr | eval loss mean ± sd (min–max) | accuracy mean ± sd | '
    'lr curve (eval loss, seed 0) | diverged lrs | minutes |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for cell in cells:
    s = cell_summary(cell)
    loss = s['eval/loss']
    acc = s.get('eval/accuracy')
    curve = ' '.join(f'{m["lr"]:g}:{m["final"]["eval/loss"]:.3f}' for m in cell['sweep'])
    diverged = ','.join(f'{m["lr"]:g}' for m in cell['sweep'] if m['diverged']) or '–'
    lines.append(
      f'| {NAMES.get(cell["setting"], cell["setting"])} | {cell["optimizer"]} | {cell["best_lr"]:g}'
      f'{" (grid edge)" if cell["best_at_edge"] else ""} | {loss["mean"]:.4f} ± {loss["sd"]:.4f} '
      f'({loss["min"]:.4f}–{loss["max"]:.4f}) | '
      + (f'{acc["mean"]:.4f} ± {acc["sd"]:.4f}' if acc else '–')
      + f' | {curve} | {diverged} | {cell["seconds"] / 60:.1f} |'
    )
  with open(os.path.join(out, 'summary.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


def plot(task: str, cells: list[dict], out: str):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  optimizers = sorted({c['optimizer'] for c in cells})
  fig, axes = plt.subplots(
    1, len(optimizers), figsize=(5.5 * len(optimizers), 4), constrained_layout=True, squeeze=False
  )
  for ax, opt in zip(axes[0], optimizers):
    for cell in (c for c in cells if c['optimizer'] == opt):
      lrs = [m['lr'] for m in cell['sweep']]
      losses = [m['final']['eval/loss'] if not m['diverged'] else np.nan for m in cell['sweep']]
      (line,) = ax.plot(lrs, losses, 'o-', label=NAMES.get(cell['setting'], cell['setting']))
      seeds = [m['final']['eval/loss'] for m in cell['best_seeds']]
      ax.errorbar(
        [cell['best_lr']],
        [np.mean(seeds)],
        yerr=[np.std(seeds, ddof=1)],
        color=line.get_color(),
        capsize=4,
        marker='s',
      )
    ax.set_xscale('log')
    ax.set_xlabel(f'{opt} peak learning rate')
    ax.set_ylabel('final eval loss')
    ax.set_title(f'{task}: {opt}')
    ax.grid(alpha=0.3)
    ax.legend()
  fig.savefig(os.path.join(out, 'lr_curves.png'), dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  out = _OUT.value
  path, done = population.load_results(out, 'cells')  # Resumes after the last finished cell.
  for setting in _SETTINGS.value:
    for optimizer in _OPTIMIZERS.value:
      if any(c['setting'] == setting and c['optimizer'] == optimizer for c in done['cells']):
        continue
      done['cells'].append(run_cell(_TASK.value, setting, optimizer, _STEPS.value, _SEEDS.value))
      with open(path, 'w') as f:
        json.dump(done, f)
  cells = [
    c for c in done['cells'] if c['setting'] in _SETTINGS.value and c['optimizer'] in _OPTIMIZERS.value
  ]
  write_summary(_TASK.value, cells, out)
  plot(_TASK.value, cells, out)
  print(
    f'total {sum(c["seconds"] for c in cells) / 60:.1f} min; wrote {out}/results.json, summary.md, '
    'lr_curves.png'
  )


if __name__ == '__main__':
  app.run(main)
