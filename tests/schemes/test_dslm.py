"""DeepScaleLM scheme: every init variance and scale against the paper, config checks, input moments.

The expected values are written out here from Kedia et al. 2024, §3.5 and Appendix M (not taken from
`dsjax.schemes.dslm`), including an independent transcription of the paper's correlation recurrence for
the full init.
"""

import json
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

from dsjax import data as data_lib
from dsjax import models, schemes, theory
from dsjax.models import layers
from dsjax.schemes import dslm
from dsjax.train import loop
from dsjax.train import state as state_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config
from tests.schemes.common import assert_rejected, dense_layers, layer_of, registered

P = 0.1


def _dslm_config(name='gpt', *, init='simple', depth=4, width=32, block='postln', **model):
  c = tiny_config(name, scheme='dslm', depth=depth, width=width, block=block, dropout=P, **model)
  c.model.dslm.init = init
  if name == 'vit':
    c.model.dslm.input_corr = 0.46  # ImageNet, paper Appendix H
  return c


def _dims(config, info):
  return models.model_dims(config.model, info, seq_len=config.data.seq_len)


def _spec_recurrence(depth, p, r_embed):
  """Kedia et al. 2024, App. M: r_n = correlation entering layer n.

  λ² = 1 − 2/N, β² = 2/N, var starts at 1.
  """
  lam2, beta2 = 1 - 2 / depth, 2 / depth
  r, var, out = r_embed * (1 - p), 1.0, []
  for _ in range(depth):
    out.append(r)
    r = (lam2 * r * var + beta2 * (1 - p)) / (lam2 * var + beta2)
    var = lam2 * var + beta2
    r_ffn = (1 - p) * (r + (math.sqrt(1 - r * r) - r * math.acos(r)) / math.pi)
    r = (lam2 * r * var + beta2 * r_ffn) / (lam2 * var + beta2)
    var = lam2 * var + beta2
  return np.array(out)


def test_registered_with_its_blocks():
  assert registered('dslm')['blocks'] == ('preln', 'postln')


# ------------------------------------------------------------------------------------------------
# The plan against Kedia et al. 2024 (§3.5, App. M): two depths, both blocks, both inits (ReLU, hidden 4d).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('depth', [12, 96])
@pytest.mark.parametrize('block', ['preln', 'postln'])
@pytest.mark.parametrize('init', ['simple', 'full'])
def test_plan_matches_spec(depth, block, init):
  d = 64
  config = _dslm_config('gpt', init=init, depth=depth, width=d, block=block, activation='relu')
  config.model.dslm.attention_var = 'table2'  # the paper's V/O formula
  plan = schemes.make_init_plan(config.model, _dims(config, TEXT_INFO))
  lay = {k: np.asarray(v, np.float64) for k, v in plan.layer.items()}

  np.testing.assert_allclose(lay['skip_attn'] ** 2, 1 - 2 / depth, rtol=1e-6)
  np.testing.assert_allclose(lay['skip_ffn'] ** 2, 1 - 2 / depth, rtol=1e-6)
  np.testing.assert_allclose(lay['branch_attn'] ** 2, 2 / depth, rtol=1e-6)
  np.testing.assert_allclose(lay['branch_ffn'] ** 2, 2 / depth, rtol=1e-6)
  np.testing.assert_allclose(plan.input_std**2, (1 - P) / 2, rtol=1e-6)  # token table, K = 2
  np.testing.assert_allclose(plan.pos_std**2, (1 - P) / 2, rtol=1e-6)  # position table
  sf2 = (1 / d) * math.sqrt((1 - P) / 2)
  np.testing.assert_allclose(lay['ffn1'] ** 2, sf2, rtol=1e-6)
  np.testing.assert_allclose(lay['ffn2'] ** 2, sf2, rtol=1e-6)
  np.testing.assert_allclose(lay['q'] ** 2, 1 / d, rtol=1e-6)
  np.testing.assert_allclose(lay['k'] ** 2, 1 / d, rtol=1e-6)
  if init == 'simple':
    expected_vo = np.full(depth, sf2)
  else:
    r_word = math.pi**2 / (6 * math.log(256) ** 2)  # Zipf over the 256 byte values, paper App. A.1
    expected_vo = (1 / d) * np.sqrt((1 - P) / _spec_recurrence(depth, P, r_word / 2))
  np.testing.assert_allclose(lay['v'] ** 2, expected_vo, rtol=1e-4)
  np.testing.assert_allclose(lay['o'] ** 2, expected_vo, rtol=1e-4)
  np.testing.assert_allclose(plan.output_scale, 1 / math.sqrt(d), rtol=1e-6)
  assert not plan.skip.learnable and not plan.branch.learnable


