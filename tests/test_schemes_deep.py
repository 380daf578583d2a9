"""Prior deep-transformer methods: ADMIN, DeepNorm, Noci et al., Value-SkipInit.

Initial scales in the plan and in the built model at two depths, the block structure, config checks,
ADMIN's profile against its closed form, Value-SkipInit's identity attention, and a 3-step training run
of every method on GPT and ViT. Expected values are written out here from the papers' formulas.
"""

import json
import math
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import data as data_lib
from dsjax import models, schemes, theory
from dsjax.models import layers
from dsjax.schemes import admin
from dsjax.train import config as config_lib
from dsjax.train import loop
from dsjax.train import state as state_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

DEPTHS = [4, 16]
INFO = {'gpt': TEXT_INFO, 'vit': IMAGE_INFO}


def _config(scheme, name='gpt', *, depth=4, width=32, block=None, **model):
  block = block or schemes.get(scheme).blocks[0]
  return tiny_config(name, scheme=scheme, depth=depth, width=width, block=block, **model)


def _plan(config, info=None):
  info = info or INFO[config.model.name]
  return schemes.make_init_plan(config.model, models.model_dims(config.model, info,
                                                                seq_len=config.data.seq_len))


def _build(config, info=None, prepared=None):
  return schemes.build_model(config, info or INFO[config.model.name], nnx.Rngs(params=0), prepared)


def _layer(stacked: nnx.Module, n: int) -> nnx.Module:
  """Layer n of a module whose parameters are stacked on axis 0 by the scanned stack."""
  graphdef, state = nnx.split(stacked)
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[n], state))


def _xavier(fan_in, fan_out):
  return math.sqrt(2.0 / (fan_in + fan_out))


def _check_xavier_qk(plan, d):
  for key in ('q', 'k'):
    np.testing.assert_allclose(plan.layer[key], _xavier(d, d), rtol=1e-6, err_msg=key)


def _kernel_std(dense) -> float:
  """Sample std of a stacked kernel, pooled over layers (≥ 4·1024 draws: relative error ≈ 1%)."""
  return float(np.asarray(dense.kernel[...]).std())


def _stack_norms(block):
  return {name: getattr(block, name) is not None for name in (
      'pre_attn_norm', 'mid_attn_norm', 'post_attn_norm', 'pre_ffn_norm', 'mid_ffn_norm', 'post_ffn_norm')}


POSTLN_NORMS = dict(pre_attn_norm=False, mid_attn_norm=False, post_attn_norm=True, pre_ffn_norm=False,
                    mid_ffn_norm=False, post_ffn_norm=True)
PRELN_NORMS = dict(pre_attn_norm=True, mid_attn_norm=False, post_attn_norm=False, pre_ffn_norm=True,
                   mid_ffn_norm=False, post_ffn_norm=False)


def test_the_four_methods_are_registered():
  table = {row['name']: row for row in schemes.table()}
  assert table['admin']['blocks'] == ('postln',)
  assert table['deepnorm']['blocks'] == ('postln',)
  assert table['noci']['blocks'][0] == 'preln' and 'postln' in table['noci']['blocks']
  assert table['value_skipinit']['blocks'][0] == 'preln'
  for name in ('admin', 'deepnorm', 'noci', 'value_skipinit'):
    assert table[name]['paper'] and table[name]['summary']


# ------------------------------------------------------------------------------------------------
# DeepNorm (Wang et al. 2022, Table 1): α = (2N)^{1/4}, β = (8N)^{-1/4}.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', ['gpt', 'vit'])
@pytest.mark.parametrize('depth', DEPTHS)
def test_deepnorm_plan(name, depth):
  d = 32
  config = _config('deepnorm', name, depth=depth, width=d)
  plan = _plan(config)
  alpha, beta = (2 * depth) ** 0.25, (8 * depth) ** -0.25
  for key in ('skip_attn', 'skip_ffn'):
    np.testing.assert_allclose(plan.layer[key], alpha, rtol=1e-6)
    assert plan.layer[key].shape == (depth,)
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_allclose(plan.layer[key], 1.0, rtol=1e-6)
  _check_xavier_qk(plan, d)
  for key in ('v', 'o'):
    np.testing.assert_allclose(plan.layer[key], beta * _xavier(d, d), rtol=1e-6, err_msg=key)
  for key in ('ffn1', 'ffn2'):
    np.testing.assert_allclose(plan.layer[key], beta * _xavier(d, 4 * d), rtol=1e-6, err_msg=key)
  assert not plan.skip.learnable and not plan.branch.learnable and not plan.skip.vector
  assert plan.layout is None and plan.attn_logit_scale is None and not plan.attn_identity


