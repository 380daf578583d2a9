r"""Per-layer moments of a training run as a table: how a statistic evolves over steps at chosen layers.

  python experiments/moments_table.py --workdir=RUN [--layers=0,10,48,95] \
      [--stats=ffn_residual/corr_seq,ffn_residual/var,attn_branch/var,ffn_residual/grad_var]

RUN is a training workdir of a run with `--config.instrument.every=N` (it holds moments.jsonl, written
by `dsjax.instrument.Collector`). Prints one row per (site/statistic, step) and one column per layer
(layer −1 is the embedding site). Example — why the 96-layer DSLM Post-LN model of
experiments/dslm_results.md §2 stays on the unigram plateau while the Pre-LN one learns:

  python -m dsjax.main --config=configs/gpt_dslm_deep.py --workdir=/tmp/dslm_postln_96 \
      --config.model.block=postln --config.total_steps=150 --config.instrument.every=50
  python experiments/moments_table.py --workdir=/tmp/dslm_postln_96
  (and the same without --config.model.block=postln, the Pre-LN config; ~1 minute each)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

DEFAULT_STATS = 'ffn_residual/corr_seq,ffn_residual/var,attn_branch/var,ffn_residual/grad_var'


def moments_table(workdir: str, layers: list[int], stats: list[str]) -> str:
  from dsjax.instrument import collector

  path = os.path.join(workdir, 'moments.jsonl')
  if not os.path.exists(path):
    raise SystemExit(f'moments_table: error: {path} does not exist (train with --config.instrument.every=N)')
  values = {(r['site'], r['stat'], r['step'], r['layer']): r['value'] for r in collector.read_jsonl(path)}
  steps = sorted({key[2] for key in values})
  lines = [
    '| site/statistic | step | ' + ' | '.join(f'layer {n}' for n in layers) + ' |',
    '|---|---|' + '---|' * len(layers),
  ]
  for name in stats:
    site, stat = name.split('/', 1)
    for step in steps:
      cells = [values.get((site, stat, step, n)) for n in layers]
      lines.append(
        f'| {name} | {step} | ' + ' | '.join('–' if v is None else f'{v:.3g}' for v in cells) + ' |'
      )
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True, help='Training workdir holding moments.jsonl.')
  parser.add_argument('--layers', default='0,10,48,95', help='Comma-separated layer indices (0-based).')
  parser.add_argument(
    '--stats', default=DEFAULT_STATS, help='Comma-separated site/statistic pairs, e.g. ffn_residual/grad_var.'
  )
  args = parser.parse_args(argv)
  try:
    layers = [int(n) for n in args.layers.split(',')]
  except ValueError:
    parser.error(f'--layers must be comma-separated integers, got {args.layers!r}')
  stats = args.stats.split(',')
  if any('/' not in s for s in stats):
    parser.error(f'--stats must be comma-separated site/statistic pairs, got {args.stats!r}')
  print(moments_table(args.workdir, layers, stats))


if __name__ == '__main__':
  main()
