"""Host side of the instrumentation: receives statistics from `jax.debug.callback`s, de-duplicates them,
and writes `workdir/moments.jsonl` and TensorBoard.

`jax.debug.callback` promises nothing about how often a callback runs: JAX may drop, duplicate or
reorder it under transformations. What we measured in jax 0.10.2 (tests/test_instrument.py checks it):

  * under `jax.checkpoint` (remat) inside the layer scan, every forward callback of a layer runs twice,
    once in the forward pass and once when the backward pass recomputes the layer (same values);
  * on a multi-device mesh with automatic (GSPMD) sharding the callback is lowered with a MAXIMAL
    sharding: it runs once, on device 0, with the logical (all-gathered) operands — our operands are
    scalars, so the gather is free;
  * callbacks arrive in no particular order and from XLA's threads.

So every record is tagged with (step, layer, site, statistic) and the collector keeps the first arrival
of each tag. Each record is one JSON line {"step", "layer", "site", "stat", "value"}.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from typing import Any, Iterable

import jax
import numpy as np

Key = tuple[int, int, str, str]  # (step, layer, site, statistic)

# Layer index of records that are not per layer: the embedding output and whole-stack weight statistics.
NO_LAYER = -1


class Collector:
  """Thread-safe, de-duplicating sink for (step, layer, site, statistic, value) records.

  `flush()` waits for all dispatched computations' callbacks (`jax.effects_barrier`) and writes what
  arrived; records stay available in memory in `records` unless `keep_records=False`.
  """

  def __init__(self, workdir: str | None = None, *, enabled: bool = True, tensorboard: bool = True,
               keep_records: bool = True):
    self.enabled = enabled
    self.keep_records = keep_records
    self.records: list[dict[str, Any]] = []
    self.num_received = 0
    self.num_duplicates = 0
    self._lock = threading.Lock()
    self._seen: set[Key] = set()          # keys of steps not yet flushed
    self._flushed_steps: set[int] = set()  # late duplicates of these are dropped
    self._pending: list[dict[str, Any]] = []
    self._jsonl = self._tensorboard = None
    if workdir is not None and enabled:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, 'moments.jsonl'), 'a')
      if tensorboard:
        from tensorboardX import SummaryWriter  # Event files without TensorFlow.
        self._tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  # -- Called from jax.debug.callback (XLA threads). ------------------------------------------------

  def receive(self, step, layer, values, *, keys: tuple[tuple[str, str], ...]):
    """Records values[i] as statistic keys[i] = (site, stat) of (step, layer).

    Statistics travel packed in one float vector per callback (a callback's fixed cost grows with its
    number of operands). With `layer` an array of layers, values[i] has one entry per layer.
    """
    if not self.enabled:
      return
    step = int(step)
    layers = np.asarray(layer).reshape(-1)
    values = np.asarray(values, np.float64).reshape(len(keys), len(layers))
    with self._lock:
      for (site, stat), row in zip(keys, values):
        for layer_n, value in zip(layers, row):
          self._add((step, int(layer_n), site, stat), float(value))

  def _add(self, key: Key, value: float):
    self.num_received += 1
    if key in self._seen or key[0] in self._flushed_steps:
      self.num_duplicates += 1
      return
    self._seen.add(key)
    self._pending.append({'step': key[0], 'layer': key[1], 'site': key[2], 'stat': key[3],
                          'value': value})

  # -- Called by the training loop / CLI (main thread). ---------------------------------------------

  def flush(self) -> list[dict[str, Any]]:
    """Waits for outstanding callbacks, writes the new records, returns them (sorted)."""
    jax.effects_barrier()
    with self._lock:
      new = sorted(self._pending, key=lambda r: (r['step'], r['site'], r['layer'], r['stat']))
      self._pending = []
      steps = {r['step'] for r in new}
      self._flushed_steps |= steps
      self._seen = {k for k in self._seen if k[0] not in steps}
    if self.keep_records:
      self.records.extend(new)
    if self._jsonl is not None:
      self._jsonl.writelines(json.dumps(r) + '\n' for r in new)
      self._jsonl.flush()
    if self._tensorboard is not None:
      for r in new:
        where = 'all' if r['layer'] == NO_LAYER else f'layer_{r["layer"]:03d}'
        self._tensorboard.add_scalar(f'moments/{r["site"]}/{r["stat"]}/{where}', r['value'], r['step'])
      self._tensorboard.flush()
    return new

  def close(self):
    self.flush()
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def table(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[int, list[float]]]:
  """{(site, stat): {layer: [value of each step, in step order]}} — e.g. to average over batches."""
  out: dict[tuple[str, str], dict[int, list[float]]] = collections.defaultdict(
      lambda: collections.defaultdict(list))
  for r in sorted(records, key=lambda r: r['step']):
    out[(r['site'], r['stat'])][r['layer']].append(r['value'])
  return out
