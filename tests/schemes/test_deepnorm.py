"""DeepNorm (Wang et al. 2022, Table 1, `dsjax.schemes.deepnorm`): Post-LN, α = (2N)^{1/4} at both skips,
V, O and FFN × β = (8N)^{-1/4}.

The plan and the built model at two depths, the constants as config fields, the config checks and a
3-step training run of GPT and ViT. Expected values are written out here from the paper's formulas.
"""

import chex
import numpy as np
import pytest

from dsjax.models import layers
from tests.schemes.common import (
  DEPTHS,
  POSTLN_NORMS,
  assert_rejected,
  build,
  check_three_loop_steps,
  check_xavier_qk,
  dense_layers,
  init_plan,
  kernel_std,
  method_config,
  norms_present,
  registered,
  xavier_std,
)


def test_registered_with_its_blocks():
  assert registered('deepnorm')['blocks'] == ('postln',)


@pytest.mark.parametrize('name', ['gpt', 'vit'])
@pytest.mark.parametrize('depth', DEPTHS)
def test_deepnorm_plan(name, depth):
  d = 32
  config = method_config('deepnorm', name, depth=depth, width=d)
  plan = init_plan(config)
  alpha, beta = (2 * depth) ** 0.25, (8 * depth) ** -0.25
  for key in ('skip_attn', 'skip_ffn'):
    np.testing.assert_allclose(plan.layer[key], alpha, rtol=1e-6)
    assert plan.layer[key].shape == (depth,)
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_allclose(plan.layer[key], 1.0, rtol=1e-6)
  check_xavier_qk(plan, d)
  for key in ('v', 'o'):
    np.testing.assert_allclose(plan.layer[key], beta * xavier_std(d, d), rtol=1e-6, err_msg=key)
  for key in ('ffn1', 'ffn2'):
    np.testing.assert_allclose(plan.layer[key], beta * xavier_std(d, 4 * d), rtol=1e-6, err_msg=key)
  assert not plan.skip.learnable and not plan.branch.learnable and not plan.skip.vector
  assert plan.layout is None and plan.attn_logit_scale is None and not plan.attn_identity


@pytest.mark.parametrize('depth', DEPTHS)
def test_deepnorm_built_model(depth):
  d = 32
  config = method_config('deepnorm', 'gpt', depth=depth, width=d)
  alpha, beta = (2 * depth) ** 0.25, (8 * depth) ** -0.25
  model = build(config)
  block = model.trunk.stack.layers
  assert norms_present(block) == POSTLN_NORMS and model.trunk.final_norm is None
  for key in ('skip_attn', 'skip_ffn'):
    scale = getattr(block, key)
    assert isinstance(scale, layers.Constant)
    chex.assert_shape(scale[...], (depth,))
    np.testing.assert_allclose(scale[...], alpha, rtol=1e-6)
  for key in ('branch_attn', 'branch_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
    np.testing.assert_allclose(getattr(block, key)[...], 1.0)
  # Sample stds of the draws: β·Xavier for V, O and the FFN, Xavier for Q and K.
  expected = {
    'q': xavier_std(d, d),
    'k': xavier_std(d, d),
    'v': beta * xavier_std(d, d),
    'o': beta * xavier_std(d, d),
    'ffn1': beta * xavier_std(d, 4 * d),
    'ffn2': beta * xavier_std(4 * d, d),
  }
  for key, dense in dense_layers(block).items():
    np.testing.assert_allclose(kernel_std(dense), expected[key], rtol=0.04, err_msg=key)


def test_deepnorm_constants_are_config_fields():
  config = method_config('deepnorm', depth=8)
  c = config.model.deepnorm
  c.alpha_base, c.alpha_exponent, c.beta_base, c.beta_exponent = 3.0, 0.5, 12.0, 0.5
  plan = init_plan(config)
  np.testing.assert_allclose(plan.layer['skip_ffn'], (3.0 * 8) ** 0.5, rtol=1e-6)
  np.testing.assert_allclose(plan.layer['v'], (12.0 * 8) ** -0.5 * xavier_std(32, 32), rtol=1e-6)


@pytest.mark.parametrize(
  'name,key,value,message',
  [
    ('gpt', 'block', 'preln', 'model.block'),
    ('gpt', 'deepnorm.alpha_base', -1.0, 'model.deepnorm.alpha_base'),
  ],
)
def test_bad_configs_fail_in_validate(name, key, value, message):
  assert_rejected(method_config('deepnorm', name), key, value, message)


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(tmp_path, name):
  check_three_loop_steps('deepnorm', name, tmp_path)
