"""Small shared test utilities: tiny configs and stand-in dataset descriptions."""

from __future__ import annotations

import pathlib
import types

from dsjax.train.config import base_config

# The repository's root: the working directory of the tests that run dsjax's commands.
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

IMAGE_INFO = types.SimpleNamespace(kind='image', image_shape=(8, 8, 1), num_classes=10)
TEXT_INFO = types.SimpleNamespace(kind='text', vocab_size=256)


def tiny_config(model_name: str = 'gpt', **model_overrides):
  c = base_config(model_name, optimizer_name='adamw')
  c.total_steps, c.batch_size, c.eval_batch_size = 4, 8, 16
  c.eval_every = c.checkpoint_every = c.log_every = 2
  c.optimizer.warmup_steps = 1
  c.data.seq_len = 16
  c.model.depth, c.model.width, c.model.num_heads = 2, 32, 4
  for k, v in model_overrides.items():
    c.model[k] = v
  return c
