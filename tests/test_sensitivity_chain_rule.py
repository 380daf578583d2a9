"""experiments/sensitivity_chain_rule.py: layer n's perturbation pushed block by block with plain
`jax.jvp` reaches the trunk output with the energy `dsjax.sensitivity` measures in one JVP."""

import jax
import numpy as np
import pytest

from dsjax import sensitivity
from experiments import sensitivity_chain_rule
from tests.helpers import TEXT_INFO, tiny_config


# Post-LN is slow (17 s): Pre-LN runs the same push through the chain rule by default.
@pytest.mark.parametrize('block', ['preln', pytest.param('postln', marks=pytest.mark.slow)])
def test_pushed_perturbation_matches_the_measurement(block):
  config = tiny_config('gpt', depth=4, block=block)
  measurement = sensitivity.Measurement(config, TEXT_INFO)
  inputs = jax.random.randint(jax.random.key(1), (config.batch_size, config.data.seq_len), 0, 256)
  chain = sensitivity_chain_rule.BlockByBlock(measurement)
  rows = sensitivity_chain_rule.measure_draw(measurement, chain, jax.random.key(0), inputs, [0, 1, 2])
  for row in rows:
    assert row['pushed_over_measured'] == pytest.approx(1.0, abs=1e-4), row
    assert np.isfinite(row['own_over_carried']) and row['own_over_carried'] > 0, row
