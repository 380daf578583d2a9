r"""DeepScaleLM at constant parameters (Kedia et al. 2024, arXiv:2403.09635, Table 4) and FP8 direct cast
(Table 12), at CPU scale.

  python experiments/dslm_depth.py --out=experiments/results/dslm_depth

Models: byte-level GPT on the embedded Python-documentation corpus at fixed depth·width² (N·d² = 16,384,
about 0.2M weights in the blocks): 4 × 64, 16 × 32, 64 × 16 (head dim 16), each as

  vanilla Pre-LN, vanilla Post-LN  (`model.scheme='vanilla'`: Xavier, λ = β = 1)
  DSLM Pre-LN, DSLM Post-LN        (`model.scheme='dslm'`, simple init, β² = 2/N, λ² = 1 − β²)

with everything else shared: dropout 0.1, tied embeddings, seq 64, batch 16, 300 steps (the same tokens),
AdamW (wd 0.01, clip 1, warmup over the first tenth, cosine to 0). DSLM's head scales the final hidden
state by 1/sqrt(σe²·d) (the reference code's choice, `configs/gpt_dslm_deep.py`).

Protocol per (model, depth): a sweep of 5 log-spaced peak learning rates with seed 0, then the best lr
with seeds 1 and 2 (`experiments/population.py`). A run 'diverged' when its loss or gradient turned
non-finite. Reported: final eval loss (nats/byte, validation split) mean ± sd over the 3 seeds at the best
lr, and the lr curve.

FP8 direct cast: the trained weights of seeds 1 and 2 at the best lr (every trainable parameter) are cast
to float8_e4m3fn and float8_e5m2 and back to float32, and evaluated again; the table gives the eval loss
change.

Writes OUT/results.json, OUT/summary.md, OUT/depth.png.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from experiments import population  # noqa: E402

_OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
_SHAPES = flags.DEFINE_list('shapes', ['4x64', '16x32', '64x16'], 'depth x width of each model.')
_MODELS = flags.DEFINE_list(
  'models', ['vanilla_preln', 'vanilla_postln', 'dslm_preln', 'dslm_postln'], 'scheme_block of each model.'
)
_STEPS = flags.DEFINE_integer('steps', 300, 'Training steps of every run.')
_SEEDS = flags.DEFINE_integer('seeds', 3, "Seeds at the best learning rate (seed 0 is the sweep's).")

LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
FP8 = {'fp8_e4m3': jnp.float8_e4m3fn, 'fp8_e5m2': jnp.float8_e5m2}


def cast_through(dtype):
  return lambda params: jax.tree.map(lambda p: p.astype(dtype).astype(p.dtype), params)


def model_config(model: str, depth: int, width: int, steps: int):
  scheme, block = model.split('_')
  c = population.gpt_config(scheme, block, depth, width, steps)
  if scheme == 'dslm':
    c.model.dslm.init = 'simple'
    c.model.dslm.output_scale = 'sqrt_embed_var_d'  # The reference code's, with the tied head.
  return c


def summary_rows(cells: list[dict]) -> list[str]:
  lines = [
    '| model | depth × width | best lr | eval loss mean ± sd (min–max), 3 seeds | lr curve (seed 0; '
    'div = diverged) | FP8 e4m3 Δloss | FP8 e5m2 Δloss | minutes |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for c in cells:
    loss = population.spread([m['final']['eval/loss'] for m in c['best_seeds']])
    curve = ' '.join(
      f'{m["lr"]:g}:' + ('div' if m['diverged'] else f'{m["final"]["eval/loss"]:.3f}') for m in c['sweep']
    )
    fp8 = []
    for name in FP8:
      delta = [m[f'final/{name}']['eval/loss'] - m['final']['eval/loss'] for m in c['best_seeds'][1:]]
      fp8.append(' / '.join(f'{d:+.3f}' for d in delta) or '–')
    lines.append(
      f'| {c["model"]} | {c["depth"]} × {c["width"]} | {c["best_lr"]:g}'
      f'{" (edge)" if c["best_at_edge"] else ""} | {loss["mean"]:.4f} ± {loss["sd"]:.4f} '
      f'({loss["min"]:.4f}–{loss["max"]:.4f}) | {curve} | {fp8[0]} | {fp8[1]} | '
      f'{c["seconds"] / 60:.1f} |'
    )
  return lines


def plot(cells: list[dict], path: str):
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.5, 4.2), constrained_layout=True)
  for model in dict.fromkeys(c['model'] for c in cells):
    mine = sorted((c for c in cells if c['model'] == model), key=lambda c: c['depth'])
    stats = [population.spread([m['final']['eval/loss'] for m in c['best_seeds']]) for c in mine]
    ax.errorbar(
      [c['depth'] for c in mine],
      [s['mean'] for s in stats],
      yerr=[s['sd'] for s in stats],
      marker='o',
      capsize=3,
      label=model,
    )
  ax.set_xscale('log', base=2)
  ax.set_xlabel('depth N (width = 128 / sqrt(N), N·d² fixed)')
  ax.set_ylabel('final eval loss, best lr (nats/byte)')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  out = _OUT.value
  path, done = population.load_results(out, 'cells')  # Resumes after the last finished cell.
  for shape in _SHAPES.value:
    depth, width = (int(x) for x in shape.split('x'))
    for model in _MODELS.value:
      if any(c['model'] == model and c['depth'] == depth for c in done['cells']):
        continue
      print(f'{model} {depth} × {width}: sweep {LRS}', flush=True)
      cell = population.sweep_then_seeds(
        model_config(model, depth, width, _STEPS.value),
        LRS,
        _SEEDS.value,
        final_variants={k: cast_through(v) for k, v in FP8.items()},
      )
      done['cells'].append({'model': model, 'depth': depth, 'width': width, **cell})
      with open(path, 'w') as f:
        json.dump(done, f)
  lines = summary_rows(done['cells'])
  with open(os.path.join(out, 'summary.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))
  plot(done['cells'], os.path.join(out, 'depth.png'))
  print(
    f'total {sum(c["seconds"] for c in done["cells"]) / 60:.1f} min; wrote {out}/results.json, summary.md, '
    'depth.png'
  )


if __name__ == '__main__':
  app.run(main)
