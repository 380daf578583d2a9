"""Metric sinks: `workdir/metrics.jsonl` (one JSON object per logged step) and TensorBoard."""

from __future__ import annotations

import json
import os


class MetricWriter:

  def __init__(self, workdir: str, *, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    from tensorboardX import SummaryWriter  # Writes event files without TensorFlow.
    self.jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    self.tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict[str, float]):
    if not self.enabled:
      return
    self.jsonl.write(json.dumps({'step': int(step), **{k: float(v) for k, v in metrics.items()}}) + '\n')
    self.jsonl.flush()
    for name, value in metrics.items():
      self.tensorboard.add_scalar(name, float(value), int(step))

  def close(self):
    if self.enabled:
      self.jsonl.close()
      self.tensorboard.close()
