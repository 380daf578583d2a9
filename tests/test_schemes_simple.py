"""Prior deep-transformer initialisations with closed-form plans: DS-Init, T-Fixup, SkipInit, ReZero,
LayerScale and Bamboo (dsjax/schemes/<name>.py; the formulas are in each module's docstring).

For each method, at two depths: the exact initial scales of the plan, the same scales in the built model
(the drawn weights against the Xavier model of the same seed, so ratios are exact, plus their sample
standard deviations), the block structure (which norms exist, learnable `Param` vs fixed `Constant`
residual scales and their shapes), and a 3-step training run of GPT and ViT through the trainer's own
train step and optimizer.
"""

import importlib.util
import math
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import data as data_lib
from dsjax import models, schemes
from dsjax.models import layers
from dsjax.models.plan import WEIGHT_KEYS
from dsjax.schemes import layerscale
from dsjax.train import config as config_lib
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

METHODS = ('dsinit', 'tfixup', 'skipinit', 'rezero', 'layerscale', 'bamboo')
DEPTHS = (4, 16)
INFO = {'gpt': TEXT_INFO, 'vit': IMAGE_INFO}
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(scheme, name='gpt', depth=4, block=None, **model):
  block = block or schemes.get(scheme).blocks[0]
  return tiny_config(name, scheme=scheme, depth=depth, block=block, **model)


def _plan(config, name='gpt'):
  return schemes.make_init_plan(config.model, models.model_dims(config.model, INFO[name],
                                                                seq_len=config.data.seq_len))


def _build(config, name='gpt'):
  return schemes.build_model(config, INFO[name], nnx.Rngs(params=0))


def _reference(config, name='gpt', **model):
  """The vanilla Xavier model of the same config and seed: the same underlying random draws."""
  ref = _config('vanilla', name, config.model.depth, block=config.model.block, **model)
  return _build(ref, name)


def _kernels(model):
  block = model.trunk.stack.layers
  dense = {'q': block.attn.q, 'k': block.attn.k, 'v': block.attn.v, 'o': block.attn.o,
           'ffn1': block.ffn.ffn1, 'ffn2': block.ffn.ffn2}
  return {name: np.asarray(d.kernel[...], np.float64) for name, d in dense.items()}


def _input_kernel(model):
  return np.asarray(model.token_embed[...] if hasattr(model, 'token_embed') else model.patch_embed.kernel[...])


def _norms(model):
  return [path for path, node in nnx.iter_graph(model) if isinstance(node, layers.Norm)]


def _assert_layer_stds(model, plan, rtol=0.1):
  """Per-layer sample std of every block matrix against the plan (≥ 1024 draws per layer)."""
  for name, w in _kernels(model).items():
    np.testing.assert_allclose(w.std(axis=(1, 2)), plan.layer[name], rtol=rtol, err_msg=name)


def _xavier(fan_in, fan_out):
  return math.sqrt(2.0 / (fan_in + fan_out))


# ------------------------------------------------------------------------------------------------
# Registration and config checks.
# ------------------------------------------------------------------------------------------------

def test_methods_are_registered_with_their_blocks():
  blocks = {row['name']: row['blocks'] for row in schemes.table()}
  assert blocks['dsinit'] == ('postln', 'preln')
  assert blocks['tfixup'] == blocks['skipinit'] == blocks['rezero'] == ('nonorm',)
  assert blocks['layerscale'] == blocks['bamboo'] == ('preln',)
  for name in METHODS:
    assert schemes.get(name).paper and schemes.get(name).summary


