"""Every fast attention form against the plain math (`dsjax.models.layers.plain_attention`).

Outputs and q/k/v gradients of 'xla' (`attention_xla`), 'splash' (`tpu_attention`, in Pallas'
interpreter off a TPU) and, on a GPU, 'cudnn' (`attention_cudnn`) equal the plain form's in float32 and
bfloat16, causal or not, at an even length and an odd one (37: cuDNN pads it by one, splash to 128).
Through the model, the parameter gradients of each form equal the plain form's. Attention dropout (only
the 'xla' form has it): without a causal mask it draws the plain form's mask from the same key, so the
two are compared exactly; with one, each query block draws its own mask, which no single draw of the
plain form reproduces, so there it is checked for determinism and, over many keys, for the unbiased
mean of inverted dropout (outputs and gradients).
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import schemes
from dsjax.models import attention_cudnn, attention_xla, layers, tpu_attention
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

ON_GPU = jax.default_backend() == 'gpu'
SCALE = 32**-0.5
FAST_FORMS = {
  'xla': attention_xla.xla_attention,
  'splash': tpu_attention.splash_attention,
  'cudnn': attention_cudnn.cudnn_attention,
}


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """float32 matmuls in full precision (NVIDIA GPUs default to TF32, beyond the tolerances below)."""
  with jax.default_matmul_precision('float32'):
    yield


def _qkv(dtype, shape, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


def _assert_close(got, want, dtype):
  """float32: to 1e-5; bfloat16: to 2% of the reference's largest magnitude (a few bf16 roundings)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if dtype == jnp.bfloat16:
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
  else:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _forms():
  """(form, dtype) pairs this machine runs: cuDNN only on a GPU and only in bfloat16."""
  pairs = [(name, dtype) for name in ('xla', 'splash') for dtype in (jnp.float32, jnp.bfloat16)]
  return pairs + ([('cudnn', jnp.bfloat16)] if ON_GPU else [])


@pytest.mark.parametrize('seq_len', [64, 37])
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('name,dtype', _forms(), ids=[f'{n}-{jnp.dtype(d).name}' for n, d in _forms()])
def test_fast_forms_match_the_plain_math(name, dtype, causal, seq_len):
  q, k, v = _qkv(dtype, (2, seq_len, 4, 32))
  cotangent = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(dtype)

  @functools.partial(jax.jit, static_argnums=0)  # One compilation, not one per operation.
  def value_and_grads(attend):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, SCALE, causal), q, k, v)
    return out, vjp(cotangent)

  out, grads = value_and_grads(FAST_FORMS[name])
  out_ref, grads_ref = value_and_grads(layers.plain_attention)
  chex.assert_trees_all_equal_dtypes((out, grads), (out_ref, grads_ref))
  _assert_close(out, out_ref, dtype)
  for g, g_ref in zip(grads, grads_ref):
    _assert_close(g, g_ref, dtype)


@pytest.mark.parametrize('seq_len', [64, 37])
def test_cudnn_lowers_for_a_gpu_also_over_a_population(seq_len, monkeypatch):
  """Lowered for CUDA here (cuDNN's version and capability checks stand in for a GPU's answers): the
  form's gradient, vmapped over 3 members as `population.train` maps its step, is one fused forward and
  one fused backward cuDNN call over the members' batches folded together — also at an odd length, whose
  padding mask takes a length per row."""
  fused = pytest.importorskip('jax._src.cudnn.fused_attention_stablehlo')
  if not all(hasattr(fused, f) for f in ('check_cudnn_version', 'check_compute_capability')):
    pytest.skip("this jax's cuDNN attention checks the GPU elsewhere")
  monkeypatch.setattr(fused, 'check_cudnn_version', lambda: 91500)
  monkeypatch.setattr(fused, 'check_compute_capability', lambda capability: True)
  monkeypatch.setattr(fused, 'is_cuda_compute_capability_equal', lambda capability: False, raising=False)

  def loss(q, k, v):
    return jnp.sum(attention_cudnn.cudnn_attention(q, k, v, SCALE, True).astype(jnp.float32) ** 2)

  qkv = jax.ShapeDtypeStruct((3, 2, seq_len, 2, 16), jnp.bfloat16)
  grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))
  text = jax.jit(grads).trace(qkv, qkv, qkv).lower(lowering_platforms=('cuda',)).as_text()
  calls = re.findall(r'custom_call @__cudnn\$(\w+)\([^()]*\)[^\n]*: \((tensor<[^,>]*>)', text)
  padded = seq_len + seq_len % 2
  assert calls == [(name, f'tensor<6x{padded}x2x16xbf16>') for name in ('fmhaSoftmax', 'fmhaSoftmaxBackward')]


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_xla_dropout_without_a_mask_is_the_plain_forms(dtype):
  """Non-causal attention is one query block: it draws the plain form's dropout mask from the key."""
  q, k, v = _qkv(dtype, (2, 37, 4, 8))
  key = jax.random.key(7)
  cotangent = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(dtype)
  results = []
  for attend in (attention_xla.xla_attention, layers.plain_attention):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, 8**-0.5, False, 0.3, key), q, k, v)  # noqa: B023
    results.append((out, vjp(cotangent)))
  (out, grads), (out_ref, grads_ref) = results
  assert not np.allclose(
    np.asarray(out, np.float32), np.asarray(layers.plain_attention(q, k, v, 8**-0.5, False), np.float32)
  )
  _assert_close(out, out_ref, dtype)
  for g, g_ref in zip(grads, grads_ref):
    _assert_close(g, g_ref, dtype)


