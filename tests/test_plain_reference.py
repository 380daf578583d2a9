"""The plain-`jnp` reference GPT of the experiments computes dsjax's loss and gradients from dsjax's weights.

Tiny models (3 layers × 32): the loss and every parameter gradient of `experiments/plain_reference.py`
equal those of dsjax's GPT — plain attention and the CPU's 'xla' form, Post-LN, Pre-LN and DNT's settings
S1–S5 with RMSNorm or LayerNorm, with and without biases and dropout (the reference draws dsjax's masks
from the same key), untied and tied embeddings — to float32 rounding; and the layer outputs' variance
and token correlation, and the gradients with respect to them, equal those that the instrumentation's
probe records.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from dsjax import instrument, schemes  # noqa: E402
from dsjax.instrument import probe as probe_lib  # noqa: E402
from dsjax.train import step as step_lib  # noqa: E402
from experiments import dslm_stall  # noqa: E402
from experiments import plain_reference as ref  # noqa: E402
from tests.helpers import TEXT_INFO, tiny_config  # noqa: E402

DEPTH, BATCH, SEQ = 3, 2, 16


def _model(
  block: str, attention: str, dropout: float, activation: str = 'relu', tied: bool = False, **overrides
):
  c = tiny_config(
    'gpt',
    depth=DEPTH,
    block=block,
    attention=attention,
    dropout=dropout,
    activation=activation,
    **overrides,
  )
  c.model.scheme = 'vanilla'
  c.model.tie_embeddings = tied
  c.data.seq_len = SEQ
  return c, schemes.build_model(c, TEXT_INFO, nnx.Rngs(params=0), None)


def _batch():
  return {'tokens': jax.random.randint(jax.random.key(7), (BATCH, SEQ + 1), 0, TEXT_INFO.vocab_size)}


def _dsjax_loss_and_grads(model, batch, key):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss_of = lambda p: step_lib.lm_loss(nnx.merge(graphdef, p, rest), batch, key)[0]  # noqa: E731
  loss, grads = jax.jit(jax.value_and_grad(loss_of))(params)
  return float(loss), nnx.to_pure_dict(grads)


def _assert_grads_close(got, want):
  """Leaf by leaf, to float32 rounding relative to the largest entry of the leaf's module (a key bias has a
  gradient of exactly 0 — softmax ignores a shift of a query's logits —, so only rounding is left of it)."""
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
  module_scale = {}
  for path, w in flat_want.items():
    module_scale[path[:-1]] = max(module_scale.get(path[:-1], 0.0), float(np.abs(w).max()))
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    if path not in flat_want:
      continue  # a constant (λ, β, output scale): the reference differentiates it, dsjax does not
    np.testing.assert_allclose(
      np.asarray(g),
      np.asarray(flat_want.pop(path)),
      rtol=1e-4,
      atol=1e-5 * module_scale[path[:-1]],
      err_msg=jax.tree_util.keystr(path),
    )
  assert not flat_want, f'parameters missing from the reference: {list(flat_want)}'


@pytest.mark.parametrize(
  'block,attention,dropout,activation,tied',
  [
    ('postln', 'plain', 0.0, 'relu', False),
    ('postln', 'xla', 0.1, 'relu', True),
    ('preln', 'plain', 0.1, 'gelu', False),
    ('preln', 'xla', 0.0, 'gelu', True),
  ],
)
def test_loss_and_parameter_gradients_match_dsjax(block, attention, dropout, activation, tied):
  c, model = _model(block, attention, dropout, activation, tied)
  batch = _batch()
  key = step_lib.dropout_key_for_step(c.seed, 1) if dropout else None
  loss, grads = _dsjax_loss_and_grads(model, batch, key)

  spec = ref.reference_spec(model)
  tree = ref.reference_tree(model)
  masks = ref.dropout_masks(spec, key, BATCH, SEQ)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda t: ref.loss(t, batch['tokens'], spec, masks)))(
    ref.cast(tree, jnp.float32)
  )
  np.testing.assert_allclose(float(ref_loss), loss, rtol=1e-6)
  _assert_grads_close(ref_grads, grads)


