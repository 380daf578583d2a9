r"""Prior methods for deep transformers at one deep-narrow shape (Kedia et al. 2024, arXiv:2403.09635,
Table 11 style), every method of `dsjax.schemes` under the same budget.

  python experiments/prior_methods.py --out=experiments/results/prior_methods

Model: byte-level GPT on the embedded Python-documentation corpus, 32 layers × 32 (2 heads), dropout 0.1,
untied head (Catformer's head reads a wider stream), seq 64, batch 16, 200 steps, AdamW (wd 0.01, clip 1,
warmup over the first tenth, cosine to 0). Each method (`model.scheme`) runs in the first block its file
lists (`dsjax.schemes.table()`; vanilla in Pre-LN and Post-LN) with its published constants (the
`model.<scheme>` defaults). Tuning effort is the same for every method: 3 peak learning rates (1e-3,
3e-3, 1e-2), seed 0; the best final eval loss is reported, 'diverged' when every lr's run turned
non-finite. One seed: differences smaller than the seed spread of `experiments/dslm_depth.py` (sd
0.006–0.11 nats at 4–16 layers) are not resolved.

Writes OUT/results.json and OUT/summary.md.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import schemes  # noqa: E402
from experiments import population  # noqa: E402

_OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
_STEPS = flags.DEFINE_integer('steps', 200, 'Training steps of every run.')
_DEPTH = flags.DEFINE_integer('depth', 32, 'Layers.')
_WIDTH = flags.DEFINE_integer('width', 32, 'Width.')
_ONLY = flags.DEFINE_list('only', None, 'Arms to run (scheme or scheme_block); default: all.')

LRS = (1e-3, 3e-3, 1e-2)


def arms() -> list[tuple[str, str]]:
  out = [('vanilla', 'preln'), ('vanilla', 'postln')]
  return out + [(t['name'], t['blocks'][0]) for t in schemes.table() if t['name'] != 'vanilla']


def arm_config(scheme: str, block: str, depth: int, width: int, steps: int):
  # The untied head: Catformer's head reads its wider concatenated stream.
  return population.gpt_config(scheme, block, depth, width, steps, tie_embeddings=False)


def main(argv):
  del argv
  out = _OUT.value
  path, done = population.load_results(out, 'arms')  # Resumes after the last finished arm.
  for scheme, block in arms():
    name = f'{scheme}_{block}'
    if (_ONLY.value and scheme not in _ONLY.value and name not in _ONLY.value) or any(
      a['arm'] == name for a in done['arms']
    ):
      continue
    print(f'{name}: lrs {LRS}', flush=True)
    config = arm_config(scheme, block, _DEPTH.value, _WIDTH.value, _STEPS.value)
    result = population.train(config, population.grid(LRS, [0]))
    done['arms'].append(
      {
        'arm': name,
        'seconds': result['seconds'],
        'runs': [{'lr': m['lr'], 'diverged': m['diverged'], 'final': m['final']} for m in result['members']],
      }
    )
    with open(path, 'w') as f:
      json.dump(done, f)
  lines = [
    f'GPT {_DEPTH.value} × {_WIDTH.value}, {_STEPS.value} steps, seed 0; final eval loss (nats/byte) '
    f'per peak lr',
    '',
    '| method (block) | ' + ' | '.join(f'lr {lr:g}' for lr in LRS) + ' | best |',
    '|---|' + '---|' * (len(LRS) + 1),
  ]
  for a in sorted(
    done['arms'],
    key=lambda a: min(
      (r['final']['eval/loss'] for r in a['runs'] if not r['diverged']), default=float('inf')
    ),
  ):
    cells = ['diverged' if r['diverged'] else f'{r["final"]["eval/loss"]:.3f}' for r in a['runs']]
    finite = [r['final']['eval/loss'] for r in a['runs'] if not r['diverged']]
    lines.append(
      f'| {a["arm"]} | ' + ' | '.join(cells) + f' | {min(finite):.3f} |'
      if finite
      else f'| {a["arm"]} | ' + ' | '.join(cells) + ' | diverged |'
    )
  with open(os.path.join(out, 'summary.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


if __name__ == '__main__':
  app.run(main)
