"""T-Fixup (Huang et al. 2020, `dsjax.schemes.tfixup`): no norm; Xavier; embeddings N(0, d^{-1/2});
V, O, FFN × (9N)^{-1/4} (GPT) or 0.67·N^{-1/4} (ViT).

At two depths, GPT and ViT: the exact initial scales of the plan, the same scales in the built model (the
drawn weights against the Xavier model of the same seed, so ratios are exact, plus their sample standard
deviations), no norm anywhere, fixed residual scales of 1; the configurable constants, the config checks
and a 3-step training run of GPT and ViT.
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
  norm_paths,
  registered,
  xavier_model,
  xavier_std,
)


def test_registered_with_its_blocks():
  assert registered('tfixup')['blocks'] == ('nonorm',)


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('block', 'preln', 'model.block'),
    ('final_norm', True, 'model.final_norm'),
    ('tfixup.encoder_scale', 0.0, 'model.tfixup.encoder_scale'),
    ('tfixup.decoder_factor', -9.0, 'model.tfixup.decoder_factor'),
  ],
)
def test_bad_configs_fail_in_validate_in_one_line(key, value, message):
  assert_rejected(method_config('tfixup'), key, value, message)


@pytest.mark.parametrize('depth', DEPTHS)
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_tfixup_scales_and_has_no_norm(name, depth):
  d = 32
  config = method_config('tfixup', name, depth=depth)
  plan = init_plan(config)
  scale = (9 * depth) ** -0.25 if name == 'gpt' else 0.67 * depth**-0.25
  xavier = {
    'q': xavier_std(d, d),
    'k': xavier_std(d, d),
    'v': xavier_std(d, d),
    'o': xavier_std(d, d),
    'ffn1': xavier_std(d, 4 * d),
    'ffn2': xavier_std(4 * d, d),
  }
  factor = {'q': 1.0, 'k': 1.0, 'v': scale, 'o': scale, 'ffn1': scale, 'ffn2': scale}
  for key in WEIGHT_KEYS:
    np.testing.assert_allclose(plan.layer[key], xavier[key] * factor[key], rtol=1e-6, err_msg=key)
  table_std = d**-0.25 * (9 * depth) ** -0.25  # N(0, d^{-1/2}) × (9N)^{-1/4}
  patch_dim = 2 * 2 * 1
  np.testing.assert_allclose(
    plan.input_std, table_std if name == 'gpt' else table_std / math.sqrt(patch_dim), rtol=1e-6
  )
  np.testing.assert_allclose(plan.pos_std, table_std, rtol=1e-6)
  np.testing.assert_allclose(plan.head_std, xavier_std(d, 256 if name == 'gpt' else 10), rtol=1e-6)

  model = build(config)
  assert norm_paths(model) == []  # no LayerNorm anywhere, no final norm
  reference = xavier_model(config)
  ref_kernels = kernel_arrays(reference)
  for key, w in kernel_arrays(model).items():
    np.testing.assert_allclose(w / ref_kernels[key], factor[key], rtol=1e-5, err_msg=key)
  assert_layer_stds(model, plan)
  input_dim = 256 if name == 'gpt' else patch_dim
  np.testing.assert_allclose(
    input_kernel(model) / input_kernel(reference), plan.input_std / xavier_std(input_dim, d), rtol=1e-5
  )
  if name == 'gpt':
    np.testing.assert_allclose(np.std(model.token_embed[...]), table_std, rtol=0.05)
  block = model.trunk.stack.layers
  for key in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
    np.testing.assert_array_equal(getattr(block, key)[...], np.ones(depth))


def test_tfixup_constants_and_unscaled_embeddings():
  config = method_config('tfixup', 'vit', depth=16)
  config.model.tfixup.encoder_scale, config.model.tfixup.scale_embeddings = 0.5, False
  plan = init_plan(config)
  np.testing.assert_allclose(plan.layer['ffn2'], xavier_std(128, 32) * 0.5 / 2, rtol=1e-6)
  np.testing.assert_allclose(plan.pos_std, 32**-0.25, rtol=1e-6)
  config = method_config('tfixup', 'gpt', depth=16)
  config.model.tfixup.decoder_factor = 1.0
  np.testing.assert_allclose(init_plan(config).layer['v'], xavier_std(32, 32) / 2, rtol=1e-6)


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(name):
  check_three_training_steps('tfixup', name, learnable_branch=False)
