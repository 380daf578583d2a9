"""Compute dtype, parameter dtype, attention implementations and layer-stack options.

Every attention implementation available on this machine must give the outputs and gradients of jax's
XLA attention (on a GPU also cuDNN's fused kernel; on every machine the TPU's splash kernel, in Pallas'
interpreter off a TPU; tests/models/test_attention_implementations.py checks them against the plain form);
every layer-stack option must compute the same function.
"""

import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dsjax import models, schemes
from dsjax.models import attention_cudnn, attention_xla, fast_matmul, tpu_attention
from dsjax.train import optimizers
from tests.helpers import IMAGE_INFO, TEXT_INFO, tiny_config

ON_GPU = jax.default_backend() == 'gpu'


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """float32 matmuls in full precision: on NVIDIA GPUs jax's default runs them in TF32 (10-bit
  mantissa), which differs between two orderings of the same sums by ~1e-3, beyond the float32
  tolerances below. The bfloat16 comparisons are unaffected."""
  with jax.default_matmul_precision('float32'):
    yield


def _build(config, info):
  return schemes.build_model(config, info, nnx.Rngs(params=0))


def _qkv(dtype, shape):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


def _attention_fns():
  """(name, f(q, k, v, causal) -> out, dtype) for every implementation this machine runs."""
  fns = [
    (
      'explicit',
      lambda q, k, v, causal: attention_xla.xla_attention(q, k, v, 32**-0.5, causal, 0.0, None),
      jnp.float32,
    ),
    (
      'splash',
      lambda q, k, v, causal: tpu_attention.splash_attention(q, k, v, 32**-0.5, causal),
      jnp.float32,
    ),
    (
      'splash_bf16',
      lambda q, k, v, causal: tpu_attention.splash_attention(q, k, v, 32**-0.5, causal),
      jnp.bfloat16,
    ),
  ]
  if ON_GPU:
    fns.append(
      (
        'cudnn',
        lambda q, k, v, causal: attention_cudnn.cudnn_attention(q, k, v, 32**-0.5, causal),
        jnp.bfloat16,
      )
    )
  return fns


@pytest.mark.parametrize('seq_len', [64, 37])  # 37: odd, padded for cuDNN (and for splash to 128)
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('name,fn,dtype', _attention_fns(), ids=[f[0] for f in _attention_fns()])
def test_attention_implementations_match_xla(name, fn, dtype, causal, seq_len):
  """Outputs and q/k/v gradients of each implementation equal those of jax's XLA attention."""
  del name
  q, k, v = _qkv(dtype, (2, seq_len, 4, 32))
  xla = lambda q, k, v, causal: jax.nn.dot_product_attention(  # noqa: E731
    q, k, v, scale=32**-0.5, is_causal=causal, implementation='xla'
  )
  cotangent = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(dtype)

  @functools.partial(jax.jit, static_argnums=0)  # One compilation, not one per operation.
  def value_and_grads(f):
    out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, causal), q, k, v)
    return out, vjp(cotangent)

  out, grads = value_and_grads(fn)
  out_ref, grads_ref = value_and_grads(xla)
  tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_ref, np.float32), **tol)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32), **tol)


@pytest.mark.parametrize(
  'implementation,dtype',
  [('plain', jnp.float32), ('xla', jnp.float32), ('splash', jnp.float32)]
  + ([('cudnn', jnp.bfloat16)] if ON_GPU else []),
)
def test_attention_keeps_qknorm_logit_scale_and_mask(implementation, dtype):
  """A DNT block (QKNorm) with a non-default logit scale equals QKNorm + jax.nn.dot_product_attention at
  that scale; a causal model's outputs do not depend on later tokens. Each implementation this machine
  runs, in the dtype it computes in (cuDNN: bfloat16 only)."""
  model = _build(tiny_config('gpt', block='dnt', num_heads=2, attention=implementation), TEXT_INFO)
  graphdef, state = nnx.split(model.trunk.stack.layers.attn)  # stacked over layers; take layer 0
  attn = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
  attn.logit_scale = 0.3
  x = jax.random.normal(jax.random.key(3), (2, 16, 32)).astype(dtype)
  heads = lambda t: t.reshape(2, 16, 2, 16)  # noqa: E731
  q, k, v = attn.q_norm(heads(attn.q(x))), attn.k_norm(heads(attn.k(x))), heads(attn.v(x))
  reference = attn.o(
    jax.nn.dot_product_attention(q, k, v, scale=0.3, is_causal=True, implementation='xla').reshape(2, 16, 32)
  )
  out = attn(x, None)
  tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32), **tol)
  x2 = x.at[:, 8:].set(0.0)
  np.testing.assert_allclose(
    np.asarray(attn(x2, None)[:, :8], np.float32), np.asarray(out[:, :8], np.float32), rtol=1e-5, atol=1e-5
  )