def test_xla_causal_dropout_is_deterministic_and_unbiased():
  """Causal attention with dropout draws one mask per query block, so no draw equals the plain form's
  for the same key. Checked instead: the same key gives the same result; different keys differ; and
  over 512 keys the mean output and the mean q/k/v gradients (of a loss linear in the output) equal the
  plain form's without dropout, within 5 standard errors of the mean (inverted dropout is unbiased)."""
  q, k, v = _qkv(jnp.float32, (1, 37, 2, 8))
  cotangent = jax.random.normal(jax.random.key(1), q.shape)

  def value_and_grads(attend, key):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, 8**-0.5, True, 0.3, key), q, k, v)
    return out, *vjp(cotangent)

  draw = jax.jit(lambda key: value_and_grads(attention_xla.xla_attention, key))
  once, again, other = draw(jax.random.key(3)), draw(jax.random.key(3)), draw(jax.random.key(4))
  chex.assert_trees_all_equal(once, again)
  assert not np.allclose(once[0], other[0])
  draws = jax.vmap(draw)(jax.random.split(jax.random.key(5), 512))
  reference = value_and_grads(layers.plain_attention, None)
  for samples, want in zip(draws, reference):
    mean, standard_error = samples.mean(0), samples.std(0) / np.sqrt(samples.shape[0])
    assert np.all(np.abs(mean - want) <= 5 * standard_error + 1e-5), np.abs(mean - want).max()


def _model_value_and_grads(model_name, implementation, dtype, attn_dropout=0.0, key=None):
  """The model's output contracted with a fixed cotangent, and its parameter gradients."""
  info = TEXT_INFO if model_name == 'gpt' else IMAGE_INFO
  extra = {} if model_name == 'gpt' else {'pooling': 'cls'}  # ViT: 16 patches + the class token = 17
  config = tiny_config(
    model_name, attention=implementation, dtype=dtype, attn_dropout=attn_dropout, block='dnt', **extra
  )  # DNT: QKNorm in the attention
  model = schemes.build_model(config, info, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  inputs = (
    jnp.arange(32).reshape(2, 16) % 256
    if model_name == 'gpt'
    else jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
  )

  def loss(p):
    out = nnx.merge(graphdef, p, rest)(inputs, dropout_key=key)
    return jnp.sum(out * jax.random.normal(jax.random.key(2), out.shape))

  return jax.jit(jax.value_and_grad(loss))(params)


def _model_forms():
  pairs = [('xla', 'float32'), ('xla', 'bfloat16'), ('splash', 'float32')]
  return pairs + ([('cudnn', 'bfloat16')] if ON_GPU else [])


@pytest.mark.parametrize('model_name', ['gpt', 'vit'])
@pytest.mark.parametrize('implementation,dtype', _model_forms())
def test_fast_forms_give_the_plain_forms_parameter_gradients(model_name, implementation, dtype):
  """Through the model (QKNorm, the logit scale, projections): the same loss and parameter gradients."""
  loss, grads = _model_value_and_grads(model_name, implementation, dtype)
  loss_ref, grads_ref = _model_value_and_grads(model_name, 'plain', dtype)
  tol = 1e-4 if dtype == 'float32' else 5e-2
  np.testing.assert_allclose(loss, loss_ref, rtol=tol, atol=tol * 10)
  # Each leaf to `tol` of its largest entry. Left out: the gradients of the key's bias and of its norm's
  # bias, which vanish analytically (they shift all logits of a query's row alike, which the softmax
  # ignores) and so are rounding noise of either form.
  for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref)):
    name = jax.tree_util.keystr(path)
    if "['k']['bias']" in name or "['k_norm']['bias']" in name:
      continue
    g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
    np.testing.assert_allclose(g, g_ref, rtol=tol, atol=tol * max(np.abs(g_ref).max(), 1e-3), err_msg=name)


