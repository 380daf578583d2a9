"""Host side of the instrumentation: turns a step's moments into (step, layer, site, statistic, value)
records, de-duplicated, and writes `workdir/moments.jsonl` and TensorBoard.

Each record is one JSON line {"step", "layer", "site", "stat", "value"}. Layer −1 (`NO_LAYER`) holds
the embedding site and whole-stack weight statistics; weight records have site 'weight/<type>'.
Each step's records also go to TensorBoard as histograms and images (`summaries`), and to the stability
monitor (`monitor.Monitor`) when one is given. `add` keeps the device arrays; `flush` fetches and writes
them, so an instrumented step never waits for the host: the training loop flushes the moments of
earlier steps while the current one runs.
`receive` (one probe site's statistics) and `receive_table` (a step's whole table) are the
`jax.debug.callback` targets of `instrument.delivery='callback'`: they keep what arrives (from XLA's
host-callback thread, in any order) as arrays until the next `flush`, which makes the records: a callback
runs while its step waits for it, so it does no more than copy. `flush` drops any record already seen
among the two newest steps' (`SEEN_STEPS`): what it remembers for that stays the same size however long a
run is.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import threading
from typing import Any, Callable, Iterable

import jax
import numpy as np

from dsjax.instrument import stats as stats_lib
from dsjax.instrument import summaries
from dsjax.instrument.probe import ACTIVATION_STATS, EMBEDDING_SITE, LAYER_SITES, SITES, Moments

Key = tuple[int, int, str, str]  # (step, layer, site, statistic)

NO_LAYER = -1
MOMENTS_FILE = 'moments.jsonl'
# The steps whose keys `flush` remembers to drop a record it has already seen: the newest step and the one
# before it. A second copy (a callback in a layer that remat recomputes sends its record again) comes from
# the same step as the first, but callbacks arrive while later steps are dispatched, so a step's copies may
# straddle a flush: one step of margin. Remembering every step instead grew by ~0.9 MiB per instrumented
# step at 192 layers (benchmarks/README.md), without bound.
SEEN_STEPS = 2


def json_value(value: float) -> float | None:
  """JSON has no NaN/Inf: a non-finite statistic is written as null (valid JSON for every reader)."""
  value = float(value)
  return value if np.isfinite(value) else None


@functools.cache
def _json_string(text: str) -> str:
  return json.dumps(text)


def jsonl_line(record: dict[str, Any]) -> str:
  """`json.dumps({**record, 'value': json_value(record['value'])}) + '\\n'`, byte for byte, for a record of
  int step and layer, str site and stat and float value, without the encoder's per-call cost: at 192
  layers a step has ~6,800 records, and json.dumps of each took ~40% of the host's writing."""
  value = record['value']
  value_json = float.__repr__(value) if math.isfinite(value) else 'null'
  return (
    f'{{"step": {record["step"]}, "layer": {record["layer"]}, "site": {_json_string(record["site"])}, '
    f'"stat": {_json_string(record["stat"])}, "value": {value_json}}}\n'
  )


@functools.cache
def _tensorboard_tag(site: str, stat: str, layer: int) -> str:
  return f'moments/{site}/{stat}/{"all" if layer == NO_LAYER else f"layer_{layer:03d}"}'


