"""Noci et al. 2022 (`dsjax.schemes.noci`): α² = α̃/L at both adds, attention logits × τ/sqrt(d_head),
τ from Eq. 47 with the attention input's measured ρ and σx², warmed up over the first training steps.

The plan and the built model at two depths on Pre-LN and Post-LN, the temperature formula (their Eq. 47)
against a hand computation, the measured token correlation (identical tokens, random tokens), the
warm-up factor and the train step that sets it, α̃, learnable α, the config checks and short training
runs of GPT and ViT. Expected values are written out here from the paper's formulas.
"""

import math
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsjax import data as data_lib
from dsjax import models, schemes
from dsjax.models import layers
from dsjax.schemes import noci
from dsjax.train import config as config_lib
from dsjax.train import sharding as sharding_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib
from tests.schemes.common import (
  DEPTHS,
  INFO,
  POSTLN_NORMS,
  PRELN_NORMS,
  assert_rejected,
  build,
  check_xavier_qk,
  init_plan,
  loop_config,
  method_config,
  norms_present,
  random_tokens,
  registered,
  train_on_one_device,
  xavier_std,
)

MEASURED = {'rho': 0.2, 'sigma_x2': 0.9}  # a preparation result (the keys the plan reads)


def test_registered_with_its_blocks():
  blocks = registered('noci')['blocks']
  assert blocks[0] == 'preln' and 'postln' in blocks


def _tau_eq47(d, n, rho, sigma_x2=1.0):
  return math.sqrt(d * n * (1 + rho * (n - 1)) / (sigma_x2**2 * (1 - rho) ** 2 * (n + d) * (n - 1)))


def test_eq47_against_a_hand_computation():
  """d = 4, n = 3, ρ = 1/2, σx² = 2: τ² = 4·3·(1 + 1/2·2) / (2²·(1/2)²·(3+4)·(3−1)) = 24/14."""
  np.testing.assert_allclose(noci.tau_formula(4, 3, 0.5, 2.0), math.sqrt(24 / 14), rtol=1e-12)
  # ρ = 0, σx² = 1: τ² = d·n/((n+d)(n−1)) = 128·128/(256·127) = 64/127.
  np.testing.assert_allclose(noci.tau_formula(128, 128, 0.0), math.sqrt(64 / 127), rtol=1e-12)
  with pytest.raises(ValueError, match='ρ < 1'):
    noci.tau_formula(4, 3, 1.0)


