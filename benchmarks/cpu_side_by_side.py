r"""dsjax's and PyTorch eager's train step of the default GPT, timed in pairs in one process on the CPU.

  python benchmarks/cpu_side_by_side.py [--pairs=40] [--pause=0.05] [--json=FILE]

Needs PyTorch beside dsjax (`pip install torch`; not a dependency of dsjax). On a shared or virtual
machine the speed drifts by tens of percent within minutes, so two benchmarks run one after the other
compare two different machines. Here both steps are built once — dsjax's as `python -m dsjax.bench
--config=configs/gpt_preln.py --instrument=off` builds and compiles it, PyTorch's as
`benchmarks/torch_gpt.py` does — and then alternate: each pair times one step of each, in alternating
order, with `--pause` seconds of idle between steps (so that neither runtime's worker threads, which
spin for a while after their work, take cores from the other's step). Each step is waited for; the first
`WARMUP_PAIRS` pairs are not timed. Reported: each implementation's median and min–max step time, and
the median and interquartile range over pairs of the ratio dsjax/PyTorch, the pairs' drift cancelling.

The process keeps freed memory as every dsjax command does (`dsjax.train.host_memory`), for both.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

from dsjax.train import host_memory

host_memory.keep_freed_memory()  # before JAX or PyTorch start their threads

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dsjax import bench  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks'))
import paired  # noqa: E402

torch = paired.require_torch(__file__)
import torch_gpt  # noqa: E402

WARMUP_PAIRS = 3


def gpt_preln_config():
  config = paired.load_config(ROOT / 'configs' / 'gpt_preln.py')
  peer = {
    'model.depth': torch_gpt.DEPTH,
    'model.width': torch_gpt.WIDTH,
    'model.num_heads': torch_gpt.HEADS,
    'data.seq_len': torch_gpt.SEQ_LEN,
    'batch_size': torch_gpt.BATCH,
  }
  ours = {
    'model.depth': config.model.depth,
    'model.width': config.model.width,
    'model.num_heads': config.model.num_heads,
    'data.seq_len': config.data.seq_len,
    'batch_size': config.batch_size,
  }
  if ours != peer:
    raise SystemExit(f'configs/gpt_preln.py ({ours}) no longer matches benchmarks/torch_gpt.py ({peer})')
  return config


def main():
  args = paired.parse_timing_args(paired.timing_parser(__doc__.split('\n\n')[0], 'pairs', 'pairs'), 'pairs')
  steps = {
    'dsjax': bench.step_runner(bench.prepare(gpt_preln_config(), ['off'], 'random')),
    'pytorch': torch_gpt.make_train_step(),
  }
  seconds = paired.alternate(steps, args.pairs, WARMUP_PAIRS, args.pause)
  times = {name: [1e3 * t for t in ts] for name, ts in seconds.items()}
  ratios = np.array(times['dsjax']) / np.array(times['pytorch'])
  results = {
    'date': time.strftime('%Y-%m-%d'),
    'jax': jax.__version__,
    'torch': torch.__version__,
    'torch_threads': torch.get_num_threads(),
    'pairs': args.pairs,
    'pause_s': args.pause,
    'step_ms': times,
    'step_ms_median': {name: statistics.median(t) for name, t in times.items()},
    'ratio_median': float(np.median(ratios)),
    'ratio_quartiles': [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))],
    'pairs_dsjax_faster': int((ratios < 1).sum()),
  }
  print(
    f'GPT {torch_gpt.DEPTH}x{torch_gpt.WIDTH}, seq {torch_gpt.SEQ_LEN}, batch {torch_gpt.BATCH}, '
    f'{args.pairs} pairs; jax {jax.__version__}, PyTorch {torch.__version__} eager '
    f'({torch.get_num_threads()} threads), {results["date"]}'
  )
  for name, t in times.items():
    print(f'  {name:8s} {statistics.median(t):8.1f} ms/step median (min {min(t):.1f}, max {max(t):.1f})')
  print(
    f'  dsjax / PyTorch step time, per pair: median {results["ratio_median"]:.3f} (quartiles '
    f'{results["ratio_quartiles"][0]:.3f}–{results["ratio_quartiles"][1]:.3f}); dsjax faster in '
    f'{results["pairs_dsjax_faster"]} of {args.pairs} pairs'
  )
  paired.write_json(args.json, results)


if __name__ == '__main__':
  main()
