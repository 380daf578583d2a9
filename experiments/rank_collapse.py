r"""Token correlation against depth at initialisation, with and without dropout (Kedia et al. 2024,
arXiv:2403.09635, §3.4, Figs. 7–8, Appendix F), and the whole-model moment errors at 192 layers.

  python experiments/rank_collapse.py --out=experiments/results/rank_collapse

GPT 192 × 256, 4 heads, ReLU (the paper's activation), seq 128, batch 4, 2 real batches of the embedded
Python-documentation corpus; four models — Xavier (vanilla) and DSLM (simple init), each Pre-LN and
Post-LN — with dropout 0.1 and with dropout 0. Each case is `dsjax.moments` (per-layer measurement under
the instrumentation probe, and `dsjax.theory`'s prediction of the same model), run by
`experiments/dslm_moments.py`'s cases. The paper's stable value r_max (Appendix F, Xavier constants
C1 = 2.2, C2 = 0.4, p = 0.1) is `dsjax.theory.model.stable_correlation`.

Writes OUT/p<dropout>/<case>/moments.json (+ moments.png), OUT/summary.json, OUT/summary.md and
OUT/correlation.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax.theory import model as theory_model  # noqa: E402
from experiments import dslm_moments  # noqa: E402

CASES = ('xavier_preln', 'xavier_postln', 'dslm_preln_simple', 'dslm_postln_simple')
DROPOUTS = (0.1, 0.0)
SHAPE = dict(depth=192, width=256, num_heads=4, seq_len=128, batch_size=4, activation='relu')
REPORT_LAYERS = (1, 12, 48, 192)
ERROR_QUANTITIES = (
  'forward_var',
  'grad_var',
  'attn_branch_var',
  'ffn_branch_var',
  'corr_seq',
  'grad_corr_seq',
)


def load(out: str, dropout: float, case: str) -> dict:
  with open(os.path.join(out, f'p{dropout:g}', case, 'moments.json')) as f:
    return json.load(f)


def case_summary(result: dict) -> dict:
  corr = np.asarray([r['corr_seq']['measured'] for r in result['layers']])
  predicted = np.asarray([r['corr_seq']['predicted'] for r in result['layers']])
  tail = slice(len(corr) * 3 // 4, None)  # The last quarter of the layers: the plateau, if any.
  return {
    'corr_at': {n: float(corr[n - 1]) for n in REPORT_LAYERS},
    'predicted_corr_at': {n: float(predicted[n - 1]) for n in REPORT_LAYERS},
    'plateau': float(corr[tail].mean()),
    'predicted_plateau': float(predicted[tail].mean()),
    'errors': {q: result['summary'][q] for q in ERROR_QUANTITIES if q in result['summary']},
  }


def markdown(summary: dict) -> list[str]:
  r_max, rg_max = summary['paper_stable']
  lines = [
    f'Paper, Appendix F (Xavier, C1 = 2.2, C2 = 0.4, p = 0.1): r_max = {r_max:.3f}, rg_max = {rg_max:.3f}.',
    '',
    '| case | dropout | token corr at layer '
    + ' / '.join(map(str, REPORT_LAYERS))
    + ' measured (theory) | plateau, mean of the last quarter of the layers (theory) |',
    '|---|---|---|---|',
  ]
  for key, s in summary['cases'].items():
    case, p = key.rsplit('@', 1)
    at = ' / '.join(f'{s["corr_at"][n]:.3f} ({s["predicted_corr_at"][n]:.3f})' for n in REPORT_LAYERS)
    lines.append(f'| {case} | {p} | {at} | {s["plateau"]:.3f} ({s["predicted_plateau"]:.3f}) |')
  lines += [
    '',
    'Whole-model prediction error at 192 layers, dropout 0.1 (relative error for variances, absolute '
    'for correlations; mean / median / R² over the 192 layers):',
    '',
    '| case | ' + ' | '.join(ERROR_QUANTITIES) + ' |',
    '|---|' + '---|' * len(ERROR_QUANTITIES),
  ]
  for key, s in summary['cases'].items():
    if not key.endswith('@0.1'):
      continue
    cells = []
    for q in ERROR_QUANTITIES:
      e = s['errors'].get(q)
      kind = 'abs' if q.endswith('corr_seq') else 'rel'
      fmt = (lambda x: f'{x:.3f}') if kind == 'abs' else (lambda x: f'{100 * x:.1f}%')
      cells.append(
        '–'
        if e is None
        else f'{fmt(e[f"mean_{kind}_error"])} / {fmt(e[f"median_{kind}_error"])} / {e["r2"]:.3f}'
      )
    lines.append(f'| {key.rsplit("@", 1)[0]} | ' + ' | '.join(cells) + ' |')
  return lines


def plot(out: str, path: str):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(DROPOUTS), figsize=(11, 4), constrained_layout=True, sharey=True)
  for ax, p in zip(axes, DROPOUTS):
    for case in CASES:
      rows = load(out, p, case)['layers']
      layers = np.arange(1, len(rows) + 1)
      (line,) = ax.plot(layers, [r['corr_seq']['measured'] for r in rows], label=case)
      ax.plot(layers, [r['corr_seq']['predicted'] for r in rows], '--', color=line.get_color(), lw=0.8)
    ax.axhline(theory_model.stable_correlation()[0], color='grey', ls=':', label='paper r_max (App. F)')
    ax.set_title(f'dropout {p:g} (dashed: theory)')
    ax.set_xlabel('layer')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('token correlation of the layer output')
  axes[0].legend(fontsize=7)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', required=True, help='Output directory.')
  parser.add_argument('--batches', type=int, default=2, help='Batches averaged per case.')
  args = parser.parse_args(argv)
  for p in DROPOUTS:
    todo = [c for c in CASES if not os.path.exists(os.path.join(args.out, f'p{p:g}', c, 'moments.json'))]
    dslm_moments.run_cases(
      os.path.join(args.out, f'p{p:g}'), todo, num_batches=args.batches, dropout=p, **SHAPE
    )
  summary = {
    'paper_stable': theory_model.stable_correlation(),
    'cases': {f'{c}@{p:g}': case_summary(load(args.out, p, c)) for p in DROPOUTS for c in CASES},
  }
  with open(os.path.join(args.out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1)
  lines = markdown(summary)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  plot(args.out, os.path.join(args.out, 'correlation.png'))


if __name__ == '__main__':
  main()
