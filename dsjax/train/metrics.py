"""Metric sinks (`workdir/metrics.jsonl`, one JSON object per logged step, and TensorBoard) and the
progress clock of the training loop."""

from __future__ import annotations

import json
import os
import time

from tensorboardX import SummaryWriter  # Writes event files without TensorFlow.

from dsjax.instrument import json_value  # NaN/Inf as null: JSON has neither.

METRICS_FILE = 'metrics.jsonl'
PROGRESS_SECONDS = 10.0  # A progress line at least this often, whatever `log_every` is.


class MetricWriter:
  def __init__(self, workdir: str, *, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    self.jsonl = open(os.path.join(workdir, METRICS_FILE), 'a')
    self.tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict[str, float]):
    if not self.enabled:
      return
    row = {'step': int(step), **{k: json_value(v) for k, v in metrics.items()}}
    self.jsonl.write(json.dumps(row, allow_nan=False) + '\n')
    self.jsonl.flush()
    for name, value in row.items():
      if name != 'step' and value is not None:
        self.tensorboard.add_scalar(name, value, int(step))

  def close(self):
    if self.enabled:
      self.jsonl.close()
      self.tensorboard.close()


class Progress:
  """Training speed between two progress lines: steps over the wall time between metric fetches, less
  the time spent evaluating and checkpointing (`exclude`), so steps/s and the ETA describe training."""

  def __init__(self, step: int, total_steps: int):
    self.total_steps = total_steps
    self.last_step, self.last_time, self.excluded = step, time.perf_counter(), 0.0

  def exclude(self, seconds: float):
    self.excluded += seconds

  def due(self, step: int, log_every: int) -> bool:
    return (
      step % log_every == 0
      or step == self.total_steps
      or time.perf_counter() - self.last_time >= PROGRESS_SECONDS
    )

  def mark(self, step: int) -> tuple[float, float]:
    """(steps/s, ETA in seconds) since the previous mark; call it after the step's metrics arrived."""
    now = time.perf_counter()
    seconds = max(now - self.last_time - self.excluded, 1e-9)
    steps_per_sec = (step - self.last_step) / seconds
    self.last_step, self.last_time, self.excluded = step, now, 0.0
    return steps_per_sec, (self.total_steps - step) / max(steps_per_sec, 1e-9)
