"""Model tests: shapes and dtypes, norm placement, residual scales, the scanned stack."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import schemes
from dsjax.models import layers, transformer
from dsjax.models.transformer import NormLayout
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config


def _build(config, info):
  return schemes.build_model(config, info, nnx.Rngs(params=0))


@pytest.mark.parametrize('block', ['preln', 'postln', 'dnt'])
def test_gpt_logits_shape_and_dtype(block):
  model = _build(tiny_config('gpt', block=block), TEXT_INFO)
  logits = model(jnp.zeros((3, 16), jnp.int32))
  chex.assert_shape(logits, (3, 16, 256))
  chex.assert_type(logits, jnp.float32)
  chex.assert_tree_all_finite(logits)


@pytest.mark.parametrize('pooling,pos', [('gap', 'learned'), ('cls', 'sincos2d')])
def test_vit_logits_shape(pooling, pos):
  model = _build(tiny_config('vit', pooling=pooling, pos_embedding=pos), IMAGE_INFO)
  logits = model(jnp.ones((5, 8, 8, 1)), dropout_key=jax.random.key(0))
  chex.assert_shape(logits, (5, 10))


def test_gpt_is_causal():
  model = _build(tiny_config('gpt'), TEXT_INFO)
  tokens = jnp.arange(16)[None] % 256
  changed = tokens.at[0, 10].set(99)
  a, b = model(tokens), model(changed)
  np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
  assert not np.allclose(a[:, 10:], b[:, 10:])


def test_dnt_settings_table():
  """DNT S1–S5 (Qi et al. 2025, §4.4, Fig. 7): (input, pre_attn, pre_ffn, qk, mid_attn, mid_ffn)."""
  expected = {
    'S1': (0, 1, 1, 0, 0, 0),
    'S2': (0, 1, 1, 1, 0, 0),
    'S3': (1, 1, 1, 1, 0, 0),
    'S4': (1, 1, 1, 1, 1, 1),
    'S5': (1, 1, 0, 1, 1, 1),
  }
  for setting, flags in expected.items():
    lay = NormLayout.for_block('dnt', setting)
    got = (lay.input_norm, lay.pre_attn, lay.pre_ffn, lay.qk_norm, lay.mid_attn, lay.mid_ffn)
    assert tuple(map(int, got)) == flags, setting
    assert lay.final_norm and not lay.post
  post = NormLayout.for_block('postln')
  assert post.post and not (post.pre_attn or post.pre_ffn or post.final_norm)


def test_norms_present_match_layout():
  model = _build(tiny_config('gpt', block='dnt', dnt_setting='S5', norm='rmsnorm'), TEXT_INFO)
  block = model.trunk.stack.layers
  assert model.trunk.input_norm is not None and block.pre_ffn_norm is None
  assert block.mid_attn_norm is not None and block.attn.q_norm is not None
  assert block.mid_attn_norm.bias is None  # RMSNorm has a gain only
  chex.assert_shape(block.attn.q_norm.scale[...], (2, 8))  # stacked: (depth, head_dim)


def test_scan_matches_unrolled_layers():
  """The scanned stack equals applying each layer's parameters in turn (with dropout keys)."""
  config = tiny_config('gpt', dropout=0.1, depth=3)
  model = _build(config, TEXT_INFO)
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  key = jax.random.key(2)
  scanned = model.trunk.stack(x, key)
  graphdef, state = nnx.split(model.trunk.stack.layers)
  keys = jax.random.split(key, 3)
  y = x
  for n in range(3):
    layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[n], state))
    y = layer(y, keys[n], layer=jnp.asarray(n))
  np.testing.assert_allclose(scanned, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('scan_layers', [True, False])
def test_a_scanned_probe_gets_each_layers_entry(scan_layers):
  """A `ScannedProbe`: layer n is probed by in_layer(per_layer[n]), sites outside the stack by itself."""
  config = tiny_config('gpt', depth=3)
  config.model.scan_layers = scan_layers
  model = _build(config, TEXT_INFO)
  tokens = jnp.zeros((2, 8), jnp.int32)
  offsets = jnp.asarray([1.0, 10.0, 100.0])

  def in_layer(offset):
    return lambda site, x, layer: x + offset if site == 'ffn_residual' else x

  def outside(site, x, layer):
    assert site == 'embedding'
    return x

  probed = model(tokens, probe=transformer.ScannedProbe(outside, offsets, in_layer))
  # The same offsets added by layer index with a plain probe.
  plain = model(tokens, probe=lambda site, x, layer: x + offsets[layer] if site == 'ffn_residual' else x)
  np.testing.assert_allclose(probed, plain, rtol=1e-6)
  assert not np.allclose(probed, model(tokens))


def test_residual_scales_are_applied():
  """With β = 0 every layer is the identity on the residual stream (Pre-LN)."""
  model = _build(tiny_config('gpt', depth=2, final_norm=False), TEXT_INFO)
  layers_ = model.trunk.stack.layers
  layers_.branch_attn[...] = jnp.zeros(2)
  layers_.branch_ffn[...] = jnp.zeros(2)
  x = jax.random.normal(jax.random.key(0), (1, 4, 32))
  np.testing.assert_allclose(model.trunk.stack(x, None), x, rtol=1e-6)


def test_rmsnorm_and_layernorm_values():
  x = jax.random.normal(jax.random.key(0), (4, 64)) * 3 + 1
  ln = layers.Norm(64, kind='layernorm', eps=1e-6)(x)
  rms = layers.Norm(64, kind='rmsnorm', eps=1e-6)(x)
  np.testing.assert_allclose(ln.mean(-1), 0, atol=1e-5)
  np.testing.assert_allclose(ln.var(-1), 1, rtol=1e-3)
  np.testing.assert_allclose((rms**2).mean(-1), 1, rtol=1e-3)


@pytest.mark.parametrize('use_bias', [True, False])
def test_qkv_in_one_matmul_are_the_three_projections(use_bias):
  attn = layers.Attention(
    32,
    4,
    stds={n: 0.2 for n in 'qkvo'},
    distribution='normal',
    use_bias=use_bias,
    qk_norm=False,
    norm_kind='layernorm',
    norm_eps=1e-6,
    causal=True,
    attn_dropout=0.0,
    rngs=nnx.Rngs(params=0),
    inner_width=48,
  )
  if use_bias:
    for i, dense in enumerate((attn.q, attn.k, attn.v)):
      dense.bias[...] = jnp.full((48,), 0.1 * (i + 1))
  x_BLD = jax.random.normal(jax.random.key(1), (2, 5, 32))
  projections = attn.project_qkv(x_BLD)
  for dense, y_BLI in zip((attn.q, attn.k, attn.v), projections):
    chex.assert_shape(y_BLI, (2, 5, 48))
    np.testing.assert_allclose(y_BLI, dense(x_BLD), rtol=1e-5, atol=1e-6)


def test_gelu_is_the_exact_gelu():
  """The erf form equals jax's erfc form of x·Φ(x), values and derivatives, over the whole range."""
  x = jnp.linspace(-12.0, 12.0, 48001)
  np.testing.assert_allclose(layers.ACTIVATIONS['gelu'](x), jax.nn.gelu(x, approximate=False), atol=1e-6)
  grad = lambda f: jax.vmap(jax.grad(f))(x)  # noqa: E731
  np.testing.assert_allclose(
    grad(layers.ACTIVATIONS['gelu']), grad(lambda t: jax.nn.gelu(t, approximate=False)), atol=1e-6
  )


@pytest.mark.parametrize('distribution', ['normal', 'truncated_normal', 'uniform'])
def test_init_weight_has_requested_std(distribution):
  w = layers.init_weight(jax.random.key(0), (400, 400), 0.05, distribution)
  np.testing.assert_allclose(float(w.std()), 0.05, rtol=0.02)


def test_xavier_init_variances():
  model = _build(tiny_config('gpt', width=64, num_heads=4, depth=2), TEXT_INFO)
  block = model.trunk.stack.layers
  np.testing.assert_allclose(float(block.attn.q.kernel[...].std()), np.sqrt(2 / 128), rtol=0.05)
  np.testing.assert_allclose(float(block.ffn.ffn1.kernel[...].std()), np.sqrt(2 / (64 + 256)), rtol=0.05)
  assert float(jnp.abs(block.ffn.ffn1.bias[...]).max()) == 0.0


def test_192_layer_model_runs_a_training_step():
  """Scan over layers keeps a 192-layer model cheap to trace: build it and take a gradient on CPU."""
  config = tiny_config('gpt', depth=192, width=32, remat='nothing_saveable')
  model = _build(config, TEXT_INFO)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def loss_and_grad(params, tokens):
    return jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest)(tokens).mean())(params)

  loss, grads = loss_and_grad(params, jnp.zeros((2, 16), jnp.int32))
  assert np.isfinite(float(loss))
  chex.assert_shape(grads['trunk']['stack']['layers']['attn']['q']['kernel'][...], (192, 32, 32))
