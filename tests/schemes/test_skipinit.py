"""SkipInit (De & Smith 2020, `dsjax.schemes.skipinit`): no norm, x + α·f(x) with a learnable α = 0 at
each add: the identity at initialisation.

At two depths: the plan, the built model (learnable scalars per layer, Xavier weights, the trunk the
identity), the configurable initial α, the config checks and a 3-step training run of GPT and ViT.
"""

import chex
import pytest
from flax import nnx

from tests.schemes.common import (
  DEPTHS,
  assert_rejected,
  check_initial_alpha_is_configurable,
  check_three_training_steps,
  check_zero_branch_identity,
  method_config,
  registered,
)


def test_registered_with_its_blocks():
  assert registered('skipinit')['blocks'] == ('nonorm',)


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('block', 'postln', 'model.block'),
    ('final_norm', True, 'model.final_norm'),
  ],
)
def test_bad_configs_fail_in_validate_in_one_line(key, value, message):
  assert_rejected(method_config('skipinit'), key, value, message)


@pytest.mark.parametrize('depth', DEPTHS)
def test_skipinit_is_the_identity_at_init(depth):
  plan, block = check_zero_branch_identity('skipinit', depth)
  assert not plan.branch.shared
  assert isinstance(block.branch_ffn, nnx.Param)  # one α per add
  chex.assert_shape(block.branch_ffn[...], (depth,))


def test_skipinit_initial_alpha_is_configurable():
  check_initial_alpha_is_configurable('skipinit')


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(name):
  check_three_training_steps('skipinit', name, learnable_branch=True)
