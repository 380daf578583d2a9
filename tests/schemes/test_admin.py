"""ADMIN (Liu et al. 2020, `dsjax.schemes.admin`): x_{k+1} = LN(x_k ⊙ ω_k + F_k),
ω_k² = Var[x_0] + Σ_{j<k} Var[F_j], ω learnable.

The plan and the built model at two depths for the log and closed-form ω, the profile against its closed
form (a linear toy and a tiny GPT), the config checks, and training: the profile saved and read back on
resume, and ViT. Expected values are written out here from the paper's formulas.
"""

import json
import math
import os

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
from dsjax.train import state as state_lib
from tests.helpers import TEXT_INFO
from tests.schemes.common import (
  DEPTHS,
  POSTLN_NORMS,
  assert_rejected,
  build,
  check_xavier_qk,
  init_plan,
  loop_config,
  method_config,
  norms_present,
  registered,
  train_on_one_device,
  xavier_std,
)


def test_registered_with_its_blocks():
  assert registered('admin')['blocks'] == ('postln',)


def _check_admin_model(model, omega, depth, d):
  block = model.trunk.stack.layers
  assert norms_present(block) == POSTLN_NORMS and model.trunk.final_norm is None
  for key, values in (('skip_attn', omega[0::2]), ('skip_ffn', omega[1::2])):
    scale = getattr(block, key)
    assert isinstance(scale, nnx.Param), key  # learnable, one vector per add
    chex.assert_shape(scale[...], (depth, d))
    np.testing.assert_allclose(
      np.asarray(scale[...]), np.broadcast_to(values[:, None], (depth, d)), rtol=1e-5
    )
  for key in ('branch_attn', 'branch_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
    np.testing.assert_allclose(getattr(block, key)[...], 1.0)


@pytest.mark.parametrize('depth', DEPTHS)
def test_admin_log_omega(depth):
  d = 32
  config = method_config('admin', depth=depth, width=d)
  config.model.admin.omega = 'log'
  assert not schemes.get('admin').needs_preparation(config.model)
  n = 2 * depth  # residual sub-layers
  omega = np.full(n, math.sqrt((n + 1) / math.log(n + 1) - 1))
  plan = init_plan(config)
  np.testing.assert_allclose(plan.layer['skip_attn'], omega[0::2], rtol=1e-6)
  np.testing.assert_allclose(plan.layer['skip_ffn'], omega[1::2], rtol=1e-6)
  assert plan.skip.learnable and plan.skip.vector and not plan.branch.learnable
  check_xavier_qk(plan, d)
  np.testing.assert_allclose(plan.layer['ffn1'], xavier_std(d, 4 * d), rtol=1e-6)
  _check_admin_model(build(config), omega, depth, d)


@pytest.mark.parametrize('depth', DEPTHS)
def test_admin_closed_form_omega(depth):
  """ω² from dsjax.theory's prediction for the ω = 1 Post-LN model: Var[x_0] + the earlier branch
  variances."""
  d, V = 32, TEXT_INFO.vocab_size
  config = method_config('admin', depth=depth, width=d)
  config.model.admin.omega = 'closed_form'
  plan = init_plan(config)
  table_var = 2 / (V + d)  # Xavier token and position tables
  r_word = math.pi**2 / (6 * math.log(V) ** 2)  # Zipf (Kedia et al. 2024, App. A.1)
  prop = theory.model.propagate(
    depth=depth,
    width=d,
    num_heads=4,
    seq_len=16,
    dropout=0.0,
    attn_dropout=0.0,
    activation='gelu',
    block='postln',
    causal=True,
    input=theory.Stats(var=2 * table_var, corr_seq=r_word / 2),
  )
  # Var[ω_k·x_k] = Var[x_0] + Σ_{j<k} Var[F_j]: ω_0 = 1 (x_0 enters as it is), unit-variance x_k after.
  expected = 2 * table_var + np.concatenate([[0.0], np.cumsum(prop.branch_var)[:-1]])
  expected[0] = 1.0
  np.testing.assert_allclose(plan.layer['skip_attn'] ** 2, expected[0::2], rtol=1e-5)
  np.testing.assert_allclose(plan.layer['skip_ffn'] ** 2, expected[1::2], rtol=1e-5)
  assert np.all(np.diff(expected[1:]) > 0)
  _check_admin_model(build(config), np.sqrt(expected), depth, d)


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
      x = layer_norm(x + h)  # ω = 1, as in the profiling pass
    return x

  inputs = [jax.random.normal(jax.random.key(10 + i), (8, 64, d)) * math.sqrt(input_var) for i in range(4)]
  profiled = admin.profile_variances(apply, params, inputs, num)
  assert profiled['num_batches'] == 4 and len(profiled['omega_sq']) == num
  json.dumps(profiled)  # flat and JSON-able

  x_stats = [theory.Stats(var=input_var)] + [theory.Stats(var=1.0)] * (num - 1)
  branch_var = [
    theory.components.linear(x, theory.GradStats(), d_in=d, d_out=d, w_var=v)[0].var
    for x, v in zip(x_stats, w_vars)
  ]
  closed = admin.omega_sq_from_variances(input_var, branch_var)
  np.testing.assert_allclose(closed[1:], input_var + np.cumsum(branch_var)[:-1])
  assert closed[0] == 1.0 and profiled['omega_sq'][0] == 1.0
  # Weight draws and 4·8·64·256 samples: the pooled variances are within ~2% of their expectation.
  np.testing.assert_allclose(profiled['omega_sq'], closed, rtol=0.03)
  np.testing.assert_allclose(profiled['branch_var'], branch_var, rtol=0.05)


def test_admin_profile_on_a_tiny_gpt_matches_the_closed_form_and_sets_omega():
  depth, d = 4, 64
  config = method_config('admin', depth=depth, width=d)
  config.batch_size = 32
  info = data_lib.dataset_info(config.data)
  scheme = schemes.get('admin')
  assert scheme.needs_preparation(config.model)
  with pytest.raises(ValueError, match='needs the profiling result'):
    build(config, info)
  prepared = scheme.prepare(config, info, state_lib.first_model_inputs(config))
  assert prepared['num_batches'] == admin.PROFILE_BATCHES and len(prepared['omega_sq']) == 2 * depth
  json.dumps(prepared)
  # The profile's input variance is the model's embedding variance (same seed, same weights).
  model = build(config, info, prepared)
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
    build(config, info, prepared)


@pytest.mark.parametrize(
  'name,key,value,message',
  [
    ('gpt', 'block', 'preln', 'model.block'),
    ('gpt', 'admin.omega', 'guess', 'model.admin.omega'),
    ('vit', 'admin.input_corr', 'zipf', 'model.admin.input_corr'),
    ('gpt', 'admin.input_corr', 2.0, 'model.admin.input_corr'),
  ],
)
def test_bad_configs_fail_in_validate(name, key, value, message):
  assert_rejected(method_config('admin', name), key, value, message)


# ------------------------------------------------------------------------------------------------
# Training: the profile is taken once, saved with the run and read back on resume.
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # Kept out of the default suite for its time (> 20 s).
def test_admin_training_profiles_saves_and_resumes_from_the_saved_profile(tmp_path, monkeypatch):
  config = loop_config('admin', 'gpt')
  final = train_on_one_device(config, tmp_path)
  assert np.isfinite(final['eval/loss'])
  path = os.path.join(tmp_path, schemes.PREPARATION_FILE)
  with open(path) as f:
    saved = json.load(f)
  assert saved['scheme'] == 'admin' and len(saved['result']['omega_sq']) == 2 * config.model.depth
  # The resumed run reads the profile back instead of profiling again.
  monkeypatch.setattr(admin.Admin, 'prepare', lambda *args: pytest.fail('profiled again on resume'))
  config.total_steps = 5
  config.eval_every = config.checkpoint_every = 5
  final = train_on_one_device(config, tmp_path)
  assert np.isfinite(final['eval/loss'])
  with open(path) as f:
    assert json.load(f) == saved
  with open(os.path.join(tmp_path, 'metrics.jsonl')) as f:
    steps = {json.loads(line).get('step') for line in f}
  assert 5 in steps


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
def test_admin_training_on_vit(tmp_path):
  final = train_on_one_device(loop_config('admin', 'vit'), tmp_path)
  assert np.isfinite(final['eval/loss'])
  assert os.path.exists(os.path.join(tmp_path, schemes.PREPARATION_FILE))
