"""Noci et al. 2022 (`dsjax.schemes.noci`): α² = α̃/L at both adds, attention logits × τ/sqrt(d_head).

The plan and the built model at two depths on Pre-LN and Post-LN, the temperature formula (their Eq. 47)
and α̃, learnable α, the config checks and a 3-step training run of GPT and ViT. Expected values are
written out here from the paper's formulas.
"""

import math

import chex
import numpy as np
import pytest
from flax import nnx

from dsjax import models
from dsjax.models import layers
from dsjax.train import config as config_lib
from tests.schemes.common import (
  DEPTHS,
  INFO,
  POSTLN_NORMS,
  PRELN_NORMS,
  assert_rejected,
  build,
  check_three_loop_steps,
  check_xavier_qk,
  init_plan,
  method_config,
  norms_present,
  registered,
  xavier_std,
)


def test_registered_with_its_blocks():
  blocks = registered('noci')['blocks']
  assert blocks[0] == 'preln' and 'postln' in blocks


def _tau_eq47(d, n, rho):
  return math.sqrt(d * n * (1 + rho * (n - 1)) / ((1 - rho) ** 2 * (n + d) * (n - 1)))


@pytest.mark.parametrize('block', ['preln', 'postln'])
@pytest.mark.parametrize('depth', DEPTHS)
def test_noci_plan_and_model(depth, block):
  d, heads = 32, 4
  config = method_config('noci', 'gpt', depth=depth, width=d, num_heads=heads, block=block)
  plan = init_plan(config)
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_allclose(plan.layer[key], math.sqrt(1.0 / depth), rtol=1e-6)
  for key in ('skip_attn', 'skip_ffn'):
    np.testing.assert_allclose(plan.layer[key], 1.0)
  np.testing.assert_allclose(plan.attn_logit_scale, 1.0 / math.sqrt(d // heads), rtol=1e-6)  # τ = 1
  check_xavier_qk(plan, d)
  np.testing.assert_allclose(plan.layer['v'], xavier_std(d, d), rtol=1e-6)
  model = build(config)
  block_ = model.trunk.stack.layers
  assert norms_present(block_) == (PRELN_NORMS if block == 'preln' else POSTLN_NORMS)
  for key in ('branch_attn', 'branch_ffn'):
    scale = getattr(block_, key)
    assert isinstance(scale, layers.Constant)
    chex.assert_shape(scale[...], (depth,))
    np.testing.assert_allclose(scale[...], math.sqrt(1.0 / depth), rtol=1e-6)
  np.testing.assert_allclose(block_.attn.logit_scale, 1.0 / math.sqrt(d // heads), rtol=1e-6)


@pytest.mark.parametrize('depth', DEPTHS)
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_noci_temperature_formula_and_alpha_tilde(name, depth):
  d, heads = 32, 4
  config = method_config('noci', name, depth=depth, width=d, num_heads=heads)
  config.model.noci.alpha_tilde = 2.0
  config.model.noci.tau = 'formula'
  config.model.noci.rho = 0.3
  config_lib.validate_config(config, num_devices=1)
  dims = models.model_dims(config.model, INFO[name], seq_len=config.data.seq_len)
  n = dims.seq_len  # GPT: data.seq_len; ViT: (8/2)² patches
  assert n == 16
  plan = init_plan(config)
  tau = _tau_eq47(d, n, 0.3)
  np.testing.assert_allclose(plan.attn_logit_scale, tau / math.sqrt(d // heads), rtol=1e-6)
  np.testing.assert_allclose(plan.layer['branch_ffn'], math.sqrt(2.0 / depth), rtol=1e-6)
  model = build(config)
  np.testing.assert_allclose(
    model.trunk.stack.layers.attn.logit_scale, tau / math.sqrt(d // heads), rtol=1e-6
  )
  # ρ = 0: τ² = d·n/((n+d)(n−1)); a number is taken as it is.
  config.model.noci.rho = 0.0
  np.testing.assert_allclose(
    init_plan(config).attn_logit_scale * math.sqrt(d // heads),
    math.sqrt(d * n / ((n + d) * (n - 1))),
    rtol=1e-6,
  )
  config.model.noci.tau = 8.5
  np.testing.assert_allclose(init_plan(config).attn_logit_scale, 8.5 / math.sqrt(d // heads), rtol=1e-6)


def test_noci_learnable_alpha():
  config = method_config('noci', depth=4)
  config.model.noci.learnable_alpha = True
  block = build(config).trunk.stack.layers
  assert isinstance(block.branch_attn, nnx.Param) and isinstance(block.branch_ffn, nnx.Param)
  assert isinstance(block.skip_attn, layers.Constant)


@pytest.mark.parametrize(
  'name,key,value,message',
  [
    ('gpt', 'block', 'dnt', 'model.block'),
    ('gpt', 'noci.tau', 'hot', 'model.noci.tau'),
    ('gpt', 'noci.tau', 0.0, 'model.noci.tau'),
    ('gpt', 'noci.rho', 1.0, 'model.noci.rho'),
    ('gpt', 'noci.alpha_tilde', 0.0, 'model.noci.alpha_tilde'),
  ],
)
def test_bad_configs_fail_in_validate(name, key, value, message):
  assert_rejected(method_config('noci', name), key, value, message)


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(tmp_path, name):
  check_three_loop_steps('noci', name, tmp_path)