@pytest.mark.parametrize('scheme,override,key', [
    ('dsinit', dict(block='nonorm'), 'model.block'),
    ('dsinit', dict(alpha=1.5), 'model.dsinit.alpha'),
    ('dsinit', dict(alpha=0.0), 'model.dsinit.alpha'),
    ('tfixup', dict(block='preln'), 'model.block'),
    ('tfixup', dict(final_norm=True), 'model.final_norm'),
    ('tfixup', dict(encoder_scale=0.0), 'model.tfixup.encoder_scale'),
    ('tfixup', dict(decoder_factor=-9.0), 'model.tfixup.decoder_factor'),
    ('skipinit', dict(block='postln'), 'model.block'),
    ('skipinit', dict(final_norm=True), 'model.final_norm'),
    ('rezero', dict(block='preln'), 'model.block'),
    ('rezero', dict(init=float('nan')), 'model.rezero.init'),
    ('layerscale', dict(block='postln'), 'model.block'),
    ('layerscale', dict(init='cait'), 'model.layerscale.init'),
    ('layerscale', dict(init=-0.1), 'model.layerscale.init'),
    ('bamboo', dict(block='postln'), 'model.block'),
])
def test_bad_configs_fail_in_validate_in_one_line(scheme, override, key):
  config = _config(scheme)
  for k, v in override.items():
    if k in config.model:
      config.model[k] = v
    else:
      config.model[scheme][k] = v
  with pytest.raises(ValueError, match=re.escape(key)) as err:
    config_lib.validate_config(config, num_devices=1)
  assert '\n' not in str(err.value)


# ------------------------------------------------------------------------------------------------
# DS-Init: every weight of layer l ~ U(±γ·α/sqrt(l)), γ = sqrt(6/(d_in + d_out)).
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('depth', DEPTHS)
def test_dsinit_scales_each_layer_by_alpha_over_sqrt_l(depth):
  d, alpha = 32, 0.5 if depth == 16 else 1.0
  config = _config('dsinit', depth=depth)
  config.model.dsinit.alpha = alpha
  plan = _plan(config)
  assert plan.distribution == 'uniform'
  l = np.arange(1, depth + 1)
  bound = {'q': math.sqrt(6 / (2 * d)), 'ffn1': math.sqrt(6 / (5 * d)), 'ffn2': math.sqrt(6 / (5 * d))}
  bound['k'] = bound['v'] = bound['o'] = bound['q']
  for name in WEIGHT_KEYS:   # std of U(±a) is a/sqrt(3)
    np.testing.assert_allclose(plan.layer[name], bound[name] * alpha / np.sqrt(l) / math.sqrt(3), rtol=1e-6)
  for name in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[name], 1.0)
  np.testing.assert_allclose(plan.input_std, _xavier(256, d), rtol=1e-6)    # embeddings: Xavier
  np.testing.assert_allclose(plan.head_std, _xavier(d, 256), rtol=1e-6)

  model = _build(config)
  reference = _reference(config, init_distribution='uniform')   # Xavier-uniform, same draws
  ref_kernels = _kernels(reference)
  for name, w in _kernels(model).items():
    ratio = w / ref_kernels[name]
    np.testing.assert_allclose(ratio, np.broadcast_to((alpha / np.sqrt(l))[:, None, None], w.shape),
                               rtol=1e-5, err_msg=name)
    a = bound[name] * alpha / np.sqrt(l)   # uniform: bounded by a, and filling the interval
    assert np.all(np.abs(w).max(axis=(1, 2)) <= a * (1 + 1e-6)) and np.all(np.abs(w).max(axis=(1, 2)) > 0.9 * a)
  _assert_layer_stds(model, plan)
  np.testing.assert_array_equal(_input_kernel(model), _input_kernel(reference))
  block = model.trunk.stack.layers
  assert block.post_attn_norm is not None and block.pre_attn_norm is None   # Post-LN
  assert isinstance(block.branch_attn, layers.Constant) and isinstance(block.skip_ffn, layers.Constant)