# Not causal slow (~15 s): the same rule without the mask; a ViT's gradients through it are compared with
# the plain attention's by default in tests/models/test_attention_implementations.py.
@pytest.mark.parametrize('causal', [pytest.param(False, marks=pytest.mark.slow), True])
def test_xla_attention_derivative_rule_in_both_modes_and_its_cpu_forms(causal, monkeypatch):
  """The XLA path's own derivative rule: forward mode and the gradients equal those of jax's XLA
  attention with each of the CPU's transposed key/value gradient forms on or off; each form puts one
  optimization barrier per query block into the CPU's backward pass and none into a GPU's or TPU's
  (exported here without one); bfloat16 inputs get bfloat16 derivatives close to the float32 ones."""
  q, k, v = _qkv(jnp.float32, (2, 37, 4, 8))  # 37: uneven query blocks (10, 9, 9, 9)
  tangents = tuple(jax.random.normal(key, q.shape) for key in jax.random.split(jax.random.key(5), 3))
  ours = lambda q, k, v: attention_xla.xla_attention(q, k, v, 8**-0.5, causal, 0.0, None)  # noqa: E731
  xla = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
    q, k, v, scale=8**-0.5, is_causal=causal, implementation='xla'
  )
  grad = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sin(f(q, k, v)).sum(), (0, 1, 2)))  # noqa: E731
  jvp = lambda f, *tangents: jax.jit(lambda *primals: jax.jvp(f, primals, tangents))  # noqa: E731
  want_jvp, want_grad = jvp(xla, *tangents)(q, k, v), grad(xla)(q, k, v)
  blocks = 4 if causal else 1
  for key_form, value_form in [(True, True), (True, False), (False, True), (False, False)]:
    monkeypatch.setattr(attention_xla, 'TRANSPOSED_ATTENTION_KEY_GRADIENT', key_form)
    monkeypatch.setattr(attention_xla, 'TRANSPOSED_ATTENTION_VALUE_GRADIENT', value_form)
    for got, want in [
      *zip(jvp(ours, *tangents)(q, k, v), want_jvp),
      *zip(grad(ours)(q, k, v), want_grad),
    ]:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for platform in ('cpu', 'cuda', 'tpu'):
      module = jax.export.export(grad(ours), platforms=[platform])(q, k, v).mlir_module()
      expected = blocks * (key_form + value_form) if platform == 'cpu' else 0
      assert module.count('stablehlo.optimization_barrier') == expected, (platform, key_form, value_form)
  q16, k16, v16 = (t.astype(jnp.bfloat16) for t in (q, k, v))
  tangent16 = jvp(ours, *(t.astype(jnp.bfloat16) for t in tangents))(q16, k16, v16)[1]
  chex.assert_type(tangent16, jnp.bfloat16)
  for got, want in zip(grad(ours)(q16, k16, v16), want_grad):
    chex.assert_type(got, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05 * np.abs(want).max())


def test_causal_attention_with_dropout_sees_no_later_token():
  """The causal path's query blocks each draw their own dropout mask and still see only earlier keys."""
  q, k, v = _qkv(jnp.float32, (2, 37, 4, 8))
  attend = lambda k, v: attention_xla.xla_attention(  # noqa: E731
    q, k, v, 8**-0.5, True, 0.5, jax.random.key(7)
  )
  out = attend(k, v)
  later = lambda t: t.at[:, 20:].set(3.0)  # noqa: E731
  np.testing.assert_allclose(attend(later(k), later(v))[:, :20], out[:, :20], rtol=1e-6, atol=1e-6)
  assert not np.allclose(out, attention_xla.xla_attention(q, k, v, 8**-0.5, True, 0.0, None))


