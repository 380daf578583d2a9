"""DS-Init (Zhang, Titov & Sennrich 2019, `dsjax.schemes.dsinit`): every weight of layer l ~ U(±γ·α/sqrt(l)),
γ = sqrt(6/(d_in + d_out)), on Post-LN or Pre-LN.

At two depths: the exact initial scales of the plan, the same scales in the built model (the drawn
weights against the Xavier-uniform model of the same seed, so ratios are exact, plus their sample standard
deviations), the block structure, the config checks and a 3-step training run of GPT and ViT.
"""

import math

import numpy as np
import pytest

from dsjax.models import layers
from dsjax.models.plan import WEIGHT_KEYS
from tests.schemes.common import (
  DEPTHS,
  assert_layer_stds,
  assert_rejected,
  build,
  check_three_training_steps,
  init_plan,
  input_kernel,
  kernel_arrays,
  method_config,
  registered,
  xavier_model,
  xavier_std,
)


def test_registered_with_its_blocks():
  assert registered('dsinit')['blocks'] == ('postln', 'preln')


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('block', 'nonorm', 'model.block'),
    ('dsinit.alpha', 1.5, 'model.dsinit.alpha'),
    ('dsinit.alpha', 0.0, 'model.dsinit.alpha'),
  ],
)
def test_bad_configs_fail_in_validate_in_one_line(key, value, message):
  assert_rejected(method_config('dsinit'), key, value, message)


@pytest.mark.parametrize('depth', DEPTHS)
def test_dsinit_scales_each_layer_by_alpha_over_sqrt_l(depth):
  d, alpha = 32, 0.5 if depth == 16 else 1.0
  config = method_config('dsinit', depth=depth)
  config.model.dsinit.alpha = alpha
  plan = init_plan(config)
  assert plan.distribution == 'uniform'
  l = np.arange(1, depth + 1)
  bound = {'q': math.sqrt(6 / (2 * d)), 'ffn1': math.sqrt(6 / (5 * d)), 'ffn2': math.sqrt(6 / (5 * d))}
  bound['k'] = bound['v'] = bound['o'] = bound['q']
  for name in WEIGHT_KEYS:  # std of U(±a) is a/sqrt(3)
    np.testing.assert_allclose(plan.layer[name], bound[name] * alpha / np.sqrt(l) / math.sqrt(3), rtol=1e-6)
  for name in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[name], 1.0)
  np.testing.assert_allclose(plan.input_std, xavier_std(256, d), rtol=1e-6)  # embeddings: Xavier
  np.testing.assert_allclose(plan.head_std, xavier_std(d, 256), rtol=1e-6)

  model = build(config)
  reference = xavier_model(config, init_distribution='uniform')  # Xavier-uniform, same draws
  ref_kernels = kernel_arrays(reference)
  for name, w in kernel_arrays(model).items():
    ratio = w / ref_kernels[name]
    np.testing.assert_allclose(
      ratio, np.broadcast_to((alpha / np.sqrt(l))[:, None, None], w.shape), rtol=1e-5, err_msg=name
    )
    a = bound[name] * alpha / np.sqrt(l)  # uniform: bounded by a, and filling the interval
    largest = np.abs(w).max(axis=(1, 2))
    assert np.all(largest <= a * (1 + 1e-6)) and np.all(largest > 0.9 * a)
  assert_layer_stds(model, plan)
  np.testing.assert_array_equal(input_kernel(model), input_kernel(reference))
  block = model.trunk.stack.layers
  assert block.post_attn_norm is not None and block.pre_attn_norm is None  # Post-LN
  assert isinstance(block.branch_attn, layers.Constant) and isinstance(block.skip_ffn, layers.Constant)


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(name):
  check_three_training_steps('dsinit', name, learnable_branch=False)
