"""The plain initialisations (`dsjax.schemes.vanilla`): Xavier (Glorot & Bengio 2010), GPT-2 style
(Radford et al. 2019) and BERT style (Devlin et al. 2019), with λ = β = 1 on every block.

The plans against the formulas: Xavier, every matrix N(0, 2/(fan_in + fan_out)) (embedding tables as
vocab → width matrices; ViT's learned position table N(0, 0.02²)); GPT-2, every matrix N(0, 0.02²) with
the projections into the residual stream (`o`, `ffn2`) × 1/sqrt(2N); BERT (Devlin et al. 2019), every
matrix, embedding table and the head N(0, 0.02²), unscaled. The built models' draws against
them, the truncated-normal draw of the same variance, the config checks, the moments CLI's comparison
with the theory, and a 3-step training run of GPT and ViT. Expected values are written out here.
"""

import math

import numpy as np
import pytest

from dsjax import moments
from dsjax.models import layers
from tests.schemes.common import (
  DEPTHS,
  assert_layer_stds,
  assert_rejected,
  build,
  check_three_training_steps,
  init_plan,
  method_config,
  registered,
  registry_config,
  xavier_std,
)

SCALE_KEYS = ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn')


def test_registered_with_its_blocks():
  assert registered('vanilla')['blocks'] == ('preln', 'postln', 'dnt', 'nonorm')


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('vanilla.init', 'he', 'model.vanilla.init'),
    ('block', 'sandwich', 'model.block'),
  ],
)
def test_bad_configs_fail_in_validate_in_one_line(key, value, message):
  assert_rejected(method_config('vanilla'), key, value, message)


def _check_unit_residual_scales(plan, model, depth):
  """λ = β = 1, fixed, at both adds of every layer; the output scale 1."""
  for key in SCALE_KEYS:
    np.testing.assert_array_equal(plan.layer[key], np.ones(depth), err_msg=key)
  assert not plan.skip.learnable and not plan.branch.learnable
  assert plan.output_scale == 1.0 and plan.attn_logit_scale is None and not plan.attn_identity
  block = model.trunk.stack.layers
  for key in SCALE_KEYS:
    assert isinstance(getattr(block, key), layers.Constant), key
    np.testing.assert_array_equal(getattr(block, key)[...], np.ones(depth), err_msg=key)
  np.testing.assert_array_equal(model.trunk.output_scale[...], 1.0)


@pytest.mark.parametrize('depth', DEPTHS)
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_xavier_plan_and_built_model(name, depth):
  d, vocab, classes, patch_dim = 32, 256, 10, 2 * 2 * 1
  config = method_config('vanilla', name, depth=depth)
  assert config.model.vanilla.init == 'xavier'  # the default
  plan = init_plan(config)
  assert plan.distribution == 'normal'
  expected = {
    'q': xavier_std(d, d),
    'k': xavier_std(d, d),
    'v': xavier_std(d, d),
    'o': xavier_std(d, d),
    'ffn1': xavier_std(d, 4 * d),
    'ffn2': xavier_std(4 * d, d),
  }
  for key, std in expected.items():
    np.testing.assert_allclose(plan.layer[key], np.full(depth, std), rtol=1e-6, err_msg=key)
  input_dim = vocab if name == 'gpt' else patch_dim
  np.testing.assert_allclose(plan.input_std, xavier_std(input_dim, d), rtol=1e-6)
  # GPT: the position table is Xavier like the token table; ViT: N(0, 0.02²).
  np.testing.assert_allclose(plan.pos_std, xavier_std(vocab, d) if name == 'gpt' else 0.02, rtol=1e-6)
  np.testing.assert_allclose(plan.head_std, xavier_std(d, vocab if name == 'gpt' else classes), rtol=1e-6)

  model = build(config)
  _check_unit_residual_scales(plan, model, depth)
  assert_layer_stds(model, plan)
  if name == 'gpt':  # 256·32 draws each: the sample std is within ~2.5% (3 standard errors)
    np.testing.assert_allclose(np.std(model.token_embed[...]), plan.input_std, rtol=0.05)
    np.testing.assert_allclose(np.std(model.head.kernel[...]), plan.head_std, rtol=0.05)


