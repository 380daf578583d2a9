"""The experiments' helpers around the population trainer, which is `dsjax.train.population`
(`python -m dsjax.sweep` is the supported tool): the sweep-then-seeds protocol of the experiment scripts
beside it, the spread of a result, their resumable results file and their deep-narrow GPT config.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

from dsjax.train import config as config_lib
from dsjax.train.population import Member, grid, train  # noqa: F401 (the experiment scripts use them)


def sweep_then_seeds(
  config, lrs: Sequence[float], num_seeds: int, final_variants: dict[str, Callable[[Any], Any]] | None = None
) -> dict[str, Any]:
  """The sweep protocol of the experiments: every lr with seed 0, then the lr with the lowest final eval
  loss with seeds 1..num_seeds-1. Returns {'grid', 'best_lr', 'best_at_edge', 'sweep': members,
  'best_seeds': the best lr's members (seed 0 first), 'seconds'}; `final_variants` are evaluated on the
  seeds 1.. members."""
  t0 = time.time()
  sweep = train(config, grid(lrs, [0]))['members']
  losses = np.asarray([m['final']['eval/loss'] for m in sweep], np.float64)
  best = int(np.nanargmin(np.where(np.isfinite(losses), losses, np.nan)))
  seeds = (
    train(config, grid([lrs[best]], range(1, num_seeds)), final_variants=final_variants)['members']
    if num_seeds > 1
    else []
  )
  for r in sweep + seeds:
    r['eval'] = {str(k): v for k, v in r['eval'].items()}
  return {
    'grid': [float(x) for x in lrs],
    'best_lr': float(lrs[best]),
    'best_at_edge': best in (0, len(lrs) - 1),
    'sweep': sweep,
    'best_seeds': [sweep[best]] + seeds,
    'seconds': time.time() - t0,
  }


def spread(values: Sequence[float]) -> dict[str, Any]:
  """mean, sample sd, min, max and the values."""
  v = np.asarray(values, np.float64)
  return {
    'mean': float(v.mean()),
    'sd': float(v.std(ddof=1)) if len(v) > 1 else 0.0,
    'min': float(v.min()),
    'max': float(v.max()),
    'values': v.tolist(),
  }


def load_results(out: str, key: str) -> tuple[str, dict[str, list]]:
  """OUT/results.json (created with an empty list under `key` if missing) and its path: an experiment
  appends each finished cell and rewrites the file, so a rerun resumes after the last finished cell."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, 'results.json')
  if not os.path.exists(path):
    return path, {key: []}
  with open(path) as f:
    return path, json.load(f)


def gpt_config(scheme: str, block: str, depth: int, width: int, steps: int, tie_embeddings: bool = True):
  """The deep-narrow GPT of these experiments (byte-level, seq 64, batch 16, dropout 0.1, AdamW wd 0.01,
  clip 1, warmup over the first tenth, cosine to 0) with `model.scheme` = scheme in `block`."""
  c = config_lib.base_config('gpt', optimizer_name='adamw')
  c.total_steps = c.eval_every = c.checkpoint_every = steps
  c.data.seq_len, c.batch_size, c.eval_batch_size = 64, 16, 256
  c.model.depth, c.model.width, c.model.num_heads = depth, width, max(1, width // 16)
  c.model.block, c.model.scheme = block, scheme
  c.model.dropout = 0.1
  c.model.tie_embeddings = tie_embeddings
  c.optimizer.weight_decay, c.optimizer.clip_norm = 0.01, 1.0
  c.optimizer.warmup_steps, c.optimizer.min_lr_ratio = steps // 10, 0.0
  return c