@pytest.mark.parametrize('depth', [12, 96])
def test_exact_attention_var_gives_unit_attention_output(depth):
  """attention_var='exact': per layer, the theory's causal attention block with the planned V/O has
  output variance 1 for the recurrence's r_n; V·O is below Table 2 where r_n is small."""
  d = 64
  config = _dslm_config('gpt', init='full', depth=depth, width=d, block='preln', activation='relu')
  assert config.model.dslm.attention_var == 'table2'  # the paper's formula is the default
  config.model.dslm.attention_var = 'exact'
  dims = _dims(config, TEXT_INFO)
  plan = schemes.make_init_plan(config.model, dims)
  vo = np.asarray(plan.layer['v'], np.float64) ** 2
  np.testing.assert_allclose(np.asarray(plan.layer['o'], np.float64) ** 2, vo, rtol=1e-6)
  r_word = math.pi**2 / (6 * math.log(256) ** 2)
  r_n = _spec_recurrence(depth, P, r_word / 2)
  for n in (0, depth // 2, depth - 1):
    out, _ = theory.components.attention_block(
      theory.Stats(var=1.0, corr_seq=float(r_n[n])),
      theory.GradStats(),
      d=d,
      num_heads=dims.num_heads,
      length=dims.seq_len,
      p=P,
      q_var=1 / d,
      k_var=1 / d,
      v_var=vo[n],
      o_var=vo[n],
      attn_p=config.model.attn_dropout,
      causal=True,
    )
    np.testing.assert_allclose(out.var, 1.0, rtol=2e-3, err_msg=f'layer {n}')
  table2 = (1 / d) * np.sqrt((1 - P) / r_n)
  assert vo[0] < table2[0]  # causal: early queries average few tokens


@pytest.mark.parametrize('block', ['preln', 'postln'])
@pytest.mark.parametrize('depth', [4, 8])
def test_built_model_has_the_planned_variances(block, depth):
  """Sample variances of the drawn weights, biases 0, gains 1, λ/β and the output scale in the model."""
  d = 64
  config = _dslm_config('gpt', init='full', depth=depth, width=d, block=block, activation='relu')
  plan = schemes.make_init_plan(config.model, _dims(config, TEXT_INFO))
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  block_ = model.trunk.stack.layers
  for name, dense in dense_layers(block_).items():
    w = np.asarray(dense.kernel[...])
    # ≥ 4096 draws per layer: the sample variance is within ~7% (3 standard errors).
    np.testing.assert_allclose(w.var(axis=(1, 2)), plan.layer[name] ** 2, rtol=0.1, err_msg=name)
    assert float(np.abs(dense.bias[...]).max()) == 0.0
  np.testing.assert_allclose(np.var(model.token_embed[...]), (1 - P) / 2, rtol=0.05)
  np.testing.assert_allclose(np.var(model.pos_embedding[...]), (1 - P) / 2, rtol=0.15)
  np.testing.assert_allclose(np.var(model.head.kernel[...]), (1 - P) / 2, rtol=0.05)
  for norm in (
    (block_.post_attn_norm, block_.post_ffn_norm)
    if block == 'postln'
    else (block_.pre_attn_norm, block_.pre_ffn_norm, model.trunk.final_norm)
  ):
    assert np.all(np.asarray(norm.scale[...]) == 1) and np.all(np.asarray(norm.bias[...]) == 0)
  for name in ('skip_attn', 'skip_ffn'):
    assert isinstance(getattr(block_, name), layers.Constant)
    np.testing.assert_allclose(getattr(block_, name)[...], math.sqrt(1 - 2 / depth), rtol=1e-6)
  for name in ('branch_attn', 'branch_ffn'):
    assert isinstance(getattr(block_, name), layers.Constant)
    np.testing.assert_allclose(getattr(block_, name)[...], math.sqrt(2 / depth), rtol=1e-6)
  np.testing.assert_allclose(model.trunk.output_scale[...], 1 / math.sqrt(d), rtol=1e-6)


def test_vit_embedding_and_head():
  """ViT: patch kernel σe²/(P²C) for unit-variance pixels, learned position table σe² (K = 2)."""
  config = _dslm_config('vit', depth=4, width=256)
  plan = schemes.make_init_plan(config.model, _dims(config, IMAGE_INFO))
  d_in = config.model.patch_size**2 * IMAGE_INFO.image_shape[2]
  np.testing.assert_allclose(plan.input_std**2, (1 - P) / 2 / d_in, rtol=1e-6)
  np.testing.assert_allclose(plan.pos_std**2, (1 - P) / 2, rtol=1e-6)
  np.testing.assert_allclose(plan.head_std**2, (1 - P) / 2, rtol=1e-6)  # classifier: σe², as an LM head
  np.testing.assert_allclose(plan.output_scale, 1 / math.sqrt(256), rtol=1e-6)
  # The summed embedding of unit-variance pixels has variance 1 − p, i.e. 1 after the dropout.
  model = schemes.build_model(config, IMAGE_INFO, nnx.Rngs(params=0))
  pixels = jax.random.normal(jax.random.key(1), (64, 8, 8, 1))
  np.testing.assert_allclose(float(model.embed(pixels).var()), 1 - P, rtol=0.1)


@pytest.mark.parametrize('dropout', [0.0, P])
def test_vit_with_the_fixed_sincos_table_gives_the_patch_term_the_rest(dropout):
  """The paper's ViT (Appendix N: fixed 2D sin-cos table, Table 26: dropout 0): the table's mean square is
  1/2, the patch term takes input_var·(1−p) − 1/2 of the summed embedding."""
  config = _dslm_config('vit', depth=4, width=256, pos_embedding='sincos2d')
  config.model.dropout = dropout
  plan = schemes.make_init_plan(config.model, _dims(config, IMAGE_INFO))
  d_in = config.model.patch_size**2 * IMAGE_INFO.image_shape[2]
  np.testing.assert_allclose(plan.input_std**2 * d_in, (1 - dropout) - 0.5, rtol=1e-6)
  model = schemes.build_model(config, IMAGE_INFO, nnx.Rngs(params=0))
  pixels = jax.random.normal(jax.random.key(1), (64, 8, 8, 1))
  np.testing.assert_allclose(float(np.mean(np.square(model.embed(pixels)))), 1 - dropout, rtol=0.1)


def test_gelu_ffn_uses_the_gelu_moments():
  """GeLU FFN weights give FFN-block output variance 1 (theory and Monte Carlo), unlike the ReLU value."""
  d = 128
  c_gelu = _dslm_config('gpt', depth=8, width=d, activation='gelu')
  var_gelu = float(schemes.make_init_plan(c_gelu.model, _dims(c_gelu, TEXT_INFO)).layer['ffn1'][0]) ** 2
  var_relu = (1 / d) * math.sqrt((1 - P) / 2)
  assert abs(var_gelu / var_relu - 1) > 0.1
  out, _ = theory.components.ffn_block(
    theory.Stats(var=1.0),
    theory.GradStats(),
    d=d,
    hidden=4 * d,
    p=P,
    w1_var=var_gelu,
    w2_var=var_gelu,
    activation='gelu',
  )
  np.testing.assert_allclose(out.var, 1.0, rtol=1e-3)
  # Monte Carlo through the model's FFN and dropout on unit-variance inputs (as after the LayerNorm).
  model = schemes.build_model(c_gelu, TEXT_INFO, nnx.Rngs(params=0))
  ffn0 = layer_of(model.trunk.stack.layers.ffn, 0)
  x = jax.random.normal(jax.random.key(2), (512, d))
  y = layers.dropout(ffn0(x), P, jax.random.key(3))
  np.testing.assert_allclose(float(y.var()), 1.0, rtol=0.1)


def test_beta_exponent_learnable_beta_and_output_scales():
  config = _dslm_config('gpt', depth=16, width=32)
  config.model.dslm.k, config.model.dslm.alpha = 4.0, 1.5
  config.model.dslm.learnable_beta = True
  config.model.dslm.output_scale = 'sqrt_embed_var_d'
  plan = schemes.make_init_plan(config.model, _dims(config, TEXT_INFO))
  np.testing.assert_allclose(plan.layer['branch_ffn'] ** 2, 4.0 / 16**1.5, rtol=1e-6)
  np.testing.assert_allclose(plan.layer['skip_ffn'] ** 2, 1 - 4.0 / 16**1.5, rtol=1e-6)
  np.testing.assert_allclose(plan.output_scale, 1 / math.sqrt((1 - P) / 2 * 32), rtol=1e-6)
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  block = model.trunk.stack.layers
  assert isinstance(block.branch_attn, nnx.Param) and isinstance(block.branch_ffn, nnx.Param)
  assert isinstance(block.skip_attn, layers.Constant)


@pytest.mark.parametrize(
  'name,key,value,message',
  [
    ('gpt', 'block', 'dnt', 'model.block'),
    ('gpt', 'dslm.init', 'fancy', 'model.dslm.init'),
    ('gpt', 'dslm.output_scale', 'one', 'model.dslm.output_scale'),
    ('gpt', 'dslm.attention_var', 'paper', 'model.dslm.attention_var'),
    ('gpt', 'dslm.k', -1.0, 'model.dslm.k'),
    ('gpt', 'dslm.k', 4.0, 'model.dslm.k / model.depth'),
    ('gpt', 'dslm.input_corr', 'guess', 'model.dslm.input_corr'),
    ('gpt', 'dslm.input_corr', 0.0, 'model.dslm.input_corr'),
    ('gpt', 'dslm.input_var', 0.0, 'model.dslm.input_var'),
    ('vit', 'dslm.input_corr', 'zipf', 'model.dslm.input_corr'),
  ],
)
def test_bad_dslm_configs_fail_in_validate(name, key, value, message):
  assert_rejected(_dslm_config(name, depth=4), key, value, message)


def test_the_sincos_table_needs_room_for_the_patch_term():
  config = _dslm_config('vit', depth=4, pos_embedding='sincos2d')
  assert_rejected(config, 'dslm.input_var', 0.5, 'model.dslm.input_var·(1 − model.dropout) must exceed 1/2')


# ------------------------------------------------------------------------------------------------
# input_corr='measure'.
# ------------------------------------------------------------------------------------------------


def test_measure_needs_moments_and_uses_the_final_models_embedding():
  config = _dslm_config('gpt', init='full', depth=6, width=32)
  config.model.dslm.input_corr = 'measure'
  info = data_lib.dataset_info(config.data)
  with pytest.raises(ValueError, match='measured input moments'):
    schemes.build_model(config, info, nnx.Rngs(params=0))
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (4, 17), 0, 256))
  moments = dslm.measure_input_moments(config, info, [tokens[:, :-1]])
  model = schemes.build_model(config, info, nnx.Rngs(params=config.seed), prepared=moments)
  x = np.asarray(model.embed(tokens[:, :-1]))
  np.testing.assert_allclose(moments['var'], x.var(), rtol=1e-4)  # same weights as the provisional model
  assert 0.0 <= moments['corr_seq'] < 0.2
  # Full init: the measured correlation sets V/O (a different correlation gives different stds).
  plan = schemes.make_init_plan(config.model, _dims(config, info), moments)
  other = schemes.make_init_plan(config.model, _dims(config, info), {'var': moments['var'], 'corr_seq': 0.5})
  assert not np.allclose(plan.layer['v'], other.layer['v'])


