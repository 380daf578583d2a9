"""experiments/fp8_cast.py: its arms are the sweeps' arms, and the added losses become intervals."""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from experiments import fp8_cast  # noqa: E402


def test_the_arms_are_the_sweeps_arms_on_its_report_split():
  splits, seeds, records = fp8_cast.sweep_arms(fp8_cast.SHAPES['4x64'])
  assert seeds == [0, 1, 2] and set(records) == set(fp8_cast.ARMS)
  vanilla = fp8_cast.arm_config('4x64', records['vanilla_postln'], splits)
  dslm = fp8_cast.arm_config('4x64', records['dslm_postln'], splits)
  assert (vanilla.model.scheme, dslm.model.scheme) == ('vanilla', 'dslm')
  assert (dslm.model.depth, dslm.model.width, dslm.model.block) == (4, 64, 'postln')
  assert (dslm.data.train_split, dslm.data.eval_split) == (splits['train'], splits['report'])


def test_added_losses_and_their_difference():
  def arm(f32, cast):
    return {'loss': {'float32': f32, 'float8_e4m3fn': cast, 'float8_e5m2': [np.nan] * len(f32)}}

  arms = {
    'vanilla_postln': arm([2.0, 2.1, 2.2], [2.3, 2.41, 2.5]),
    'dslm_postln': arm([2.0, 2.0, 2.0], [2.01, 2.0, 2.02]),
  }
  comparison = fp8_cast.compare(arms)
  e4m3 = comparison['float8_e4m3fn']
  np.testing.assert_allclose(e4m3['vanilla_postln']['values'], [0.3, 0.31, 0.3], atol=1e-12)
  np.testing.assert_allclose(e4m3['dslm_minus_vanilla']['difference'], 0.01 - 0.91 / 3, atol=1e-12)
  assert e4m3['dslm_minus_vanilla']['high'] < 0
  assert comparison['float8_e5m2']['dslm_minus_vanilla'] is None  # a non-finite loss: no interval


@pytest.mark.parametrize('fmt,zero,subnormal', [('float8_e4m3fn', 0.25, 0.25), ('float8_e5m2', 0.0, 0.25)])
def test_weight_range_counts_what_the_format_loses(fmt, zero, subnormal):
  """Entries 1e-5 (rounded to 0 by e4m3, whose smallest subnormal is 2^-9; an e5m2 subnormal), 0.01 (an
  e4m3 subnormal, a normal e5m2 number), 0.5 and 1 (normal in both); a vector (a gain: ndim 2 with the
  member axis) is not a weight matrix, nor a scanned layers' (members, layers, width) stack of gains."""
  kernel = jnp.asarray([[[1e-5, 0.01], [0.5, 1.0]]])
  state = {'params': {'ffn1': {'kernel': kernel, 'bias': jnp.zeros((1, 3, 2))}, 'scale': jnp.zeros((1, 2))}}
  assert fp8_cast.weight_range(state, fmt) == {'to_zero': zero, 'subnormal': subnormal}
