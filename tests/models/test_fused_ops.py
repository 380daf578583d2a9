"""The fused kernels of `model.fused_ops='pallas'` (`dsjax.models.fused_ops`) against the plain math.

On the CPU the kernels run in Pallas' interpreter: the same blocks, masks and loops as on a GPU. Each
kernel's outputs and gradients (through its custom VJP, against JAX's derivative of the plain function)
are compared in float32 and bfloat16, at widths that are not powers of two (48, 96) and at GPT-2 small's
768 (3072 for the GELU), LayerNorm and RMSNorm, scalar and vector residual scales; then a whole tiny GPT
(configs/gpt_preln.py) trains on the same loss and gradients with the kernels as without. The kernels
also lower to Triton for a CUDA GPU (no GPU needed to lower). On a GPU (`JAX_PLATFORMS=cuda`) the same
tests run the compiled kernels; whether they are faster there is for the benchmark to show.
"""

import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from dsjax import models, schemes
from dsjax.models import config as config_lib
from dsjax.models import fused_ops
from dsjax.models.config import RESUMABLE_KEYS, model_config, validate_model
from tests.helpers import TEXT_INFO

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH_AXES = ('data', 'fsdp', 'tensor')  # as dsjax.train.sharding names them, with Auto axes as it makes
ROWS = (2, 13)  # 26 rows: the last row block of every kernel is partly past the end


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """float32 matmuls in full precision (NVIDIA GPUs default to TF32, beyond the tolerances below)."""
  with jax.default_matmul_precision('float32'):
    yield


EIGHT_DEVICES = pytest.mark.skipif(len(jax.devices()) < 8, reason='needs 8 devices (the CPU simulates them)')


def _assert_close(got, want, dtype, terms: int = 1):
  """float32: to 1e-5 of the largest magnitude; bfloat16: to 2% of it (a few bf16 roundings). A
  gradient summed over `terms` products of order 1 (a parameter's, over rows) is held to sqrt(terms)
  times that: its rounding grows with the terms summed, not with the sum, which may cancel."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(np.abs(want).max(), np.sqrt(terms)))


def _terms(g, rows: int, width: int) -> int:
  """How many products a gradient sums: a (width,) parameter's over the rows, a scalar's over all."""
  return {0: rows * width, 1: rows}.get(g.ndim, 1)


def _normal(seed, shape, dtype=jnp.float32, scale=1.0, shift=0.0):
  return (shift + scale * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


def _vjp_both(fused, reference, args, cotangents):
  """(outputs, input gradients) of the fused function and of the reference, for the same cotangents."""
  results = []
  for fn in (fused, reference):
    out, vjp = jax.vjp(fn, *args)
    results.append((out, vjp(cotangents)))
  return results


def _norm_params(width, kind):
  gain = _normal(2, (width,), scale=0.1, shift=1.0)
  return gain, _normal(3, (width,), scale=0.1) if kind == 'layernorm' else None


@pytest.mark.parametrize('kind', ['layernorm', 'rmsnorm'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('width', [48, 96, 768])
def test_norm_cast_matches_the_plain_norm(width, dtype, kind):
  """Norm(x) cast to the compute dtype, x in that dtype; gradients of x, the gain and the bias."""
  x = _normal(0, (*ROWS, width), dtype, scale=2.0, shift=0.5)
  gain, bias = _norm_params(width, kind)
  norm = dict(kind=kind, eps=1e-6, out_dtype=dtype)
  cotangent = _normal(4, x.shape, dtype)
  (out, grads), (out_ref, grads_ref) = _vjp_both(
    lambda x, g, b: fused_ops.norm_cast(x, g, b, **norm),
    lambda x, g, b: fused_ops.norm_cast_reference(x, g, b, **norm),
    (x, gain, bias),
    cotangent,
  )
  assert out.dtype == out_ref.dtype == dtype
  _assert_close(out, out_ref, dtype)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert g.dtype == g_ref.dtype
    _assert_close(g, g_ref, dtype, terms=_terms(g, x.size // width, width))


@pytest.mark.parametrize('scales', ['scalar', 'vector', 'vector and branch bias'])
@pytest.mark.parametrize('kind', ['layernorm', 'rmsnorm'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('width', [48, 96, 768])
def test_residual_norm_matches_the_plain_add_and_norm(width, dtype, kind, scales):
  """(λ·x + β·h, Norm(λ·x + β·h) in the compute dtype): the float32 stream x, the branch output h in the
  compute dtype (with the bias of the matmul that wrote it added in the kernel, or not); gradients of x,
  h, λ, β, the gain, the bias and the branch's bias, through both outputs."""
  x = _normal(0, (*ROWS, width), scale=2.0, shift=0.5)
  h = _normal(1, x.shape, dtype)
  if scales == 'scalar':
    skip, branch = jnp.asarray(0.9, jnp.float32), jnp.asarray(0.4, jnp.float32)
  else:
    skip, branch = _normal(5, (width,), scale=0.05, shift=0.9), _normal(6, (width,), scale=0.05, shift=0.4)
  gain, bias = _norm_params(width, kind)
  norm = dict(kind=kind, eps=1e-6, out_dtype=dtype)
  cotangents = (_normal(7, x.shape), _normal(8, x.shape, dtype))
  args = (x, h, skip, branch, gain, bias)
  if scales == 'vector and branch bias':
    args += (_normal(9, (width,), scale=0.3),)
  (out, grads), (out_ref, grads_ref) = _vjp_both(
    lambda *a: fused_ops.residual_norm(*a[:6], **norm, branch_bias=a[6] if len(a) > 6 else None),
    lambda *a: fused_ops.residual_norm_reference(*a[:6], **norm, branch_bias=a[6] if len(a) > 6 else None),
    args,
    cotangents,
  )
  assert out[0].dtype == jnp.float32 and out[1].dtype == dtype
  np.testing.assert_allclose(out[0], out_ref[0], rtol=1e-6, atol=1e-6)  # the stream: no rounding to bf16
  _assert_close(out[1], out_ref[1], dtype)
  rows = x.size // width
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert g.shape == g_ref.shape and g.dtype == g_ref.dtype
    _assert_close(g, g_ref, dtype, terms=_terms(g, rows, width))