# ------------------------------------------------------------------------------------------------
# T-Fixup: no norm; Xavier; embeddings N(0, d^{-1/2}); V, O, FFN × (9N)^{-1/4} (GPT) or 0.67·N^{-1/4} (ViT).
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('depth', DEPTHS)
@pytest.mark.parametrize('name', ['gpt', 'vit'])
def test_tfixup_scales_and_has_no_norm(name, depth):
  d = 32
  config = _config('tfixup', name, depth=depth)
  plan = _plan(config, name)
  scale = (9 * depth) ** -0.25 if name == 'gpt' else 0.67 * depth ** -0.25
  xavier = {'q': _xavier(d, d), 'k': _xavier(d, d), 'v': _xavier(d, d), 'o': _xavier(d, d),
            'ffn1': _xavier(d, 4 * d), 'ffn2': _xavier(4 * d, d)}
  factor = {'q': 1.0, 'k': 1.0, 'v': scale, 'o': scale, 'ffn1': scale, 'ffn2': scale}
  for key in WEIGHT_KEYS:
    np.testing.assert_allclose(plan.layer[key], xavier[key] * factor[key], rtol=1e-6, err_msg=key)
  table_std = d ** -0.25 * (9 * depth) ** -0.25          # N(0, d^{-1/2}) × (9N)^{-1/4}
  patch_dim = 2 * 2 * 1
  np.testing.assert_allclose(plan.input_std, table_std if name == 'gpt' else table_std / math.sqrt(patch_dim),
                             rtol=1e-6)
  np.testing.assert_allclose(plan.pos_std, table_std, rtol=1e-6)
  np.testing.assert_allclose(plan.head_std, _xavier(d, 256 if name == 'gpt' else 10), rtol=1e-6)

  model = _build(config, name)
  assert _norms(model) == []        # no LayerNorm anywhere, no final norm
  reference = _reference(config, name)
  ref_kernels = _kernels(reference)
  for key, w in _kernels(model).items():
    np.testing.assert_allclose(w / ref_kernels[key], factor[key], rtol=1e-5, err_msg=key)
  _assert_layer_stds(model, plan)
  input_dim = 256 if name == 'gpt' else patch_dim
  np.testing.assert_allclose(_input_kernel(model) / _input_kernel(reference),
                             plan.input_std / _xavier(input_dim, d), rtol=1e-5)
  if name == 'gpt':
    np.testing.assert_allclose(np.std(model.token_embed[...]), table_std, rtol=0.05)
  block = model.trunk.stack.layers
  for key in ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
    np.testing.assert_array_equal(getattr(block, key)[...], np.ones(depth))


