"""ReZero (Bachlechner et al. 2021, `dsjax.schemes.rezero`): no norm, x + α·f(x) with one learnable
α = 0 per layer shared by both adds: the identity at initialisation.

At two depths: the plan (α = 0 at init), the built model (one learnable scalar per layer, Xavier weights,
the trunk the identity), the configurable initial α, the config checks and a 3-step training run of GPT
and ViT.
"""

import pytest

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
  assert registered('rezero')['blocks'] == ('nonorm',)


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('block', 'preln', 'model.block'),
    ('rezero.init', float('nan'), 'model.rezero.init'),
  ],
)
def test_bad_configs_fail_in_validate_in_one_line(key, value, message):
  assert_rejected(method_config('rezero'), key, value, message)


@pytest.mark.parametrize('depth', DEPTHS)
def test_rezero_is_the_identity_at_init(depth):
  plan, block = check_zero_branch_identity('rezero', depth)
  assert plan.branch.shared
  assert block.branch_ffn is None  # the attention add's α, shared by both adds


def test_rezero_initial_alpha_is_configurable():
  check_initial_alpha_is_configurable('rezero')


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(name):
  check_three_training_steps('rezero', name, learnable_branch=True)