@pytest.mark.parametrize('block', ['preln', 'postln'])
@pytest.mark.parametrize('depth', DEPTHS)
def test_noci_plan_and_model(depth, block):
  d, heads, n = 32, 4, 16
  config = method_config('noci', 'gpt', depth=depth, width=d, num_heads=heads, block=block)
  assert config.model.noci.tau == 'measure' and config.model.noci.tau_warmup_steps == 100  # the defaults
  with pytest.raises(ValueError, match="tau='measure' needs the measured"):
    init_plan(config)
  dims = models.model_dims(config.model, INFO['gpt'], seq_len=n)
  plan = schemes.make_init_plan(config.model, dims, MEASURED)
  tau = _tau_eq47(d, n, 0.2, 0.9)
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_allclose(plan.layer[key], math.sqrt(1.0 / depth), rtol=1e-6)
  for key in ('skip_attn', 'skip_ffn'):
    np.testing.assert_allclose(plan.layer[key], 1.0)
  np.testing.assert_allclose(plan.attn_logit_scale, tau / math.sqrt(d // heads), rtol=1e-6)
  assert plan.attn_logit_warmup_steps == 100
  check_xavier_qk(plan, d)
  np.testing.assert_allclose(plan.layer['v'], xavier_std(d, d), rtol=1e-6)
  model = build(config, prepared=MEASURED)
  block_ = model.trunk.stack.layers
  assert norms_present(block_) == (PRELN_NORMS if block == 'preln' else POSTLN_NORMS)
  for key in ('branch_attn', 'branch_ffn'):
    scale = getattr(block_, key)
    assert isinstance(scale, layers.Constant)
    chex.assert_shape(scale[...], (depth,))
    np.testing.assert_allclose(scale[...], math.sqrt(1.0 / depth), rtol=1e-6)
  np.testing.assert_allclose(block_.attn.logit_scale, tau / math.sqrt(d // heads), rtol=1e-6)
  # The warm-up factor, one per layer, is 1 as built (evaluation uses the final τ).
  np.testing.assert_array_equal(block_.attn.logit_factor[...], np.ones(depth, np.float32))


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
  block = build(config, prepared=MEASURED).trunk.stack.layers
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
    ('gpt', 'noci.tau_warmup_steps', -1, 'model.noci.tau_warmup_steps'),
  ],
)
def test_bad_configs_fail_in_validate(name, key, value, message):
  assert_rejected(method_config('noci', name), key, value, message)


# ------------------------------------------------------------------------------------------------
# The measured ρ and σx² (the preparation step).
# ------------------------------------------------------------------------------------------------


def _loop_model(config):
  """The model of `config` with the plain softmax, its layers in a Python loop (as the measurement runs)."""
  config.model.noci.tau, config.model.scan_layers = 1.0, False
  return build(config)


@pytest.mark.parametrize('block', ['preln', 'postln'])
def test_identical_tokens_are_measured_fully_correlated(block):
  """Without position embeddings, a sequence of one repeated token is the same vector at every position
  of every layer: ρ = 1 at every attention input."""
  config = method_config('noci', 'gpt', depth=3, block=block)
  model = _loop_model(config)
  model.pos_embedding.set_value(jnp.zeros_like(model.pos_embedding[...]))
  tokens = jnp.full((4, 16), 7, jnp.int32)
  norm = layers.Norm(32, kind='layernorm', eps=1e-6) if block == 'preln' else None
  result = noci.attention_input_moments(model, norm, [tokens])
  assert result['num_batches'] == 1 and len(result['corr_seq']) == 3
  np.testing.assert_allclose(result['corr_seq'], 1.0, atol=1e-4)
  if block == 'preln':  # a LayerNorm output has variance 1 (up to its eps)
    np.testing.assert_allclose(result['var'], 1.0, rtol=1e-3)


def test_random_tokens_are_measured_nearly_uncorrelated():
  """Random tokens with learned positions: the embedded input (layer 0's attention input) is nearly
  uncorrelated; the preparation step returns ρ, σx² as the means over layers and τ by Eq. 47."""
  config = method_config('noci', 'gpt', depth=2)
  tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, 256)
  result = schemes.get('noci').prepare(config, INFO['gpt'], iter([tokens, tokens]))
  assert result['num_batches'] == 1  # the first batch only
  assert abs(result['rho_per_layer'][0]) < 0.05
  np.testing.assert_allclose(result['rho'], np.mean(result['rho_per_layer']), rtol=1e-12)
  np.testing.assert_allclose(result['sigma_x2'], np.mean(result['sigma_x2_per_layer']), rtol=1e-12)
  np.testing.assert_allclose(result['sigma_x2'], 1.0, rtol=1e-3)  # Pre-LN: LayerNorm outputs
  assert result['n'] == 16
  expected = _tau_eq47(32, 16, max(result['rho'], 0.0), result['sigma_x2'])
  np.testing.assert_allclose(result['tau'], expected, rtol=1e-9)
  dims = models.model_dims(config.model, INFO['gpt'], seq_len=16)
  plan = schemes.make_init_plan(config.model, dims, result)
  np.testing.assert_allclose(plan.attn_logit_scale, expected / math.sqrt(8), rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# The warm-up of τ.
# ------------------------------------------------------------------------------------------------


def test_warmup_factor_at_start_half_and_end():
  """τ = τ_final·min(1, step/W) (App. C.3, read as a warm-up): 0, 1/2, 1, and 1 after."""
  factors = [float(layers.warmup_factor(step, 100)) for step in (0, 50, 100, 250)]
  assert factors == [0.0, 0.5, 1.0, 1.0]


def _tau_model(tau, warmup):
  config = method_config('noci', 'gpt', depth=2)
  config.model.noci.tau, config.model.noci.tau_warmup_steps = tau, warmup
  return config, build(config)


def test_warmed_up_model_is_the_model_of_the_scaled_temperature():
  """Halfway through the warm-up the model computes what the model of τ/2 without a warm-up computes;
  without a warm-up the model has no factor."""
  _, warmed = _tau_model(8.0, 10)
  _, half = _tau_model(4.0, 0)
  _, final = _tau_model(8.0, 0)
  assert half.trunk.stack.layers.attn.logit_factor is None
  tokens = random_tokens()
  np.testing.assert_array_equal(warmed(tokens), final(tokens))  # as built: the final τ
  models.set_training_step(warmed, jnp.asarray(5))
  np.testing.assert_array_equal(warmed.trunk.stack.layers.attn.logit_factor[...], [0.5, 0.5])
  np.testing.assert_allclose(warmed(tokens), half(tokens), rtol=1e-5, atol=1e-6)
  assert not np.allclose(warmed(tokens), final(tokens), rtol=1e-3)


def test_train_step_warms_up_and_eval_step_uses_the_final_temperature():
  """The train step's loss at state step 5 of a 10-step warm-up is the loss of τ/2; the eval step's is
  the loss of τ."""
  config, _ = _tau_model(8.0, 10)
  batch = {'tokens': jax.random.randint(jax.random.key(2), (4, 17), 0, 256)}
  setup = state_lib.make_setup(config, INFO['gpt'])
  state = setup.create_state()
  state['step'] = jnp.asarray(5, jnp.int32)
  step = step_lib.make_train_step(
    setup.graphdef, setup.tx, step_lib.lm_loss, config.seed, setup.schedule, use_dropout=False
  )
  _, metrics = jax.jit(step)(state, batch)
  loss = lambda model: float(step_lib.lm_loss(model, batch, None)[0])
  np.testing.assert_allclose(float(metrics['train/loss']), loss(_tau_model(4.0, 0)[1]), rtol=1e-5)
  sums = step_lib.make_eval_step(setup.graphdef, step_lib.lm_loss)(state, batch)
  final = loss(_tau_model(8.0, 0)[1])
  np.testing.assert_allclose(float(sums['loss_sum'] / sums['count']), final, rtol=1e-5)


def test_warmup_factor_is_a_replicated_constant_of_the_state():
  """The factor lives in the non-trainable state, one per layer, and shards (replicated) on a mesh."""
  config, _ = _tau_model(8.0, 10)
  setup = state_lib.make_setup(config, INFO['gpt'])
  state = jax.eval_shape(setup.create_state)
  assert state['rest']['trunk']['stack']['layers']['attn']['logit_factor'].shape == (2,)
  assert 'logit_factor' not in state['params']['trunk']['stack']['layers']['attn']
  mesh = sharding_lib.make_mesh((2, 2, 2), jax.devices()[:8])
  shardings = sharding_lib.state_shardings(state, sharding_lib.logical_axes(setup.abstract_model), mesh)
  assert shardings['rest']['trunk']['stack']['layers']['attn']['logit_factor'].spec == P(None)


def test_tiny_gpt_measures_tau_and_trains_finite():
  """The trainer's pieces on real batches: the preparation step measures ρ, σx² and τ, and three
  warmed-up train steps are finite."""
  config = method_config('noci', 'gpt', depth=2)
  config.model.noci.tau_warmup_steps = 2
  config_lib.validate_config(config, num_devices=1)
  info = data_lib.dataset_info(config.data)
  prepared = state_lib.method_preparation(config, info)
  assert 0 < prepared['rho'] < 1 and prepared['tau'] > 0
  setup = state_lib.make_setup(config, info, prepared)
  step = jax.jit(
    step_lib.make_train_step(
      setup.graphdef, setup.tx, step_lib.lm_loss, config.seed, setup.schedule, use_dropout=False
    )
  )
  state = setup.create_state()
  pipeline = data_lib.make_pipeline(
    config.data, global_batch_size=config.batch_size, seed=0, process_index=0, process_count=1, train=True
  )
  for _, batch in zip(range(3), pipeline):
    state, metrics = step(state, jax.device_put(batch))
    assert np.isfinite(float(metrics['train/loss']))
  assert int(state['step']) == 3


@pytest.mark.slow  # The default run trains every method in tests/schemes/test_registry.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_three_training_steps(tmp_path, name):
  """The full loop: a finite evaluation loss, and the measured τ saved in the workdir."""
  final = train_on_one_device(loop_config('noci', name), tmp_path)
  assert np.isfinite(final['eval/loss'])
  assert os.path.exists(os.path.join(tmp_path, schemes.PREPARATION_FILE))