def start_host_copy(tree: Any) -> None:
  """Starts copying every device array of `tree` to the host, without waiting for it.

  Called right after a step is dispatched, the copy is queued behind that step and ahead of the next one.
  A `jax.device_get` of the tree made after the next step is dispatched (as the train loop makes it, to
  overlap the host's work with the device's) then waits for this step only. A copy first asked for at
  that `device_get` may wait for the next step too, where the runtime orders it behind the kernels
  already queued; then the device idles while the host works."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.copy_to_host_async()


def first_nonfinite(moments: Moments) -> tuple[str, str, str] | None:
  """Where a non-finite value first appears, as (layer, site, statistic): the first NaN/Inf forward
  statistic in forward order (the embedding, then each layer's sites), else the first NaN/Inf gradient
  statistic in backward order (the last layer's last site first); None if all are finite."""
  site_order = {site: i for i, site in enumerate(SITES)}
  bad = [
    key
    for key, value in moments_to_records(0, moments)
    if not key[2].startswith('weight/') and not np.isfinite(value)
  ]
  forward = [k for k in bad if k[3] in stats_lib.FORWARD_STATS]
  order = lambda k: (k[1], site_order.get(k[2], len(site_order)))
  if forward:
    key = min(forward, key=order)
  elif bad:
    key = max(bad, key=order)
  else:
    return None
  _, layer, site, stat = key
  return ('embedding' if layer == NO_LAYER else str(layer)), site, stat


def site_records(step: int, layer: int, site_index: int, values: np.ndarray) -> list[tuple[Key, float]]:
  """The records of one probe site's statistics (in ACTIVATION_STATS order), as `receive` gets them; the
  embedding site has layer −1 = NO_LAYER."""
  key = (step, layer, SITES[site_index])
  return [(key + (name,), float(value)) for name, value in zip(ACTIVATION_STATS, values)]


def moments_to_records(step: int, moments: Moments) -> Iterable[tuple[Key, float]]:
  """The (key, value) records of one step's moments (host numpy arrays, see `probe.Moments`)."""
  if 'activations' in moments:  # Absent with delivery='callback': those arrive through `receive`.
    table = np.asarray(moments['activations'], np.float64)
    for k, stat in enumerate(ACTIVATION_STATS):
      yield (step, NO_LAYER, EMBEDDING_SITE, stat), table[0, 0, k]
      for s, site in enumerate(LAYER_SITES, start=1):
        for n in range(table.shape[0] - 1):
          yield (step, n, site, stat), table[n + 1, s, k]
  for kind, kind_stats in moments.get('weights', {}).items():
    for stat, value in kind_stats.items():
      value = np.asarray(value, np.float64)
      if value.ndim:  # per layer
        for n, v in enumerate(value):
          yield (step, n, f'weight/{kind}', stat), v
      else:
        yield (step, NO_LAYER, f'weight/{kind}', stat), value


class Collector:
  """De-duplicating sink of per-step moments; writes JSONL and TensorBoard when given a workdir.

  Records also stay in memory (`records`) unless `keep_records=False`. With `enabled=False` (non-chief
  processes) everything is a no-op. `monitor` (a `monitor.Monitor`) sees every new record, on the host,
  as it is flushed; `close` closes it.
  """

  def __init__(
    self,
    workdir: str | None = None,
    *,
    enabled: bool = True,
    tensorboard: bool = True,
    keep_records: bool = True,
    monitor=None,
  ):
    self.enabled = enabled
    self.keep_records = keep_records
    self.records: list[dict[str, Any]] = []
    self.monitor = monitor
    # Records by step until the step is complete (a later step's arrived, or close): then its histograms
    # and images are written (with per-site callbacks a step can arrive over several flushes).
    self._summary_pending: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    self.num_duplicates = 0
    self._seen: dict[int, set[Key]] = collections.defaultdict(set)  # step -> its keys seen
    self._pending: list[tuple[int, Moments]] = []
    # What the callbacks delivered since the last flush, each with the function that makes its records.
    self._received: list[Callable[[], Iterable[tuple[Key, float]]]] = []
    self._lock = threading.Lock()
    self._jsonl = self._tensorboard = None
    if workdir is not None and enabled:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, MOMENTS_FILE), 'a')
      if tensorboard:
        # Event files without TensorFlow. A FileWriter, not a SummaryWriter: the records of one step go
        # into one event (`_write`) rather than one event per scalar, each of which passes a
        # multiprocessing queue (~0.4 ms: ~0.2 s per step for GPT-2-small's ~470 records).
        from tensorboardX import FileWriter

        self._tensorboard = FileWriter(os.path.join(workdir, 'tensorboard'))

  def add(self, step: int, moments: Moments):
    """Queues the moments of loop step `step` (device arrays are fine: their copy to the host starts
    here, `start_host_copy`, and `flush` fetches them)."""
    if self.enabled:
      start_host_copy(moments)
      self._pending.append((int(step), moments))

  def receive(self, step, layer, site_index, values):
    """`jax.debug.callback` target: one site's statistics, in ACTIVATION_STATS order."""
    if self.enabled:
      self._keep(functools.partial(site_records, int(step), int(layer), int(site_index), np.array(values)))

  def receive_table(self, step, table):
    """`jax.debug.callback` target: the (depth + 1, sites, statistics) table of loop step `step`."""
    if self.enabled:
      self._keep(functools.partial(moments_to_records, int(step), {'activations': np.array(table)}))

  def _keep(self, make_records: Callable[[], Iterable[tuple[Key, float]]]):
    """Keeps what a callback delivered (on XLA's host-callback thread; a copy, since XLA may reuse the
    buffer) for the next `flush`, which makes its records: a callback's step waits for it to return."""
    with self._lock:
      self._received.append(make_records)

  def flush(self, before_step: int | None = None) -> list[dict[str, Any]]:
    """Fetches and writes the queued moments of steps < `before_step` (all if None), and everything
    `receive` got so far; returns the new records."""
    ready, waiting = [], []
    for step, moments in self._pending:
      (ready if before_step is None or step < before_step else waiting).append((step, moments))
    self._pending = waiting
    with self._lock:
      received, self._received = self._received, []
    new = []
    for key, value in [r for make_records in received for r in make_records()] + [
      r for step, moments in ready for r in moments_to_records(step, jax.device_get(moments))
    ]:
      seen = self._seen[key[0]]
      if key in seen:
        self.num_duplicates += 1
        continue
      seen.add(key)
      new.append({'step': key[0], 'layer': key[1], 'site': key[2], 'stat': key[3], 'value': float(value)})
    self._forget_old_steps()
    self._write(new)
    if self.monitor is not None:
      self.monitor.observe(new)
    return new

  def _forget_old_steps(self):
    for step in sorted(self._seen)[:-SEEN_STEPS]:
      del self._seen[step]

  def _write(self, new: list[dict[str, Any]]):
    if self.keep_records:
      self.records.extend(new)
    if self._jsonl is not None and new:
      self._jsonl.writelines(jsonl_line(r) for r in new)
      self._jsonl.flush()
    if self._tensorboard is not None and new:
      from tensorboardX.proto.summary_pb2 import Summary

      # One Summary per step, filled in place (`value.add()`: about half the time of building each
      # Summary.Value and passing the list, at ~6,800 records a step at 192 layers).
      by_step = collections.defaultdict(Summary)
      for r in new:
        if not math.isfinite(r['value']):
          continue
        value = by_step[r['step']].value.add()
        value.tag = _tensorboard_tag(r['site'], r['stat'], r['layer'])
        value.simple_value = r['value']
      for r in new:
        self._summary_pending[r['step']].append(r)
      self._write_step_summaries(complete_before=max(r['step'] for r in new))
      for step, summary in sorted(by_step.items()):
        self._tensorboard.add_summary(summary, step)
      self._tensorboard.flush()

  def _write_step_summaries(self, complete_before: int | None):
    """Histograms and images of the pending steps < `complete_before` (all if None)."""
    from tensorboardX.proto.summary_pb2 import Summary

    for step in sorted(self._summary_pending):
      if complete_before is None or step < complete_before:
        values = summaries.step_summary(self._summary_pending.pop(step))
        if values:
          self._tensorboard.add_summary(Summary(value=values), step)

  def close(self):
    jax.effects_barrier()  # Callbacks still in flight (delivery='callback') arrive before the flush.
    self.flush()
    if self.monitor is not None:
      self.monitor.close()
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._write_step_summaries(complete_before=None)
      self._tensorboard.close()


def read_jsonl(path: str) -> list[dict[str, Any]]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def table(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[int, list[float]]]:
  """{(site, stat): {layer: [value of each step, in step order]}} — e.g. to average over batches."""
  out: dict[tuple[str, str], dict[int, list[float]]] = collections.defaultdict(
    lambda: collections.defaultdict(list)
  )
  for r in sorted(records, key=lambda r: r['step']):
    out[(r['site'], r['stat'])][r['layer']].append(r['value'])
  return out
