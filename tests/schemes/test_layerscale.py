"""LayerScale (Touvron et al. 2021, CaiT, `dsjax.schemes.layerscale`): Pre-LN, x + diag(λ)·f(LN(x)),
λ ∈ R^d learnable, its initial ε by CaiT's depth rule.

The depth rule in the plan, the built model at two depths (learnable width-d vectors, Pre-LN norms,
Xavier weights), the config checks and a 3-step training run of GPT and ViT.
"""

import chex
import numpy as np
import pytest
from flax import nnx

from dsjax.models import layers
from dsjax.schemes import layerscale
from tests.schemes.common import (
  DEPTHS,
  assert_rejected,
  build,
  check_three_training_steps,
  init_plan,
  kernel_arrays,
  method_config,
  norm_paths,
  registered,
  xavier_model,
)


def test_registered_with_its_blocks():
  assert registered('layerscale')['blocks'] == ('preln',)


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('block', 'postln', 'model.block'),
    ('layerscale.init', 'cait', 'model.layerscale.init'),
    ('layerscale.init', -0.1, 'model.layerscale.init'),
  ],
)
def test_bad_configs_fail_in_validate_in_one_line(key, value, message):
  assert_rejected(method_config('layerscale'), key, value, message)


@pytest.mark.parametrize('depth,eps', [(4, 0.1), (16, 0.1), (18, 0.1), (20, 1e-5), (24, 1e-5), (30, 1e-6)])
def test_layerscale_depth_rule(depth, eps):
  assert layerscale.depth_rule_init(depth) == eps
  plan = init_plan(method_config('layerscale', depth=depth))
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.full(depth, eps, np.float32))
  assert plan.branch.learnable and plan.branch.vector and not plan.branch.shared


@pytest.mark.parametrize('depth', DEPTHS)
def test_layerscale_model_has_learnable_vectors_and_pre_ln(depth):
  config = method_config('layerscale', 'vit', depth=depth)
  if depth == 16:
    config.model.layerscale.init = 1e-4
  eps = 0.1 if depth == 4 else 1e-4
  model = build(config)
  block = model.trunk.stack.layers
  for key in ('branch_attn', 'branch_ffn'):
    lam = getattr(block, key)
    assert isinstance(lam, nnx.Param)
    chex.assert_shape(lam[...], (depth, 32))  # one width-d vector per add and layer
    np.testing.assert_array_equal(lam[...], np.full((depth, 32), eps, np.float32))
  for key in ('skip_attn', 'skip_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
  assert block.pre_attn_norm is not None and block.pre_ffn_norm is not None
  assert block.post_attn_norm is None and model.trunk.final_norm is not None
  assert len(norm_paths(model)) == 3  # pre-attention, pre-FFN and final LayerNorm
  reference = xavier_model(config)
  ref_kernels = kernel_arrays(reference)
  for key, w in kernel_arrays(model).items():  # Xavier weights
    np.testing.assert_array_equal(w, ref_kernels[key])


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(name):
  check_three_training_steps('layerscale', name, learnable_branch=True)