@pytest.mark.parametrize('depth', DEPTHS)
def test_deepnorm_built_model(depth):
  d = 32
  config = _config('deepnorm', 'gpt', depth=depth, width=d)
  alpha, beta = (2 * depth) ** 0.25, (8 * depth) ** -0.25
  model = _build(config)
  block = model.trunk.stack.layers
  assert _stack_norms(block) == POSTLN_NORMS and model.trunk.final_norm is None
  for key in ('skip_attn', 'skip_ffn'):
    scale = getattr(block, key)
    assert isinstance(scale, layers.Constant)
    chex.assert_shape(scale[...], (depth,))
    np.testing.assert_allclose(scale[...], alpha, rtol=1e-6)
  for key in ('branch_attn', 'branch_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
    np.testing.assert_allclose(getattr(block, key)[...], 1.0)
  # Sample stds of the draws: β·Xavier for V, O and the FFN, Xavier for Q and K.
  expected = {'q': _xavier(d, d), 'k': _xavier(d, d), 'v': beta * _xavier(d, d), 'o': beta * _xavier(d, d),
              'ffn1': beta * _xavier(d, 4 * d), 'ffn2': beta * _xavier(4 * d, d)}
  kernels = {'q': block.attn.q, 'k': block.attn.k, 'v': block.attn.v, 'o': block.attn.o,
             'ffn1': block.ffn.ffn1, 'ffn2': block.ffn.ffn2}
  for key, dense in kernels.items():
    np.testing.assert_allclose(_kernel_std(dense), expected[key], rtol=0.04, err_msg=key)


def test_deepnorm_constants_are_config_fields():
  config = _config('deepnorm', depth=8)
  c = config.model.deepnorm
  c.alpha_base, c.alpha_exponent, c.beta_base, c.beta_exponent = 3.0, 0.5, 12.0, 0.5
  plan = _plan(config)
  np.testing.assert_allclose(plan.layer['skip_ffn'], (3.0 * 8) ** 0.5, rtol=1e-6)
  np.testing.assert_allclose(plan.layer['v'], (12.0 * 8) ** -0.5 * _xavier(32, 32), rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Noci et al. 2022: α² = α̃/L at both adds, logits × τ/sqrt(d_head).
# ------------------------------------------------------------------------------------------------

def _tau_eq47(d, n, rho):
  return math.sqrt(d * n * (1 + rho * (n - 1)) / ((1 - rho) ** 2 * (n + d) * (n - 1)))


@pytest.mark.parametrize('block', ['preln', 'postln'])
@pytest.mark.parametrize('depth', DEPTHS)
def test_noci_plan_and_model(depth, block):
  d, heads = 32, 4
  config = _config('noci', 'gpt', depth=depth, width=d, num_heads=heads, block=block)
  plan = _plan(config)
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_allclose(plan.layer[key], math.sqrt(1.0 / depth), rtol=1e-6)
  for key in ('skip_attn', 'skip_ffn'):
    np.testing.assert_allclose(plan.layer[key], 1.0)
  np.testing.assert_allclose(plan.attn_logit_scale, 1.0 / math.sqrt(d // heads), rtol=1e-6)   # τ = 1
  _check_xavier_qk(plan, d)
  np.testing.assert_allclose(plan.layer['v'], _xavier(d, d), rtol=1e-6)
  model = _build(config)
  block_ = model.trunk.stack.layers
  assert _stack_norms(block_) == (PRELN_NORMS if block == 'preln' else POSTLN_NORMS)
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
  config = _config('noci', name, depth=depth, width=d, num_heads=heads)
  config.model.noci.alpha_tilde = 2.0
  config.model.noci.tau = 'formula'
  config.model.noci.rho = 0.3
  config_lib.validate_config(config, num_devices=1)
  dims = models.model_dims(config.model, INFO[name], seq_len=config.data.seq_len)
  n = dims.seq_len                                         # GPT: data.seq_len; ViT: (8/2)² patches
  assert n == 16
  plan = _plan(config)
  tau = _tau_eq47(d, n, 0.3)
  np.testing.assert_allclose(plan.attn_logit_scale, tau / math.sqrt(d // heads), rtol=1e-6)
  np.testing.assert_allclose(plan.layer['branch_ffn'], math.sqrt(2.0 / depth), rtol=1e-6)
  model = _build(config)
  np.testing.assert_allclose(model.trunk.stack.layers.attn.logit_scale, tau / math.sqrt(d // heads),
                             rtol=1e-6)
  # ρ = 0: τ² = d·n/((n+d)(n−1)); a number is taken as it is.
  config.model.noci.rho = 0.0
  np.testing.assert_allclose(_plan(config).attn_logit_scale * math.sqrt(d // heads),
                             math.sqrt(d * n / ((n + d) * (n - 1))), rtol=1e-6)
  config.model.noci.tau = 8.5
  np.testing.assert_allclose(_plan(config).attn_logit_scale, 8.5 / math.sqrt(d // heads), rtol=1e-6)


def test_noci_learnable_alpha():
  config = _config('noci', depth=4)
  config.model.noci.learnable_alpha = True
  block = _build(config).trunk.stack.layers
  assert isinstance(block.branch_attn, nnx.Param) and isinstance(block.branch_ffn, nnx.Param)
  assert isinstance(block.skip_attn, layers.Constant)


# ------------------------------------------------------------------------------------------------
# Value-SkipInit (He et al. 2023): no attention skip, attention matrix α·I + β·A with α = 1, β = 0.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('block', ['preln', 'postln', 'nonorm'])
@pytest.mark.parametrize('depth', DEPTHS)
def test_value_skipinit_plan_and_model(depth, block):
  d = 32
  config = _config('value_skipinit', 'gpt', depth=depth, width=d, block=block)
  plan = _plan(config)
  np.testing.assert_array_equal(plan.layer['skip_attn'], np.zeros(depth))
  for key in ('skip_ffn', 'branch_attn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.ones(depth))
  assert plan.attn_identity and not plan.skip.learnable
  _check_xavier_qk(plan, d)
  model = _build(config)
  block_ = model.trunk.stack.layers
  assert isinstance(block_.skip_attn, layers.Constant)
  np.testing.assert_array_equal(block_.skip_attn[...], np.zeros(depth))
  np.testing.assert_array_equal(block_.skip_ffn[...], np.ones(depth))
  attn = block_.attn
  assert isinstance(attn.mix_identity, nnx.Param) and isinstance(attn.mix_attention, nnx.Param)
  chex.assert_shape([attn.mix_identity[...], attn.mix_attention[...]], (depth,))
  np.testing.assert_array_equal(attn.mix_identity[...], np.ones(depth))
  np.testing.assert_array_equal(attn.mix_attention[...], np.zeros(depth))
  expected_norms = {'preln': PRELN_NORMS, 'postln': POSTLN_NORMS}.get(block, {k: False for k in PRELN_NORMS})
  assert _stack_norms(block_) == expected_norms


@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_value_skipinit_attention_is_the_identity_at_init(name):
  """The attention module's output is o(v(x)) on random x: the identity attention matrix."""
  d = 32
  model = _build(_config('value_skipinit', name, depth=4, width=d))
  for n in (0, 3):
    attn = _layer(model.trunk.stack.layers.attn, n)
    x = jax.random.normal(jax.random.key(n), (3, 16, d))
    out = attn(x, None)
    chex.assert_shape(out, (3, 16, d))
    np.testing.assert_allclose(np.asarray(out), np.asarray(attn.o(attn.v(x))), rtol=1e-5, atol=1e-6)
    # Once β moves away from 0 the attention mixes tokens again.
    attn.mix_attention[...] = jnp.ones(())
    assert not np.allclose(np.asarray(attn(x, None)), np.asarray(attn.o(attn.v(x))), atol=1e-3)


# ------------------------------------------------------------------------------------------------
# ADMIN (Liu et al. 2020): x_{k+1} = LN(x_k ⊙ ω_k + F_k), ω_k² = Var[x_0] + Σ_{j<k} Var[F_j].
# ------------------------------------------------------------------------------------------------

def _check_admin_model(model, omega, depth, d):
  block = model.trunk.stack.layers
  assert _stack_norms(block) == POSTLN_NORMS and model.trunk.final_norm is None
  for key, values in (('skip_attn', omega[0::2]), ('skip_ffn', omega[1::2])):
    scale = getattr(block, key)
    assert isinstance(scale, nnx.Param), key                      # learnable, one vector per add
    chex.assert_shape(scale[...], (depth, d))
    np.testing.assert_allclose(np.asarray(scale[...]), np.broadcast_to(values[:, None], (depth, d)),
                               rtol=1e-5)
  for key in ('branch_attn', 'branch_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
    np.testing.assert_allclose(getattr(block, key)[...], 1.0)


@pytest.mark.parametrize('depth', DEPTHS)
def test_admin_log_omega(depth):
  d = 32
  config = _config('admin', depth=depth, width=d)
  config.model.admin.omega = 'log'
  assert not schemes.get('admin').needs_preparation(config.model)
  n = 2 * depth                                              # residual sub-layers
  omega = np.full(n, math.sqrt((n + 1) / math.log(n + 1) - 1))
  plan = _plan(config)
  np.testing.assert_allclose(plan.layer['skip_attn'], omega[0::2], rtol=1e-6)
  np.testing.assert_allclose(plan.layer['skip_ffn'], omega[1::2], rtol=1e-6)
  assert plan.skip.learnable and plan.skip.vector and not plan.branch.learnable
  _check_xavier_qk(plan, d)
  np.testing.assert_allclose(plan.layer['ffn1'], _xavier(d, 4 * d), rtol=1e-6)
  _check_admin_model(_build(config), omega, depth, d)


@pytest.mark.parametrize('depth', DEPTHS)
def test_admin_closed_form_omega(depth):
  """ω² from dsjax.theory's prediction for the ω = 1 Post-LN model: Var[x_0] + the earlier branch variances."""
  d, V = 32, TEXT_INFO.vocab_size
  config = _config('admin', depth=depth, width=d)
  config.model.admin.omega = 'closed_form'
  plan = _plan(config)
  table_var = 2 / (V + d)                                   # Xavier token and position tables
  r_word = math.pi ** 2 / (6 * math.log(V) ** 2)            # Zipf (Kedia et al. 2024, App. A.1)
  prop = theory.model.propagate(
      depth=depth, width=d, num_heads=4, seq_len=16, dropout=0.0, attn_dropout=0.0, activation='gelu',
      block='postln', causal=True, input=theory.Stats(var=2 * table_var, corr_seq=r_word / 2))
  # Var[ω_k·x_k] = Var[x_0] + Σ_{j<k} Var[F_j]: ω_0 = 1 (x_0 enters as it is), unit-variance x_k after.
  expected = 2 * table_var + np.concatenate([[0.0], np.cumsum(prop.branch_var)[:-1]])
  expected[0] = 1.0
  np.testing.assert_allclose(plan.layer['skip_attn'] ** 2, expected[0::2], rtol=1e-5)
  np.testing.assert_allclose(plan.layer['skip_ffn'] ** 2, expected[1::2], rtol=1e-5)
  assert np.all(np.diff(expected[1:]) > 0)
  _check_admin_model(_build(config), np.sqrt(expected), depth, d)


def test_admin_profiled_omega_equals_its_closed_form_on_a_linear_toy():
  """A Post-LN stack with linear branches F_k(x) = x·W_k: the theory's variances are exact there
  (Var[F_k] = d·σ_k²·Var[x_k], Var[x_k] = 1 after a LayerNorm), so the profile — the same probe
  recording, pooling and cumulation the model's profile uses — must equal the closed form up to
  sampling error."""
  d, depth, input_var = 256, 3, 0.3
  num = 2 * depth
  w_vars = np.linspace(0.5, 2.0, num) / d
  keys = jax.random.split(jax.random.key(0), num)
  params = [jax.random.normal(k, (d, d)) * math.sqrt(v) for k, v in zip(keys, w_vars)]

  def layer_norm(x):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)

  def apply(params, x, key, probe):
    del key
    x = probe('embedding', x, jnp.asarray(-1))
    for k, w in enumerate(params):
      h = probe(admin.BRANCH_SITES[k % 2], x @ w, jnp.asarray(k // 2))
      x = layer_norm(x + h)          # ω = 1, as in the profiling pass
    return x

  inputs = [jax.random.normal(jax.random.key(10 + i), (8, 64, d)) * math.sqrt(input_var) for i in range(4)]
  profiled = admin.profile_variances(apply, params, inputs, num)
  assert profiled['num_batches'] == 4 and len(profiled['omega_sq']) == num
  json.dumps(profiled)                                      # flat and JSON-able

  x_stats = [theory.Stats(var=input_var)] + [theory.Stats(var=1.0)] * (num - 1)
  branch_var = [theory.components.linear(x, theory.GradStats(), d_in=d, d_out=d, w_var=v)[0].var
                for x, v in zip(x_stats, w_vars)]
  closed = admin.omega_sq_from_variances(input_var, branch_var)
  np.testing.assert_allclose(closed[1:], input_var + np.cumsum(branch_var)[:-1])
  assert closed[0] == 1.0 and profiled['omega_sq'][0] == 1.0
  # Weight draws and 4·8·64·256 samples: the pooled variances are within ~2% of their expectation.
  np.testing.assert_allclose(profiled['omega_sq'], closed, rtol=0.03)
  np.testing.assert_allclose(profiled['branch_var'], branch_var, rtol=0.05)


def test_admin_profile_on_a_tiny_gpt_matches_the_closed_form_and_sets_omega():
  depth, d = 4, 64
  config = _config('admin', depth=depth, width=d)
  config.batch_size = 32
  info = data_lib.dataset_info(config.data)
  scheme = schemes.get('admin')
  assert scheme.needs_preparation(config.model)
  with pytest.raises(ValueError, match='needs the profiling result'):
    _build(config, info)
  prepared = scheme.prepare(config, info, state_lib.first_model_inputs(config))
  assert prepared['num_batches'] == admin.PROFILE_BATCHES and len(prepared['omega_sq']) == 2 * depth
  json.dumps(prepared)
  # The profile's input variance is the model's embedding variance (same seed, same weights).
  model = _build(config, info, prepared)
  tokens = next(state_lib.first_model_inputs(config))
  np.testing.assert_allclose(prepared['input_var'], float(jnp.var(model.embed(tokens))), rtol=0.1)
  _check_admin_model(model, np.sqrt(np.asarray(prepared['omega_sq'])), depth, d)

  closed = config.model.copy_and_resolve_references()
  closed.admin.omega = 'closed_form'
  plan = schemes.make_init_plan(closed, models.model_dims(config.model, info, seq_len=config.data.seq_len))
  closed_sq = np.stack([plan.layer['skip_attn'], plan.layer['skip_ffn']], 1).reshape(-1) ** 2
  np.testing.assert_allclose(prepared['omega_sq'], closed_sq, rtol=0.2)
  # A profile of another depth is refused.
  config.model.depth = depth + 1
  with pytest.raises(ValueError, match='residual sub-layers'):
    _build(config, info, prepared)


# ------------------------------------------------------------------------------------------------
# Config checks.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('scheme,name,key,value,message', [
    ('deepnorm', 'gpt', 'block', 'preln', 'model.block'),
    ('deepnorm', 'gpt', 'deepnorm.alpha_base', -1.0, 'model.deepnorm.alpha_base'),
    ('noci', 'gpt', 'block', 'dnt', 'model.block'),
    ('noci', 'gpt', 'noci.tau', 'hot', 'model.noci.tau'),
    ('noci', 'gpt', 'noci.tau', 0.0, 'model.noci.tau'),
    ('noci', 'gpt', 'noci.rho', 1.0, 'model.noci.rho'),
    ('noci', 'gpt', 'noci.alpha_tilde', 0.0, 'model.noci.alpha_tilde'),
    ('admin', 'gpt', 'block', 'preln', 'model.block'),
    ('admin', 'gpt', 'admin.omega', 'guess', 'model.admin.omega'),
    ('admin', 'vit', 'admin.input_corr', 'zipf', 'model.admin.input_corr'),
    ('admin', 'gpt', 'admin.input_corr', 2.0, 'model.admin.input_corr'),
    ('value_skipinit', 'gpt', 'block', 'dnt', 'model.block'),
])
def test_bad_configs_fail_in_validate(scheme, name, key, value, message):
  config = _config(scheme, name)
  section, _, field = key.rpartition('.')
  (config.model[section] if section else config.model)[field] = value
  with pytest.raises(ValueError, match=re.escape(message)) as err:
    config_lib.validate_config(config, num_devices=1)
  assert '\n' not in str(err.value)


# ------------------------------------------------------------------------------------------------
# Training smoke runs.
# ------------------------------------------------------------------------------------------------

def _smoke_config(scheme, name, total_steps=3):
  config = _config(scheme, name)
  config.total_steps = total_steps
  config.eval_every = config.checkpoint_every = config.log_every = 3
  config.mesh.shape = (1, 1, 1)   # one device: compiling for the 8 simulated ones costs a third more
  return config


def _train(config, workdir):
  return loop.train_and_evaluate(config, str(workdir), devices=jax.devices()[:1])


@pytest.mark.slow  # The default run trains every method in tests/test_schemes.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
@pytest.mark.parametrize('scheme', ['deepnorm', 'noci', 'value_skipinit'])
def test_three_training_steps(tmp_path, scheme, name):
  final = _train(_smoke_config(scheme, name), tmp_path)
  assert np.isfinite(final['eval/loss'])
  assert not os.path.exists(os.path.join(tmp_path, schemes.PREPARATION_FILE))


@pytest.mark.slow  # Kept out of the default suite for its time (> 20 s).
def test_admin_training_profiles_saves_and_resumes_from_the_saved_profile(tmp_path, monkeypatch):
  config = _smoke_config('admin', 'gpt')
  final = _train(config, tmp_path)
  assert np.isfinite(final['eval/loss'])
  path = os.path.join(tmp_path, schemes.PREPARATION_FILE)
  with open(path) as f:
    saved = json.load(f)
  assert saved['scheme'] == 'admin' and len(saved['result']['omega_sq']) == 2 * config.model.depth
  # The resumed run reads the profile back instead of profiling again.
  monkeypatch.setattr(admin.Admin, 'prepare', lambda *args: pytest.fail('profiled again on resume'))
  config.total_steps = 5
  config.eval_every = config.checkpoint_every = 5
  final = _train(config, tmp_path)
  assert np.isfinite(final['eval/loss'])
  with open(path) as f:
    assert json.load(f) == saved
  with open(os.path.join(tmp_path, 'metrics.jsonl')) as f:
    steps = {json.loads(line).get('step') for line in f}
  assert 5 in steps


@pytest.mark.slow  # The default run trains every method in tests/test_schemes.py.
def test_admin_training_on_vit(tmp_path):
  final = _train(_smoke_config('admin', 'vit'), tmp_path)
  assert np.isfinite(final['eval/loss'])
  assert os.path.exists(os.path.join(tmp_path, schemes.PREPARATION_FILE))