def test_tfixup_constants_and_unscaled_embeddings():
  config = _config('tfixup', 'vit', depth=16)
  config.model.tfixup.encoder_scale, config.model.tfixup.scale_embeddings = 0.5, False
  plan = _plan(config, 'vit')
  np.testing.assert_allclose(plan.layer['ffn2'], _xavier(128, 32) * 0.5 / 2, rtol=1e-6)
  np.testing.assert_allclose(plan.pos_std, 32 ** -0.25, rtol=1e-6)
  config = _config('tfixup', 'gpt', depth=16)
  config.model.tfixup.decoder_factor = 1.0
  np.testing.assert_allclose(_plan(config).layer['v'], _xavier(32, 32) / 2, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# SkipInit and ReZero: no norm, x + α·f(x) with learnable α = 0: the identity at initialisation.
# ------------------------------------------------------------------------------------------------

def _tokens():
  return jax.random.randint(jax.random.key(1), (2, 16), 0, 256)


@pytest.mark.parametrize('depth', DEPTHS)
@pytest.mark.parametrize('scheme', ['skipinit', 'rezero'])
def test_skipinit_and_rezero_are_the_identity_at_init(scheme, depth):
  config = _config(scheme, 'gpt', depth=depth)
  plan = _plan(config)
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.zeros(depth))
  for key in ('skip_attn', 'skip_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.ones(depth))
  assert plan.branch.learnable and not plan.branch.vector and plan.branch.shared == (scheme == 'rezero')
  assert not plan.skip.learnable
  for key in WEIGHT_KEYS:       # Xavier weights, as the vanilla plan
    np.testing.assert_allclose(plan.layer[key], _plan(_config('vanilla', depth=depth, block='nonorm')).layer[key])

  model = _build(config)
  assert _norms(model) == []
  block = model.trunk.stack.layers
  assert isinstance(block.branch_attn, nnx.Param) and isinstance(block.skip_attn, layers.Constant)
  chex.assert_shape(block.branch_attn[...], (depth,))       # one scalar per layer (stacked)
  if scheme == 'rezero':
    assert block.branch_ffn is None                         # shared by both adds
  else:
    assert isinstance(block.branch_ffn, nnx.Param)
    chex.assert_shape(block.branch_ffn[...], (depth,))
  for key, value in block.scales().items():
    np.testing.assert_array_equal(value, plan.layer[key], err_msg=key)
  ref_kernels = _kernels(_reference(config))
  for key, w in _kernels(model).items():                  # Xavier weights
    np.testing.assert_array_equal(w, ref_kernels[key])
  x = model.embed(_tokens())
  y = model.trunk(x, None)                                  # dropout off
  chex.assert_equal_shape((x, y))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize('scheme', ['skipinit', 'rezero'])
def test_skipinit_and_rezero_initial_alpha_is_configurable(scheme):
  config = _config(scheme, 'gpt', depth=4)
  config.model[scheme].init = 0.25
  model = _build(config)
  block = model.trunk.stack.layers
  np.testing.assert_array_equal(block.scales()['branch_attn'], np.full(4, 0.25, np.float32))
  np.testing.assert_array_equal(block.scales()['branch_ffn'], np.full(4, 0.25, np.float32))
  x = model.embed(_tokens())
  assert not np.allclose(model.trunk(x, None), x)


# ------------------------------------------------------------------------------------------------
# LayerScale: Pre-LN, x + diag(λ)·f(LN(x)), λ ∈ R^d learnable, ε by CaiT's depth rule.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('depth,eps', [(4, 0.1), (16, 0.1), (18, 0.1), (20, 1e-5), (24, 1e-5), (30, 1e-6)])
def test_layerscale_depth_rule(depth, eps):
  assert layerscale.depth_rule_init(depth) == eps
  plan = _plan(_config('layerscale', depth=depth))
  for key in ('branch_attn', 'branch_ffn'):
    np.testing.assert_array_equal(plan.layer[key], np.full(depth, eps, np.float32))
  assert plan.branch.learnable and plan.branch.vector and not plan.branch.shared


@pytest.mark.parametrize('depth', DEPTHS)
def test_layerscale_model_has_learnable_vectors_and_pre_ln(depth):
  config = _config('layerscale', 'vit', depth=depth)
  if depth == 16:
    config.model.layerscale.init = 1e-4
  eps = 0.1 if depth == 4 else 1e-4
  model = _build(config, 'vit')
  block = model.trunk.stack.layers
  for key in ('branch_attn', 'branch_ffn'):
    lam = getattr(block, key)
    assert isinstance(lam, nnx.Param)
    chex.assert_shape(lam[...], (depth, 32))               # one width-d vector per add and layer
    np.testing.assert_array_equal(lam[...], np.full((depth, 32), eps, np.float32))
  for key in ('skip_attn', 'skip_ffn'):
    assert isinstance(getattr(block, key), layers.Constant)
  assert block.pre_attn_norm is not None and block.pre_ffn_norm is not None
  assert block.post_attn_norm is None and model.trunk.final_norm is not None
  assert len(_norms(model)) == 3                          # pre-attention, pre-FFN and final LayerNorm
  reference = _reference(config, 'vit')
  ref_kernels = _kernels(reference)
  for key, w in _kernels(model).items():                  # Xavier weights
    np.testing.assert_array_equal(w, ref_kernels[key])


# ------------------------------------------------------------------------------------------------
# Bamboo: the vanilla Xavier Pre-LN plan; the method is the deeper-narrower config.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('depth', DEPTHS)
def test_bamboo_is_the_xavier_pre_ln_plan(depth):
  config = _config('bamboo', depth=depth)
  plan = _plan(config)
  vanilla = _plan(_config('vanilla', depth=depth, block='preln'))
  for key, value in vanilla.layer.items():
    np.testing.assert_array_equal(plan.layer[key], value, err_msg=key)
  for field in ('distribution', 'input_std', 'pos_std', 'head_std', 'output_scale', 'skip', 'branch',
                'layout'):
    assert getattr(plan, field) == getattr(vanilla, field), field
  np.testing.assert_allclose(plan.layer['ffn1'], _xavier(32, 128), rtol=1e-6)
  model, reference = _build(config), _reference(config)   # the built model is the vanilla one
  assert len(_norms(model)) == 3                          # pre-attention, pre-FFN and final LayerNorm
  for (path, a), (_, b) in zip(nnx.iter_graph(model), nnx.iter_graph(reference)):
    if isinstance(a, nnx.Variable):
      np.testing.assert_array_equal(a[...], b[...], err_msg=str(path))


def _load_config(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / 'configs' / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_bamboo_config_is_deeper_and_narrower_at_equal_block_parameters():
  bamboo, preln = _load_config('gpt_bamboo'), _load_config('gpt_preln')
  config_lib.validate_config(bamboo, num_devices=1)
  assert bamboo.model.scheme == 'bamboo' and bamboo.model.block == 'preln'
  assert bamboo.model.depth > preln.model.depth and bamboo.model.width < preln.model.width
  block_params = lambda m: 12 * m.width ** 2 * m.depth
  assert block_params(bamboo.model) == block_params(preln.model)
  assert bamboo.model.width // bamboo.model.num_heads == preln.model.width // preln.model.num_heads
  for key in ('total_steps', 'batch_size'):
    assert bamboo[key] == preln[key]
  assert bamboo.data.seq_len == preln.data.seq_len
  assert bamboo.optimizer.to_dict() == preln.optimizer.to_dict()


# ------------------------------------------------------------------------------------------------
# Training smoke runs: 3 steps of the trainer's own jitted train step and optimizer on real batches.
# ------------------------------------------------------------------------------------------------

# XLA's cheapest CPU compilation (compile time dominates a 3-step run; the numbers are the same up to
# floating-point reassociation): these runs check that each method trains, not the kernels' speed.
FAST_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True}


def _train_3_steps(config, name):
  config.batch_size = 8
  config_lib.validate_config(config, num_devices=1)
  info = data_lib.dataset_info(config.data)
  setup = state_lib.make_setup(config, info)
  state = setup.create_state()
  initial = jax.tree.map(np.asarray, state['params'])
  pipeline = data_lib.make_pipeline(config.data, global_batch_size=config.batch_size, seed=0,
                                    process_index=0, process_count=1, train=True)
  batches = [jax.tree.map(jnp.asarray, next(pipeline)) for _ in range(3)]
  train_step = jax.jit(step_lib.make_train_step(setup.graphdef, setup.tx, step_lib.LOSSES[name],
                                                config.seed, setup.schedule, use_dropout=False))
  train_step = train_step.lower(state, batches[0]).compile(compiler_options=FAST_COMPILE)
  losses = []
  for batch in batches:
    state, metrics = train_step(state, batch)
    losses.append(float(metrics['train/loss']))
  return initial, state, losses


@pytest.mark.slow  # The default run trains every method in tests/test_schemes.py.
@pytest.mark.parametrize('name', ['gpt', 'vit'])
@pytest.mark.parametrize('scheme', METHODS)
def test_three_training_steps(scheme, name):
  config = _config(scheme, name, depth=4)
  config.total_steps = 3
  initial, state, losses = _train_3_steps(config, name)
  assert int(state['step']) == 3 and np.all(np.isfinite(losses)), losses
  block = state['params']['trunk']['stack']['layers']
  if scheme in ('skipinit', 'rezero', 'layerscale'):       # the learnable residual scales train
    before = initial['trunk']['stack']['layers']['branch_attn']
    assert not np.allclose(np.asarray(block['branch_attn']), before)
  else:
    assert 'branch_attn' not in block