def test_the_backward_kernels_loop_over_row_blocks(monkeypatch):
  """With few programs each one loops over several row blocks (the last ones past the end of the rows)
  and sums its parameter gradients across them: the same gradients."""
  monkeypatch.setattr(fused_ops, 'BACKWARD_PROGRAMS', 3)
  monkeypatch.setattr(fused_ops, 'BLOCK_ELEMENTS', 256)  # 2 rows of 128 columns, 13 row blocks
  x, h = _normal(0, (26, 96), scale=2.0), _normal(1, (26, 96))
  gain, bias = _norm_params(96, 'layernorm')
  norm = dict(kind='layernorm', eps=1e-6, out_dtype=jnp.float32)
  args = (x, h, jnp.asarray(0.9, jnp.float32), jnp.asarray(0.4, jnp.float32), gain, bias)
  (_, grads), (_, grads_ref) = _vjp_both(
    lambda *a: fused_ops.residual_norm(*a, **norm),
    lambda *a: fused_ops.residual_norm_reference(*a, **norm),
    args,
    (_normal(7, x.shape), _normal(8, x.shape)),
  )
  for g, g_ref in zip(grads, grads_ref):
    _assert_close(g, g_ref, jnp.float32, terms=_terms(g, 26, 96))
  z = _normal(2, (26, 96), scale=3.0)
  (_, grads), (_, grads_ref) = _vjp_both(
    fused_ops.bias_gelu, fused_ops.bias_gelu_reference, (z, bias), _normal(3, z.shape)
  )
  for g, g_ref in zip(grads, grads_ref):
    _assert_close(g, g_ref, jnp.float32, terms=_terms(g, 26, 96))