def test_vit_with_attention_dropout_trains_the_same_on_the_xla_form():
  """ViT (no causal mask) with attention dropout: the 'xla' form's gradients are the plain form's."""
  loss, grads = _model_value_and_grads('vit', 'xla', 'float32', 0.3, jax.random.key(9))
  loss_ref, grads_ref = _model_value_and_grads('vit', 'plain', 'float32', 0.3, jax.random.key(9))
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-4)
  chex.assert_trees_all_close(grads, grads_ref, rtol=1e-4, atol=1e-5)


def _derivative_rules(jaxpr) -> list[str]:
  """The custom-derivative calls in a jaxpr and all its sub-jaxprs (scan bodies, jit calls)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith(('custom_jvp', 'custom_vjp')):
      found.append(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _derivative_rules(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found += _derivative_rules(sub)
  return found


@pytest.mark.parametrize('model_name', ['gpt', 'vit'])
def test_the_plain_model_has_no_derivative_rule_and_matches_the_default_one(model_name, monkeypatch):
  """With model.attention='plain' and `layers.FAST_MATMUL` off, no custom derivative is left anywhere in
  the model: JAX differentiates whatever is written (an edit of `plain_attention`, e.g. a logit
  soft-cap, included). Its loss and gradients are those of the default CPU model ('xla', fast matmuls)."""

  def rules(implementation):
    """The derivative rules in the forward pass (a gradient's jaxpr has them already applied)."""
    config = tiny_config(model_name, attention=implementation, dtype='float32')
    model = schemes.build_model(config, TEXT_INFO if model_name == 'gpt' else IMAGE_INFO, nnx.Rngs(params=0))
    inputs = jnp.zeros((2, 16), jnp.int32) if model_name == 'gpt' else jnp.zeros((2, 8, 8, 1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return _derivative_rules(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p, rest)(inputs))(params).jaxpr)

  assert rules('xla')  # The default model's rules are found (attention_xla's, fast_matmul's).
  loss, grads = _model_value_and_grads(model_name, 'xla', 'float32')
  monkeypatch.setattr(layers, 'FAST_MATMUL', False)
  assert rules('plain') == []
  loss_plain, grads_plain = _model_value_and_grads(model_name, 'plain', 'float32')
  np.testing.assert_allclose(loss_plain, loss, rtol=1e-5)
  chex.assert_trees_all_close(grads_plain, grads, rtol=1e-4, atol=1e-5)


def test_a_modified_plain_attention_is_differentiated_as_written(monkeypatch):
  """A logit soft-cap (c·tanh(s/c), Gemma 2's) added to the plain form: the module's q/k/v-side
  gradient is JAX's derivative of the capped function, not of the uncapped one."""
  cap = 0.5

  def capped(q, k, v, logit_scale, causal, dropout_rate=0.0, dropout_key=None):
    logits = logit_scale * jnp.einsum('bqhk,bthk->bhqt', q, k, preferred_element_type=jnp.float32)
    logits = cap * jnp.tanh(logits / cap)
    l = q.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((l, l), bool)), logits, jnp.finfo(jnp.float32).min)
    return jnp.einsum('bhqt,bthk->bqhk', jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)

  attn = layers.Attention(
    32,
    4,
    stds={n: 0.5 for n in 'qkvo'},
    distribution='normal',
    use_bias=False,
    qk_norm=False,
    norm_kind='layernorm',
    norm_eps=1e-6,
    causal=True,
    attn_dropout=0.0,
    rngs=nnx.Rngs(params=0),
    implementation='plain',
  )
  x = jax.random.normal(jax.random.key(1), (2, 9, 32))
  loss = lambda x: jnp.sin(attn(x, None)).sum()  # noqa: E731
  uncapped = jax.grad(loss)(x)
  monkeypatch.setitem(layers.ATTENTION_IMPLEMENTATIONS, 'plain', capped)
  got = jax.grad(loss)(x)
  heads = lambda t: t.reshape(2, 9, 4, 8)  # noqa: E731
  want = jax.grad(
    lambda x: jnp.sin(
      attn.o(capped(heads(attn.q(x)), heads(attn.k(x)), heads(attn.v(x)), 8**-0.5, True).reshape(2, 9, 32))
    ).sum()
  )(x)
  # Both are float32 sums, in an order that XLA's fusions may change between jax versions; terms of
  # size ~14 leave ~10 float32 roundings (1e-5) in entries that cancel to near zero.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(got, uncapped, rtol=1e-3, atol=1e-4)