def test_layer_output_gradients_match_the_probe():
  """grad_var of the instrumentation at each layer output = the variance of the reference's gradient."""
  c, model = _model('postln', 'xla', 0.1)
  batch, key = _batch(), step_lib.dropout_key_for_step(c.seed, 1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss_of = lambda p, probe: step_lib.lm_loss(nnx.merge(graphdef, p, rest), batch, key, probe)[0]  # noqa: E731
  _, _, moments = jax.jit(lambda p: instrument.value_and_grad(loss_of, p, weights=False))(params)
  site = probe_lib.SITES.index('ffn_residual')
  stat = probe_lib.ACTIVATION_STATS.index('grad_var')
  probe_var_N = np.asarray(moments['activations'])[1:, site, stat]

  spec = ref.reference_spec(model)
  g_NBLD = ref.layer_output_grads(
    ref.cast(ref.reference_tree(model), jnp.float32),
    batch['tokens'],
    spec,
    ref.dropout_masks(spec, key, BATCH, SEQ),
  )
  np.testing.assert_allclose(np.var(np.asarray(g_NBLD, np.float64), axis=(1, 2, 3)), probe_var_N, rtol=1e-4)


@pytest.mark.parametrize(
  'setting,norm,use_bias,dropout',
  [
    # S1 and S3 slow: every norm placement of theirs is also in S2, S4 or S5 (~3.5 s each).
    pytest.param('S1', 'rmsnorm', True, 0.0, marks=pytest.mark.slow),
    ('S2', 'rmsnorm', False, 0.1),
    pytest.param('S3', 'layernorm', True, 0.0, marks=pytest.mark.slow),
    ('S4', 'rmsnorm', True, 0.1),
    ('S5', 'rmsnorm', True, 0.1),
    ('S5', 'layernorm', False, 0.0),
  ],
)
def test_dnt_settings_match_dsjax(setting, norm, use_bias, dropout):
  """DNT's norm placements (InputNorm, PreNorm, MidNorm, QKNorm) as the reference writes them out."""
  c, model = _model(
    'dnt', 'xla', dropout, 'gelu', tied=True, dnt_setting=setting, norm=norm, use_bias=use_bias
  )
  batch = _batch()
  key = step_lib.dropout_key_for_step(c.seed, 1) if dropout else None
  loss, grads = _dsjax_loss_and_grads(model, batch, key)

  spec = ref.reference_spec(model)
  masks = ref.dropout_masks(spec, key, BATCH, SEQ)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda t: ref.loss(t, batch['tokens'], spec, masks)))(
    ref.cast(ref.reference_tree(model), jnp.float32)
  )
  np.testing.assert_allclose(float(ref_loss), loss, rtol=1e-6)
  _assert_grads_close(ref_grads, grads)


def test_unsupported_model_is_refused():
  c = tiny_config('gpt', attn_dropout=0.1)
  model = schemes.build_model(c, TEXT_INFO, nnx.Rngs(params=0), None)
  with pytest.raises(ValueError, match='does not implement'):
    ref.reference_spec(model)


def test_layer_outputs_match_the_probe():
  """The variance and token correlation of the reference's layer outputs = the instrumentation's."""
  c, model = _model('postln', 'xla', 0.1, tied=True)
  batch, key = _batch(), step_lib.dropout_key_for_step(c.seed, 1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss_of = lambda p, probe: step_lib.lm_loss(nnx.merge(graphdef, p, rest), batch, key, probe)[0]  # noqa: E731
  _, _, moments = jax.jit(lambda p: instrument.value_and_grad(loss_of, p, weights=False))(params)
  site = probe_lib.SITES.index('ffn_residual')
  table = np.asarray(moments['activations'])[1:, site]

  spec = ref.reference_spec(model)
  masks = ref.dropout_masks(spec, key, BATCH, SEQ)
  x_NBLD, _ = ref.layer_outputs(
    ref.cast(ref.reference_tree(model), jnp.float32), batch['tokens'][:, :-1], spec, masks
  )
  x_NBLD = np.asarray(x_NBLD, np.float64)
  var_N = x_NBLD.reshape(DEPTH, -1).var(axis=1)
  np.testing.assert_allclose(var_N, table[:, probe_lib.ACTIVATION_STATS.index('var')], rtol=1e-4)
  corr_N = [dslm_stall.corr_seq_explicit(x) for x in x_NBLD]
  np.testing.assert_allclose(corr_N, table[:, probe_lib.ACTIVATION_STATS.index('corr_seq')], atol=1e-4)


def test_the_residual_sums_of_a_pre_ln_layer_are_its_output():
  """Pre-LN has no norm after the adds: the FFN's residual sum is the layer output itself."""
  _, model = _model('preln', 'xla', 0.0)
  spec = ref.reference_spec(model)
  tokens = _batch()['tokens'][:, :-1]
  x_NBLD, sum_vars_N2 = ref.layer_outputs(ref.cast(ref.reference_tree(model), jnp.float32), tokens, spec)
  np.testing.assert_allclose(sum_vars_N2[:, 1], np.asarray(x_NBLD).var(-1).mean((1, 2)), rtol=1e-5)


@pytest.mark.parametrize(
  'block,tied,fmt',
  [('postln', True, 'float8_e4m3fn'), ('postln', False, 'float8_e5m2'), ('preln', True, 'float8_e5m2')],
)
def test_a_model_cast_to_fp8_computes_the_references_cast_loss(block, tied, fmt):
  """`model.matmul_cast` rounds what the reference rounds: every dense layer's input and kernel, both
  embedding tables and the head (the tied embedding's transpose or its own kernel); the gradients, passed
  through the casts unrounded, agree too."""
  _, model = _model(block, 'plain', 0.0, 'gelu', tied, matmul_cast=fmt)
  batch = _batch()
  loss, grads = _dsjax_loss_and_grads(model, batch, None)
  spec = ref.reference_spec(model)
  assert spec.matmul_cast == fmt
  tree = ref.cast(ref.reference_tree(model), jnp.float32)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda t: ref.loss(t, batch['tokens'], spec)))(tree)
  _assert_grads_close(ref_grads, grads)
  uncast = float(
    jax.jit(lambda t: ref.loss(t, batch['tokens'], dataclasses.replace(spec, matmul_cast='none')))(tree)
  )
  np.testing.assert_allclose(float(ref_loss), loss, rtol=1e-5)
  assert abs(uncast - loss) > 10 * 1e-5 * abs(loss)  # the cast is seen: the check is not vacuous