@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('width', [96, 3072])
def test_bias_gelu_matches_the_plain_exact_gelu(width, dtype, bias):
  """GELU(z + b), exact (erf): z the first FFN matmul's output in the compute dtype, b float32."""
  z = _normal(0, (*ROWS, width), dtype, scale=3.0)
  b = _normal(1, (width,), scale=0.5) if bias else None
  cotangent = _normal(2, z.shape, dtype)
  args = (z, b) if bias else (z,)
  (out, grads), (out_ref, grads_ref) = _vjp_both(
    lambda z, *b: fused_ops.bias_gelu(z, *b, *([None] * (not bias))),
    lambda z, *b: fused_ops.bias_gelu_reference(z, *b, *([None] * (not bias))),
    args,
    cotangent,
  )
  assert out.dtype == dtype
  _assert_close(out, out_ref, dtype)
  for g, g_ref in zip(grads, grads_ref):
    assert g.dtype == g_ref.dtype
    _assert_close(g, g_ref, dtype, terms=_terms(g, z.size // width, width))


def test_the_kernels_erf_is_xlas_float32_erf():
  """Triton's Pallas lowering has no erf: the kernel's rational approximation equals `lax.erf` to within
  float32 rounding, far into both tails."""
  u = jnp.concatenate([jnp.linspace(-6.0, 6.0, 100_001, dtype=jnp.float32), jnp.asarray([-40.0, 40.0])])
  np.testing.assert_allclose(fused_ops._erf(u), jax.lax.erf(u), rtol=0, atol=5e-7)


def _fma_rounded_once(a, b, c, fused):
  """a·b + c rounded to float32 once, as the GPU's `fma.rn.f32` rounds it: the float64 product of two
  float32 numbers is exact, and its float64 sum with a third is rounded twice only in rare ties."""
  assert fused
  wide = lambda v: np.asarray(v, np.float64)  # noqa: E731
  return jnp.asarray(wide(a) * wide(b) + wide(c), jnp.float32)


def test_with_fused_multiply_adds_the_kernels_math_is_the_same_to_float32_rounding(monkeypatch):
  """`GELU_FMA`'s arithmetic (each a·b + c rounded once, emulated here; φ(u) as a power of two) gives the
  same erf, GELU and GELU' as the plain math (`bias_gelu_reference`: ½u·(1 + erf(u/√2)) with `lax.erf`)
  and JAX's derivative of it, to within float32 rounding (of u's size: 1 + erf cancels in the left
  tail, in both)."""
  monkeypatch.setattr(fused_ops, '_fma', _fma_rounded_once)
  u = jnp.concatenate([jnp.linspace(-6.0, 6.0, 100_001, dtype=jnp.float32), jnp.asarray([-40.0, 40.0])])
  np.testing.assert_allclose(fused_ops._erf(u, fused=True), jax.lax.erf(u), rtol=0, atol=5e-7)
  plain_gelu = lambda v: fused_ops.bias_gelu_reference(v, None)  # noqa: E731
  gaussian = jnp.exp(-0.5 * u * u) / np.sqrt(2 * np.pi)
  np.testing.assert_allclose(fused_ops._gaussian(u, fused=True), gaussian, rtol=2e-6, atol=1e-30)
  for got, want in [
    (fused_ops._gelu(u, fused=True), plain_gelu(u)),
    (fused_ops._gelu_slope(u, fused=True), jax.vmap(jax.grad(plain_gelu))(u)),
  ]:
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= 1e-6 + 2**-23 * np.abs(np.asarray(u)))


# The GPU the kernels are lowered for without one: jax >= 0.11 asks Pallas' Triton lowering for the
# target's compute capability, which an abstract device of an H100's kind names.
H100 = AbstractDevice(device_kind='NVIDIA H100 80GB HBM3', num_cores=132, platform='gpu')


def _lowered_for_a_gpu(fn, *shapes) -> str:
  """The module `fn` lowers to for a CUDA GPU, as text (lowered here; no GPU needed)."""
  check = export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')
  with use_abstract_mesh(AbstractMesh((1,), ('gpu',), abstract_device=H100)):
    return export.export(jax.jit(fn), platforms=['cuda'], disabled_checks=[check])(*shapes).mlir_module()


def _triton_calls(fn, *shapes) -> int:
  """How many Triton kernel calls `fn` lowers to for a CUDA GPU."""
  return _lowered_for_a_gpu(fn, *shapes).count('stablehlo.custom_call @__gpu$xla.gpu.triton')


def test_the_kernels_lower_to_triton_for_a_gpu(monkeypatch):
  """Forward and backward of each kernel at GPT-2 small's widths lower through Pallas' Triton backend
  (power-of-two blocks, every primitive with a Triton rule); compiling them needs a GPU."""
  monkeypatch.setattr(fused_ops, 'INTERPRET', False)
  rows, d, f = 26, 768, 3072
  stream, branch = jax.ShapeDtypeStruct((rows, d), jnp.float32), jax.ShapeDtypeStruct((rows, d), jnp.bfloat16)
  vector, scalar = jax.ShapeDtypeStruct((d,), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)
  norm = dict(kind='layernorm', eps=1e-6, out_dtype=jnp.bfloat16)

  def layer_norms(x, h, skip, branch, gain, bias):
    x_new, y = fused_ops.residual_norm(x, h, skip, branch, gain, bias, **norm)
    return jnp.sum(x_new) + jnp.sum(y.astype(jnp.float32) * fused_ops.norm_cast(x, gain, bias, **norm))

  grad = jax.grad(layer_norms, argnums=tuple(range(6)))
  assert _triton_calls(grad, stream, branch, scalar, vector, vector, vector) == 4
  gelu = jax.grad(lambda z, b: jnp.sum(fused_ops.bias_gelu(z, b).astype(jnp.float32) ** 2), argnums=(0, 1))
  assert (
    _triton_calls(
      gelu, jax.ShapeDtypeStruct((rows, f), jnp.bfloat16), jax.ShapeDtypeStruct((f,), jnp.float32)
    )
    == 2
  )


def _pallas_operands(jaxpr) -> list[list[tuple[int, ...]]]:
  """The operand shapes of every Pallas kernel call in `jaxpr`, nested jaxprs (custom VJPs) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'pallas_call':
      found.append([tuple(v.aval.shape) for v in eqn.invars])
    for param in eqn.params.values():
      inner = getattr(param, 'jaxpr', param)
      if hasattr(inner, 'eqns'):
        found += _pallas_operands(inner)
  return found


def test_each_norm_kernel_takes_its_parameters_as_one_operand(monkeypatch):
  """A layer's parameters are slices of the stacked ones, and a kernel takes each operand as a buffer of
  its own (one copy each): the norm kernels take theirs packed in one (k, d) array, forward and
  backward, and their gradients come back as one (k, d) sum."""
  monkeypatch.setattr(fused_ops, 'INTERPRET', False)
  d, norm = 768, dict(kind='layernorm', eps=1e-6, out_dtype=jnp.bfloat16)

  def layer_norms(x, h, gain, bias):
    x_new, y = fused_ops.residual_norm(x, h, 1.0, 1.0, gain, bias, **norm)
    return jnp.sum(x_new) + jnp.sum(y.astype(jnp.float32) * fused_ops.norm_cast(x, gain, bias, **norm))

  args = (jnp.zeros((26, d)), jnp.zeros((26, d), jnp.bfloat16), jnp.zeros(d), jnp.zeros(d))
  jaxpr = jax.make_jaxpr(jax.grad(layer_norms, argnums=(0, 1, 2, 3)))(*args).jaxpr
  rows = (26, d)
  assert sorted(_pallas_operands(jaxpr)) == sorted(
    [
      [rows, rows, (4, d)],  # residual_norm forward: x, h, (λ, β, gain, bias)
      [rows, (2, d)],  # norm_cast forward: x, (gain, bias)
      [rows, rows, (4, d), rows, rows],  # residual_norm backward: x, h, parameters, dstream, dy
      [rows, (2, d), rows],  # norm_cast backward: x, parameters, dy
    ]
  )


@pytest.mark.parametrize('fma', [False, True])
def test_the_gpu_kernels_hold_fused_multiply_adds_only_when_asked(monkeypatch, fma):
  """With `GELU_FMA` on, the GELU kernels lowered for a GPU carry the inline `fma.rn.f32` (in the Triton
  module's strings); off, they do not. In the interpreter `_fma` is a·b + c either way."""
  monkeypatch.setattr(fused_ops, 'INTERPRET', False)
  monkeypatch.setattr(fused_ops, 'GELU_FMA', fma)
  gelu = jax.grad(lambda z, b: jnp.sum(fused_ops.bias_gelu(z, b).astype(jnp.float32) ** 2), argnums=(0, 1))
  shapes = jax.ShapeDtypeStruct((26, 3072), jnp.bfloat16), jax.ShapeDtypeStruct((3072,), jnp.float32)
  assert ('fma.rn.f32 $0, $1, $2, $3;' in _lowered_for_a_gpu(gelu, *shapes)) == fma


@EIGHT_DEVICES
def test_on_a_mesh_the_kernels_run_per_device():
  """On a (2, 2, 2) mesh with the activations' logical axis rules each kernel runs inside
  `jax.shard_map` (rows over data×fsdp, the GELU's columns over tensor): the same values and gradients,
  the parameters' gradients summed over the devices."""
  mesh = jax.make_mesh((2, 2, 2), MESH_AXES, devices=jax.devices()[:8], axis_types=(AxisType.Auto,) * 3)
  rules = (('batch', ('data', 'fsdp')), ('mlp', 'tensor'))
  x, h = _normal(0, (8, 5, 48), scale=2.0), _normal(1, (8, 5, 48))
  gain, bias = _norm_params(48, 'layernorm')
  z = _normal(2, (8, 5, 192), scale=3.0)
  norm = dict(kind='layernorm', eps=1e-6, out_dtype=jnp.float32)

  def loss(forms, x, h, gain, bias, z):
    residual_norm, norm_cast, bias_gelu = forms
    x_new, y = residual_norm(x, h, jnp.float32(0.9), jnp.float32(0.4), gain, bias, **norm)
    y = y + norm_cast(x_new, gain, bias, **norm)
    return jnp.sum(jnp.sin(x_new) * y) + jnp.sum(jnp.cos(bias_gelu(z, bias.repeat(4))))

  fused = (fused_ops.residual_norm, fused_ops.norm_cast, fused_ops.bias_gelu)
  plain = (fused_ops.residual_norm_reference, fused_ops.norm_cast_reference, fused_ops.bias_gelu_reference)
  args = (x, h, gain, bias, z)
  want = jax.value_and_grad(lambda *a: loss(plain, *a), argnums=tuple(range(5)))(*args)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    step = jax.jit(jax.value_and_grad(lambda *a: loss(fused, *a), argnums=tuple(range(5))))
    got = step(*args)
    assert 'shard_map' in str(jax.make_jaxpr(step)(*args))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, g_ref in zip(got[1], want[1]):
    _assert_close(g, g_ref, jnp.float32, terms=_terms(g, 40, 192))
  assert fused_ops._row_spec(40, ('mlp', 192)) is None  # no mesh: no shard_map


def _gpt_config(**model):
  """configs/gpt_preln.py at a tiny size: 2 layers of width 48 (not a power of two), seq 16."""
  spec = importlib.util.spec_from_file_location('gpt_preln', ROOT / 'configs' / 'gpt_preln.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.model.depth, c.model.width, c.model.num_heads, c.model.scan_unroll = 2, 48, 4, 2
  c.data.seq_len = 16
  for key, value in model.items():
    c.model[key] = value
  return c


def _loss_and_grads(config):
  model = schemes.build_model(config, TEXT_INFO, nnx.Rngs(params=0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(1), (2, config.data.seq_len + 1), 0, 256)

  def loss(params):
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  return jax.jit(jax.value_and_grad(loss))(params), jax.make_jaxpr(loss)(params)


# preln-f32 is slow (14 s): preln-bf16 runs the Pre-LN kernels, dnt-rmsnorm-f32-remat the float32 ones.
@pytest.mark.parametrize(
  'overrides',
  [
    pytest.param(dict(dtype='float32'), marks=pytest.mark.slow),
    dict(dtype='bfloat16'),
    dict(dtype='float32', norm='rmsnorm', block='dnt', remat='full'),
  ],
  ids=['preln-f32', 'preln-bf16', 'dnt-rmsnorm-f32-remat'],
)
def test_a_gpt_trains_on_the_same_loss_and_gradients_with_the_kernels(overrides):
  """The whole model (configs/gpt_preln.py, tiny): loss and every parameter gradient with
  model.fused_ops='pallas' as with 'none', and the kernels are in the step."""
  (loss, grads), jaxpr = _loss_and_grads(_gpt_config(fused_ops='pallas', **overrides))
  (loss_ref, grads_ref), jaxpr_ref = _loss_and_grads(_gpt_config(fused_ops='none', **overrides))
  assert 'pallas_call' in str(jaxpr) and 'pallas_call' not in str(jaxpr_ref)
  tol = 1e-5 if overrides['dtype'] == 'float32' else 2e-2
  np.testing.assert_allclose(loss, loss_ref, rtol=tol)
  # Left out: the key's bias, whose gradient vanishes analytically (it shifts all logits of a query's row
  # alike, which the softmax ignores) and so is rounding noise of either form.
  for (path, g), g_ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref)):
    if "['k']['bias']" in jax.tree_util.keystr(path):
      continue
    g, g_ref = np.asarray(g, np.float32), np.asarray(g_ref, np.float32)
    atol = (1e-4 if overrides['dtype'] == 'float32' else 5e-2) * max(np.abs(g_ref).max(), 1e-3)
    np.testing.assert_allclose(g, g_ref, rtol=tol, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_an_instrumented_step_runs_the_residual_add_as_written_and_keeps_the_other_kernels():
  """With a probe (the instrumentation's) the attention's residual add runs as written: a probe must see
  the stream between that add and the norm after it, which the residual-norm kernel keeps inside. Both
  norms still run as norm-and-cast kernels, fed the stream the probe saw, and the FFN's bias and GELU
  stay fused."""
  model = schemes.build_model(_gpt_config(fused_ops='pallas'), TEXT_INFO, nnx.Rngs(params=0))
  tokens = jnp.zeros((2, 16), jnp.int32)
  seen = []

  def probe(site, x, layer):
    seen.append(site)
    return x

  probed = str(jax.make_jaxpr(lambda t: model(t, probe=probe))(tokens))
  assert 'attn_residual' in seen
  # The fused forms by their custom VJPs' names (both norm forms' kernels are named fused_residual_norm).
  fused = lambda jaxpr: sorted(re.findall(r'name=(_norm_cast|_residual_norm|_bias_gelu)\b', jaxpr))  # noqa: E731
  assert fused(probed) == ['_bias_gelu', '_norm_cast', '_norm_cast']
  plain = str(jax.make_jaxpr(lambda t: model(t))(tokens))
  assert fused(plain) == ['_bias_gelu', '_norm_cast', '_residual_norm']


def test_the_switch_resolves_auto_to_the_kernels_only_where_a_gpu_measured_them_faster():
  """'auto' takes the kernels on a GPU with bfloat16 branches at a width of at least 768 (measured faster
  there) and the plain math elsewhere; an explicit value is taken as it is; an unknown one is refused in
  one line."""
  m = model_config('gpt')
  assert m.fused_ops == 'auto' and m.width < config_lib.FUSED_OPS_AUTO_MIN_WIDTH
  for backend in ('cpu', 'gpu', 'tpu'):
    assert models.fused_ops_implementation(m, backend) == 'none'
  assert models.transformer_config(model_config('gpt')).fused_ops == 'none'  # on this CPU
  m.width = config_lib.FUSED_OPS_AUTO_MIN_WIDTH
  assert models.fused_ops_implementation(m, 'gpu') == 'pallas'
  assert models.fused_ops_implementation(m, 'tpu') == 'none'
  assert models.fused_ops_implementation(m, 'cpu') == 'none'
  m.dtype = 'float32'  # unmeasured: the plain math
  assert models.fused_ops_implementation(m, 'gpu') == 'none'
  m.fused_ops = 'none'
  assert models.fused_ops_implementation(m, 'gpu') == 'none'
  m.fused_ops = 'pallas'
  assert models.fused_ops_implementation(m, 'gpu') == 'pallas'
  assert models.fused_ops_implementation(m, 'cpu') == 'pallas'  # in the interpreter, with a warning
  m.fused_ops = 'triton'
  with pytest.raises(ValueError, match=r"model.fused_ops must be one of \['auto', 'none', 'pallas'\]"):
    validate_model(m)


def test_a_gelu_tiling_of_sizes_triton_cannot_take_is_refused():
  assert fused_ops.gelu_tiles() == fused_ops.GeluTiles(
    fused_ops.BLOCK_ELEMENTS, fused_ops.COLUMN_BLOCK, fused_ops.BACKWARD_PROGRAMS, fused_ops.NUM_WARPS
  )
  with pytest.raises(ValueError, match='GeluTiles.column_block must be a positive power of two, got 768'):
    fused_ops.GeluTiles(4096, 768, 256, 4)
  with pytest.raises(ValueError, match='GeluTiles.num_warps must be a positive power of two, got 0'):
    fused_ops.GeluTiles(4096, 1024, 256, 0)


def test_the_switch_is_resumable():
  """The kernels compute the same function: a run may resume with another model.fused_ops."""
  assert 'fused_ops' in RESUMABLE_KEYS


@EIGHT_DEVICES
def test_on_a_mesh_without_axis_rules_the_kernels_refuse_to_run():
  """A Pallas kernel cannot be partitioned by XLA: on several devices without the rule for 'batch'
  (`sharding.use_mesh` sets it) there is no per-device layout to run it in."""
  mesh = jax.make_mesh((8, 1, 1), MESH_AXES, devices=jax.devices()[:8], axis_types=(AxisType.Auto,) * 3)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="needs logical axis rules for 'batch'"):
      fused_ops._row_spec(16)


def test_the_kernels_run_under_vmap():
  """A sweep's population vmaps the train step over its members (`dsjax.train.population`): each member
  with its own λ, β, gains and biases gets its own values and gradients."""
  x, h = _normal(0, (3, 26, 48), scale=2.0), _normal(1, (3, 26, 48))
  gain, bias = _normal(2, (3, 48), scale=0.1, shift=1.0), _normal(3, (3, 48), scale=0.1)
  skip, branch = jnp.asarray([0.9, 0.8, 0.7]), jnp.asarray([0.3, 0.2, 0.1])
  norm = dict(kind='layernorm', eps=1e-6, out_dtype=jnp.float32)

  def loss(forms, *args):
    residual_norm, bias_gelu = forms
    x_new, y = residual_norm(*args, **norm)
    return jnp.sum(jnp.sin(x_new) * bias_gelu(y, args[-1]))

  def value_and_grads(forms):
    step = jax.value_and_grad(lambda *a: loss(forms, *a), argnums=tuple(range(6)))
    return jax.vmap(step)(x, h, skip, branch, gain, bias)

  got = value_and_grads((fused_ops.residual_norm, fused_ops.bias_gelu))
  want = value_and_grads((fused_ops.residual_norm_reference, fused_ops.bias_gelu_reference))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, g_ref in zip(got[1], want[1]):
    _assert_close(g, g_ref, jnp.float32, terms=_terms(g[0], 26, 48))