def test_auto_resolution():
  m = tiny_config('gpt').model
  assert models.compute_dtype(m, 'cpu') == 'float32' and models.compute_dtype(m, 'gpu') == 'bfloat16'
  assert models.attention_implementation(m, 'cpu') == 'xla'
  assert models.attention_implementation(m, 'gpu') == 'cudnn'
  # A concatenation residual's attention has its own head dimension (e.g. 30: not a multiple of 8).
  assert models.attention_implementation(m, 'gpu', head_dim=30) == 'xla'
  m.attention = 'cudnn'
  with pytest.raises(ValueError, match=r'the head dimension, 30\) must be a multiple of 8'):
    models.attention_implementation(m, 'gpu', head_dim=30)
  m.attention = 'auto'
  m.attn_dropout = 0.1
  assert models.attention_implementation(m, 'gpu') == 'xla'
  m.attn_dropout, m.dtype = 0.0, 'float32'
  assert models.attention_implementation(m, 'gpu') == 'xla'
  m.attention = 'cudnn'
  with pytest.raises(ValueError, match='model.attention=cudnn needs model.dtype'):
    models.attention_implementation(m, 'gpu')
  m.dtype = 'bfloat16'
  with pytest.raises(ValueError, match='needs the backend that must be a GPU'):
    models.attention_implementation(m, 'cpu')
  # TPU: the splash kernel, in any compute dtype and at any head dimension; not with attention dropout.
  m.attention, m.dtype = 'auto', 'float32'
  assert models.attention_implementation(m, 'tpu') == 'splash'
  assert models.attention_implementation(m, 'tpu', head_dim=30) == 'splash'
  m.attn_dropout = 0.1
  assert models.attention_implementation(m, 'tpu') == 'xla'
  m.attention = 'splash'
  with pytest.raises(ValueError, match='model.attention=splash needs model.attn_dropout that must be 0'):
    models.attention_implementation(m, 'tpu')
  m.attn_dropout = 0.0
  assert models.attention_implementation(m, 'cpu') == 'splash'  # Pallas' interpreter
  # 'plain' and 'xla' are taken as asked on every backend, also with attention dropout.
  for name in ('plain', 'xla'):
    m.attention, m.attn_dropout = name, 0.1
    assert [models.attention_implementation(m, b) for b in ('cpu', 'gpu', 'tpu')] == [name] * 3


@pytest.mark.parametrize('length', [197, 256])
@pytest.mark.parametrize('causal', [False, True])
def test_splash_attention_lowers_to_the_tpu_kernel(causal, length, monkeypatch):
  """The splash path's gradient exported for a TPU (no TPU needed: Pallas lowers its kernels to Mosaic
  custom calls) holds the kernel's forward and backward custom calls and no interpreted copy of them,
  at ViT-B/16's odd length (197, padded to 256 with segment ids), at 256 (no padding) and GPT-2 small's
  head dimension (64)."""
  monkeypatch.setattr(tpu_attention, 'INTERPRET', False)
  q, k, v = _qkv(jnp.bfloat16, (2, length, 2, 64))

  def loss(q, k, v):
    return tpu_attention.splash_attention(q, k, v, 0.125, causal).astype(jnp.float32).sum()

  module = jax.export.export(jax.jit(jax.grad(loss, (0, 1, 2))), platforms=['tpu'])(q, k, v).mlir_module()
  # The forward kernel, and the backward's dq and dk/dv kernels.
  assert module.count('tpu_custom_call') >= 3, module.count('tpu_custom_call')
  assert 'stablehlo.while' not in module  # the interpreter runs the kernel's grid as loops


@pytest.mark.parametrize(
  'capability,expected', [('9.0', 'cudnn'), ('8.0', 'cudnn'), ('7.5', 'xla'), ('gfx90a', 'xla')]
)  # gfx90a: a ROCm GPU
def test_auto_attention_asks_the_gpu_its_compute_capability(monkeypatch, capability, expected):
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  monkeypatch.setattr(jax, 'devices', lambda *a: [types.SimpleNamespace(compute_capability=capability)])
  assert models.attention_implementation(tiny_config('gpt').model) == expected