def test_training_loop_measures_logs_and_saves_input_moments(tmp_path):
  config = _dslm_config('gpt', init='full', depth=4, width=32)
  config.model.dslm.input_corr = 'measure'
  config.total_steps = 2
  final = loop.train_and_evaluate(config, str(tmp_path))
  with open(os.path.join(tmp_path, schemes.PREPARATION_FILE)) as f:
    moments = json.load(f)['result']
  # Token + position tables of variance (1−p)/2 each; bytes repeat, so r^l > 0 (Zipf estimate: 0.027).
  np.testing.assert_allclose(moments['var'], 1 - P, rtol=0.1)
  assert 0.0 < moments['corr_seq'] < 0.3
  assert np.isfinite(final['eval/loss'])


def test_measured_vit_input_and_full_init_needs_positive_correlation():
  """On the digits the measured r^l is slightly negative (constant border pixels sit below the pooled
  mean); the full init's 1/sqrt(r) cannot use it and says so, the simple init does not need it."""
  config = _dslm_config('vit', init='full', depth=4, width=64)
  config.model.dslm.input_corr = 'measure'
  info = data_lib.dataset_info(config.data)
  moments = dslm.measure_input_moments(config, info, [next(state_lib.first_model_inputs(config))])
  assert 0.7 < moments['var'] < 1.4 and -0.2 < moments['corr_seq'] < 0.2
  if moments['corr_seq'] <= 0:
    with pytest.raises(ValueError, match="model.dslm.init='full' needs a positive"):
      schemes.build_model(config, info, nnx.Rngs(params=0), prepared=moments)
  config.model.dslm.init = 'simple'
  schemes.build_model(config, info, nnx.Rngs(params=0), prepared=moments)
