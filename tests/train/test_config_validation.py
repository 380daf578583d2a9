"""Each section of a run's config is validated once per run, into the value the run passes down."""

from __future__ import annotations

import collections
import functools
import sys

import jax
import pytest

from dsjax import instrument, models, schemes
from dsjax.data import config as data_config
from dsjax.train import config as config_lib
from dsjax.train import loop, optimizers
from dsjax.train import sharding as sharding_lib
from tests.helpers import tiny_config

# The function that validates each section (and the run keys).
VALIDATORS = {
  'run': config_lib.validate_config,
  'model': models.validate_model,
  'model.scheme': schemes.validate,
  'optimizer': optimizers.validate_optimizer_config,
  'data': data_config.validate_data_config,
  'instrument': instrument.validate_instrument_config,
  'instrument.monitor': instrument.validate_monitor_config,
  'mesh': sharding_lib.resolve_mesh_shape,
}


def _count_calls(monkeypatch, functions: dict) -> collections.Counter:
  """Replaces each function wherever a dsjax module holds it (its own module and every module that
  imported it by name) by one that counts its calls under its key."""
  counts = collections.Counter()

  def counting(key, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
      counts[key] += 1
      return fn(*args, **kwargs)

    return counted

  for key, fn in functions.items():
    wrapper = counting(key, fn)
    for name, module in list(sys.modules.items()):
      if not name.startswith('dsjax'):
        continue
      for attr, value in list(vars(module).items()):
        if value is fn:
          monkeypatch.setattr(module, attr, wrapper)
  return counts


# ViT slow (~11 s): the once-per-section count goes through the same code as GPT's.
@pytest.mark.parametrize('model_name', ['gpt', pytest.param('vit', marks=pytest.mark.slow)])
def test_a_run_validates_each_config_section_once(tmp_path, monkeypatch, model_name):
  """Two steps, an evaluation after each (and the instrumented step): every section's validation
  runs exactly once."""
  config = tiny_config(model_name)
  config.total_steps, config.eval_every = 2, 1
  config.instrument.every = 1
  counts = _count_calls(monkeypatch, VALIDATORS)
  loop.train_and_evaluate(config, str(tmp_path / 'run'), devices=jax.devices()[:1])
  assert dict(counts) == {key: 1 for key in VALIDATORS}