@pytest.mark.parametrize('depth', DEPTHS)
def test_gpt2_plan_and_built_model(depth):
  config = method_config('vanilla', 'gpt', depth=depth)
  config.model.vanilla.init = 'gpt2'
  plan = init_plan(config)
  residual = 0.02 / math.sqrt(2 * depth)  # the projections that write into the stream
  expected = {'q': 0.02, 'k': 0.02, 'v': 0.02, 'o': residual, 'ffn1': 0.02, 'ffn2': residual}
  for key, std in expected.items():
    np.testing.assert_allclose(plan.layer[key], np.full(depth, std), rtol=1e-6, err_msg=key)
  for field in ('input_std', 'pos_std', 'head_std'):
    np.testing.assert_allclose(getattr(plan, field), 0.02, rtol=1e-6, err_msg=field)

  model = build(config)
  _check_unit_residual_scales(plan, model, depth)
  assert_layer_stds(model, plan)
  np.testing.assert_allclose(np.std(model.token_embed[...]), 0.02, rtol=0.05)


@pytest.mark.parametrize('distribution', ['normal', 'truncated_normal'])
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_bert_plan_and_built_model(name, distribution):
  """BERT (Devlin et al. 2019; Kedia et al. 2024 Table 14: σ = 0.02): every matrix, both embedding
  tables and the head N(0, 0.02²) (or its truncated draw of the same variance), no depth scaling."""
  depth = 4
  config = method_config('vanilla', name, depth=depth, init_distribution=distribution)
  config.model.vanilla.init = 'bert'
  plan = init_plan(config)
  assert plan.distribution == distribution
  for key in ('q', 'k', 'v', 'o', 'ffn1', 'ffn2'):
    np.testing.assert_allclose(plan.layer[key], np.full(depth, 0.02), rtol=1e-6, err_msg=key)
  for field in ('input_std', 'pos_std', 'head_std'):
    np.testing.assert_allclose(getattr(plan, field), 0.02, rtol=1e-6, err_msg=field)

  model = build(config)
  _check_unit_residual_scales(plan, model, depth)
  assert_layer_stds(model, plan)
  head = model.head.kernel[...]
  if name == 'gpt':  # 256·32 draws (16·32 for the position table): within 5% (10%)
    np.testing.assert_allclose(np.std(model.token_embed[...]), 0.02, rtol=0.05)
    np.testing.assert_allclose(np.std(model.pos_embedding[...]), 0.02, rtol=0.1)
    np.testing.assert_allclose(np.std(head), 0.02, rtol=0.05)
  else:  # 32·10 head draws
    np.testing.assert_allclose(np.std(head), 0.02, rtol=0.15)
  if distribution == 'truncated_normal':  # cut at ±2 standard normals, rescaled to std 0.02
    assert np.abs(head).max() <= 2.0 / math.sqrt(0.7737413) * 0.02 * (1 + 1e-6)


def test_truncated_normal_draw_keeps_the_xavier_variance():
  """`model.init_distribution = 'truncated_normal'` (Qi et al. 2025, Table 4): a standard normal cut at
  ±2, rescaled to the Xavier variance, so every draw lies within ±2σ/sqrt(E[z²]) ≈ ±2.27σ (E[z²] of the
  cut normal ≈ 0.774); the normal draw of the same seed has values beyond."""
  config = method_config('vanilla', 'vit', depth=4, init_distribution='truncated_normal')
  plan = init_plan(config)
  assert plan.distribution == 'truncated_normal'
  np.testing.assert_allclose(plan.layer['ffn1'], xavier_std(32, 128), rtol=1e-6)
  model = build(config)
  assert_layer_stds(model, plan)
  normal = build(method_config('vanilla', 'vit', depth=4))
  w, w_normal = (np.asarray(m.trunk.stack.layers.ffn.ffn1.kernel[...]) for m in (model, normal))
  bound = 2.0 / math.sqrt(0.7737413) * xavier_std(32, 128)
  assert np.abs(w).max() <= bound * (1 + 1e-6) < np.abs(w_normal).max()


def test_moments_cli_compares_vanilla_with_the_theory(tmp_path):
  config = registry_config('vanilla', 'gpt')
  result = moments.run(config, str(tmp_path), num_batches=1)
  assert len(result['layers']) == config.model.depth
  assert result['summary']


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(name):
  check_three_training_steps('vanilla', name, learnable_branch=False)