@pytest.mark.parametrize('model_name,info', [('gpt', TEXT_INFO), ('vit', IMAGE_INFO)])
def test_bfloat16_compute_keeps_float32_stream_and_logits(model_name, info):
  """bf16 branches, a float32 residual stream and float32 parameters; logits close to float32's."""
  f32 = _build(tiny_config(model_name, dtype='float32'), info)
  bf16 = _build(tiny_config(model_name, dtype='bfloat16'), info)
  x = (
    jnp.zeros((2, 16), jnp.int32) + jnp.arange(16)
    if model_name == 'gpt'
    else jax.random.normal(jax.random.key(0), (2, 8, 8, 1))
  )
  seen = {}
  probe = lambda site, h, layer: seen.setdefault(site, h.dtype) and h  # noqa: E731
  logits_f32, logits_bf16 = f32(x), bf16(x, probe=probe)
  assert seen['attn_branch'] == jnp.bfloat16 and seen['ffn_residual'] == jnp.float32
  chex.assert_trees_all_equal_dtypes(nnx.state(f32, nnx.Param), nnx.state(bf16, nnx.Param))
  np.testing.assert_allclose(np.asarray(logits_bf16, np.float32), logits_f32, rtol=0.1, atol=0.1)


def _dtypes_by_rank(params) -> dict[str, set]:
  """The dtypes of the stacked per-layer matrices (ndim 3) and vectors (ndim 2) of the layer stack."""
  stack = params['trunk']['stack']['layers']
  leaves = jax.tree.leaves(stack)
  return {
    'matrices': {x.dtype for x in leaves if x.ndim == 3},
    'vectors': {x.dtype for x in leaves if x.ndim == 2},
  }


def test_narrowing_matmul_matches_the_plain_one_and_transposes_its_weight_gradient_on_cpu_only():
  """A kernel with more rows than columns: value, gradients and forward-mode derivative equal the plain
  matmul's; the weight gradient's transposed form (behind an optimization barrier) is lowered for the
  CPU and not for GPUs or TPUs (lowered here without one)."""
  x = jax.random.normal(jax.random.key(0), (4, 8, 48))
  w = jax.random.normal(jax.random.key(1), (48, 16))
  loss = lambda f: lambda x, w: jnp.sin(f(x, w)).sum()  # noqa: E731
  ours, plain = loss(fast_matmul.matmul_last_axis), loss(lambda x, w: x @ w)
  np.testing.assert_allclose(fast_matmul.matmul_last_axis(x, w), x @ w, rtol=1e-6, atol=1e-5)
  for got, want in zip(jax.jit(jax.grad(ours, (0, 1)))(x, w), jax.grad(plain, (0, 1))(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  tangent = jax.jvp(lambda w: fast_matmul.matmul_last_axis(x, w), (w,), (0.5 * w,))[1]
  np.testing.assert_allclose(tangent, 0.5 * (x @ w), rtol=1e-5, atol=1e-5)
  for platform, transposed in (('cpu', True), ('cuda', False), ('tpu', False)):
    module = jax.export.export(jax.jit(jax.grad(ours, (0, 1))), platforms=[platform])(x, w).mlir_module()
    assert ('optimization_barrier' in module) == transposed, platform


def test_float32_logits_keep_the_backward_matmuls_in_bfloat16():
  """The head writes float32 logits from bf16 inputs; its input and weight gradients stay bf16 matmuls
  (not float32 ones, which the float32 output gradient would otherwise make them), and close to the
  float32 computation's."""
  x = jax.random.normal(jax.random.key(0), (4, 8, 16)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (16, 32)).astype(jnp.bfloat16)
  loss = lambda x, w: (fast_matmul.matmul_last_axis(x, w, jnp.float32) ** 2).sum()  # noqa: E731
  chex.assert_type(fast_matmul.matmul_last_axis(x, w, jnp.float32), jnp.float32)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w).jaxpr
  products = [eqn.outvars[0].aval.dtype for eqn in jaxpr.eqns if eqn.primitive.name == 'dot_general']
  assert products == [jnp.bfloat16, jnp.bfloat16], products  # dx and dw (the forward one is nested)
  grads = jax.grad(loss, argnums=(0, 1))(x, w)
  f32 = lambda x, w: ((x.astype(jnp.float32) @ w.astype(jnp.float32)) ** 2).sum()  # noqa: E731
  for got, want in zip(grads, jax.grad(f32, argnums=(0, 1))(x, w)):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.02, atol=0.02 * np.abs(want).max())


def test_bfloat16_params_keep_float32_optimizer_state():
  model = _build(tiny_config('gpt', param_dtype='bfloat16'), TEXT_INFO)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert _dtypes_by_rank(params) == {
    'matrices': {jnp.dtype(jnp.bfloat16)},
    'vectors': {jnp.dtype(jnp.float32)},
  }
  assert params['token_embed'].dtype == jnp.bfloat16 and params['head']['kernel'].dtype == jnp.bfloat16
  tx, _ = optimizers.make_optimizer(tiny_config('gpt').optimizer, 10)
  opt_state = jax.jit(tx.init)(params)  # jitted: one compilation, not one per operation
  float_leaves = [x for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert float_leaves and all(x.dtype == jnp.float32 for x in float_leaves)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = jax.jit(tx.update)(grads, opt_state, params)
  new_params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
  chex.assert_trees_all_equal_dtypes(new_params, params)


def test_bfloat16_params_keep_the_class_token_float32():
  model = _build(tiny_config('vit', param_dtype='bfloat16', pooling='cls'), IMAGE_INFO)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert params['cls_token'].dtype == jnp.float32  # (1, 1, d): a vector
  assert params['patch_embed']['kernel'].dtype == jnp.bfloat16


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('model_name,info', [('gpt', TEXT_INFO), ('vit', IMAGE_INFO)])
def test_bfloat16_params_train(model_name, info, dtype):
  """bfloat16 weight matrices train through the scanned stack at either compute dtype: float32 logits
  and loss, and an AdamW step moves the float32 norm gains as well as the bf16 kernels."""
  model = _build(tiny_config(model_name, param_dtype='bfloat16', dtype=dtype), info)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if model_name == 'gpt':
    x, labels = jnp.arange(32).reshape(2, 16) % 256, jnp.arange(1, 33).reshape(2, 16) % 256
  else:
    x, labels = jax.random.normal(jax.random.key(0), (2, 8, 8, 1)), jnp.array([3, 7])

  def loss_fn(p):
    logits = nnx.merge(graphdef, p, rest)(x)
    chex.assert_type(logits, jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))

  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  assert np.isfinite(loss)
  tx, _ = optimizers.make_optimizer(tiny_config(model_name).optimizer, 10)

  @jax.jit  # One compilation, not one per operation.
  def step(p, o):
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), o

  new, opt_state = params, jax.jit(tx.init)(params)
  for _ in range(2):  # the first step's learning rate is 0 (warm-up)
    new, opt_state = step(new, opt_state)
  new, old = nnx.to_pure_dict(new), nnx.to_pure_dict(params)
  stack_old, stack_new = (t['trunk']['stack']['layers'] for t in (old, new))
  for name in ('pre_attn_norm', 'pre_ffn_norm'):
    if name in stack_old:  # the blocks' norm gains (float32) move on the first step
      assert stack_new[name]['scale'].dtype == jnp.float32
      assert np.any(np.asarray(stack_new[name]['scale']) != np.asarray(stack_old[name]['scale']))
  assert stack_new['ffn']['ffn1']['kernel'].dtype == jnp.bfloat16
  assert np.any(
    np.asarray(stack_new['ffn']['ffn1']['kernel'], np.float32)
    != np.asarray(stack_old['ffn']['ffn1']['kernel'], np.float32)
  )


@pytest.mark.slow  # Kept out of the default suite for its time (> 20 s).
def test_layer_stack_options_compute_the_same():
  """Unrolled scans, the Python loop and rematerialisation change how, not what: same loss and grads."""

  def loss_and_grads(**overrides):
    model = _build(
      tiny_config('gpt', depth=3, dropout=0.1, dtype='float32', attention='xla', **overrides), TEXT_INFO
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.arange(32).reshape(2, 16)
    loss = lambda p: nnx.merge(graphdef, p, rest)(tokens, dropout_key=jax.random.key(1)).mean()  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(params)

  ref_loss, ref_grads = loss_and_grads()
  for option in (
    dict(scan_unroll=2),
    dict(scan_unroll=5),
    dict(scan_layers=False),
    dict(remat='full'),
    dict(remat='dots_saveable'),
  ):
    loss, grads = loss_and_grads(**option)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=str(option))
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
