"""`model.fused_ops='pallas'`: the elementwise chains around the norms and the FFN's activation, each in
one pass over the activations (Pallas kernels for GPUs, Triton backend).

XLA runs a transformer layer's elementwise work — residual adds, norms, casts, the bias and GELU — in
fusions of its own choosing, and each fusion reads and writes whole activations. Two chains are written
here as one kernel forward and one backward, each the same function as the plain math of
`dsjax.models.layers` and `dsjax.models.transformer` up to rounding:
  * `residual_norm`: the stream update x ← λ·x + β·h and the next branch's input Norm(x) cast to the
    compute dtype. Forward: reads x (float32) and h, writes the new float32 stream and the normalised,
    cast branch input. Backward: reads x, h, and the two output gradients, recomputes λ·x + β·h and the
    row statistics (float32), writes the gradients of x and h, and per-program partial sums for the
    gradients of λ, β and the norm's gain and bias (side by side in one (programs, parameters·d) array,
    summed over programs outside in one reduction).
    `norm_cast` is the same without the residual add (a layer's first norm).
  * `bias_gelu`: GELU(z + b), the exact x·Φ(x) (erf form, as `layers._gelu`), of the FFN's first
    matmul output z. Backward: recomputes z + b and writes dz = da·GELU'(z + b) and the bias gradient's
    partial sums. Triton's Pallas lowering has no rule for `lax.erf` (jax 0.10.2), so the kernel
    evaluates erf by the rational approximation XLA itself uses for float32 erf (`_erf`; coefficients and
    the saturation bound from XLA's `xla/codegen/emitters/transforms/expand_float_ops.cc`): the same
    function as `lax.erf` on a GPU to within float32 rounding, never the tanh approximation.

Block layout. Triton's tensors have power-of-two sizes, and widths such as 768 or 3072 are not, so every
kernel takes whole arrays (no `BlockSpec`) and loads a block of `rows × next_power_of_2(width)` (the norms:
the whole row, whose statistics need all of it) or `rows × COLUMN_BLOCK` (the GELU) with index vectors and a
mask: columns and rows past the array's end are loaded as 0 and never stored, and the statistics divide by the
true width. The backward kernels run `BACKWARD_PROGRAMS` programs at most, each looping over its share of the
rows and summing the parameter gradients of its rows in registers, so the partial sums stay small. A norm
kernel takes its parameters (gain and bias; λ and β) packed in one (k, d) operand (`_packed`): in a scanned
model each is a slice of the stacked parameters, and a kernel, a custom call, takes every operand as a buffer
of its own, one copy each. The sizes were first guesses; with them the kernels shortened GPT-2 small's and
ViT-B/16's steps by 5% on an H200, the GELU's two kernels reaching only 50–58% of the memory bandwidth
(benchmarks/README.md). `GELU_TILES` sets the GELU kernels' sizes apart from the norms', for
`benchmarks/gpu_gelu_tiles.py` to time the alternatives. No tiling helped: compiled for an H200, the GELU
kernels issue more instructions than their bytes take to move (the exact erf's rational function, each product
and sum rounded apart: Triton's lowering writes `mul.rn` and `add.rn`, which are never contracted;
benchmarks/gpu_kernel_instructions.py). `GELU_FMA` evaluates each a·b + c of their arithmetic as one fused
multiply-add instead (`_fma`, inline PTX) and the backward pass's Gaussian density as one power of two
(`_gaussian`): the same function to within float32 rounding, off until a GPU has timed it beside the kernels
as they are.

Off a GPU the kernels run in Pallas' interpreter (`INTERPRET`): slow, but the same blocks and masks,
which is how tests/models/test_fused_ops.py checks them on a CPU against the plain functions here
(`*_reference`). A Pallas kernel is a custom call XLA cannot partition: on a mesh of several devices
each kernel runs per device inside `jax.shard_map`, rows over the mesh axes of the logical axis 'batch'
(and the GELU's columns over those of 'mlp').
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from dsjax.models.backend import target_backend
from dsjax.models.partitioning import kernel_spec

# True/False: always/never the Pallas interpreter; None: the interpreter unless the target backend
# (`dsjax.models.backend`) is a GPU.
INTERPRET: bool | None = None
# Elements one program of a forward kernel handles (rows × padded width); a first guess.
BLOCK_ELEMENTS = 4096
# Columns of one GELU block (a power of two; 3 blocks cover GPT-2 small's 3072 exactly).
COLUMN_BLOCK = 1024
# At most this many programs in a backward kernel (about two per streaming multiprocessor of an H100).
BACKWARD_PROGRAMS = 256
NUM_WARPS = 4


@dataclasses.dataclass(frozen=True)
class GeluTiles:
  """The GELU kernels' sizes: elements per block, columns per block (a power of two), programs of the
  backward kernel at most, warps per program."""

  block_elements: int
  column_block: int
  backward_programs: int
  num_warps: int

  def __post_init__(self):
    for name, value in dataclasses.asdict(self).items():
      if value < 1 or (name != 'backward_programs' and value & (value - 1)):  # Triton's sizes
        kind = 'positive integer' if name == 'backward_programs' else 'positive power of two'
        raise ValueError(f'GeluTiles.{name} must be a {kind}, got {value}')


# None: the constants above. Read when a kernel is traced.
GELU_TILES: GeluTiles | None = None
# True: the GELU kernels compiled for a GPU evaluate each a·b + c of their arithmetic as one fused
# multiply-add (`_fma`) and φ(u) as one power of two (`_gaussian`). Read when a kernel is traced; off
# until a GPU has timed it beside the default.
GELU_FMA = False


def gelu_tiles() -> GeluTiles:
  return GELU_TILES or GeluTiles(BLOCK_ELEMENTS, COLUMN_BLOCK, BACKWARD_PROGRAMS, NUM_WARPS)


_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_LOG2_E = 1.4426950408889634
_LOG2_INV_SQRT_2PI = -1.3257480647361592  # log₂(1/√(2π))


# --- The plain math (what the kernels compute) ---------------------------------------------------------


def normalize_reference(x: jax.Array, gain: jax.Array, bias: jax.Array | None, kind: str, eps: float):
  """`dsjax.models.layers.Norm` as a function: statistics in float32 over the last axis, the result in
  x's dtype."""
  x32 = x.astype(jnp.float32)
  if kind == 'layernorm':
    x32 = x32 - x32.mean(-1, keepdims=True)
  y = (x32 * lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)).astype(x.dtype) * gain.astype(x.dtype)
  return y if bias is None else y + bias.astype(x.dtype)


def norm_cast_reference(x, gain, bias, *, kind: str, eps: float, out_dtype) -> jax.Array:
  """Norm(x) cast to `out_dtype` (a branch input), as the block computes it."""
  return normalize_reference(x, gain, bias, kind, eps).astype(out_dtype)


def residual_norm_reference(
  x, h, skip, branch, gain, bias, *, kind: str, eps: float, out_dtype, branch_bias=None
):
  """(λ·x + β·h, Norm(λ·x + β·h) cast to `out_dtype`), as a Pre-LN block computes them; λ = `skip`, β =
  `branch` (float32 scalars or width-d vectors), so the stream is float32. `branch_bias` (d,): the bias
  of the matmul that wrote h, added to h first in h's dtype, as `layers.Dense` adds it."""
  if branch_bias is not None:
    h = h + branch_bias.astype(h.dtype)
  x_new = skip * x + branch * h
  return x_new, norm_cast_reference(x_new, gain, bias, kind=kind, eps=eps, out_dtype=out_dtype)


def bias_gelu_reference(z: jax.Array, bias: jax.Array | None) -> jax.Array:
  """GELU(z + b) as the FFN computes it: the bias added in z's dtype, then the exact GELU."""
  u = z if bias is None else z + bias.astype(z.dtype)
  return 0.5 * u * (1.0 + lax.erf(u * _SQRT_HALF))


# --- The fused forms -----------------------------------------------------------------------------------


def norm_cast(x, gain, bias, *, kind: str, eps: float, out_dtype) -> jax.Array:
  """`norm_cast_reference` in one kernel forward and one backward; x (..., d), gain and bias (d,)
  (bias None for RMSNorm)."""
  fn = functools.partial(_norm_cast, kind=kind, eps=float(eps), out_dtype=jnp.dtype(out_dtype))
  bias = jnp.zeros_like(gain) if bias is None else bias
  rows = _rows(x)
  spec = _row_spec(rows.shape[0])
  if spec is not None:
    fn = jax.shard_map(fn, in_specs=(spec, P()), out_specs=spec, check_vma=False)
  return fn(rows, _packed(gain, bias, d=x.shape[-1])).reshape(x.shape)


def residual_norm(x, h, skip, branch, gain, bias, *, kind: str, eps: float, out_dtype, branch_bias=None):
  """`residual_norm_reference` in one kernel forward and one backward: (the float32 stream λ·x + β·h,
  its Norm cast to `out_dtype`); x, h (..., d), λ and β scalars or (d,), gain and bias (d,) (bias None
  for RMSNorm). `branch_bias` (d,) or None: the bias of the matmul that wrote h, added to h in the
  kernel (in h's dtype, as `residual_norm_reference`), which saves the bias add's own pass over h and
  sums its gradient with the others'."""
  fn = functools.partial(
    _residual_norm,
    kind=kind,
    eps=float(eps),
    out_dtype=jnp.dtype(out_dtype),
    with_branch_bias=branch_bias is not None,
  )
  bias = jnp.zeros_like(gain) if bias is None else bias
  x_rows, h_rows = _rows(x), _rows(h)
  spec = _row_spec(x_rows.shape[0])
  if spec is not None:
    fn = jax.shard_map(fn, in_specs=(spec, spec, P()), out_specs=(spec, spec), check_vma=False)
  vectors = (skip, branch, gain, bias) + (() if branch_bias is None else (branch_bias,))
  x_new, y = fn(x_rows, h_rows, _packed(*vectors, d=x.shape[-1]))
  return x_new.reshape(x.shape), y.reshape(x.shape)


def bias_gelu(z: jax.Array, bias: jax.Array | None) -> jax.Array:
  """`bias_gelu_reference` in one kernel forward and one backward (the sum z + b and the GELU in
  float32, the result in z's dtype); z (..., F), bias (F,) or None."""
  bias = jnp.zeros((z.shape[-1],), jnp.float32) if bias is None else bias.astype(jnp.float32)
  rows = _rows(z)
  spec = _row_spec(rows.shape[0], columns=('mlp', rows.shape[1]))
  fn = _bias_gelu
  if spec is not None:
    fn = jax.shard_map(fn, in_specs=(spec, P(spec[1])), out_specs=spec, check_vma=False)
  return fn(rows, bias).reshape(z.shape)


def _packed(*vectors, d: int) -> jax.Array:
  """The vectors (scalars broadcast to width d) as the rows of one float32 (k, d) array: a kernel's
  parameters in one operand. A layer's parameters are slices of the stacked parameters, and a kernel
  (a custom call) takes each operand as a buffer of its own: one copy for all of them, not one each."""
  return jnp.stack([jnp.broadcast_to(jnp.asarray(v, jnp.float32), (d,)) for v in vectors])


# The rows of the norm kernels' packed parameters (`_packed`), and of their gradients' partial sums.
NORM_PARAMS = ('gain', 'bias')
RESIDUAL_NORM_PARAMS = ('skip', 'branch', 'gain', 'bias')  # then 'branch_bias', where the kernel adds it


def _param_names(residual: bool, with_branch_bias: bool) -> tuple[str, ...]:
  if not residual:
    return NORM_PARAMS
  return RESIDUAL_NORM_PARAMS + (('branch_bias',) if with_branch_bias else ())


def _rows(x: jax.Array) -> jax.Array:
  return x.reshape(-1, x.shape[-1])


def _interpret() -> bool:
  return target_backend() != 'gpu' if INTERPRET is None else INTERPRET


def _row_spec(num_rows: int, columns: tuple[str, int] | None = None) -> P | None:
  """The (rows, columns) spec for `jax.shard_map` over the current mesh, or None without one (or on one
  device): rows over the mesh axes of the logical axis 'batch', `columns` = (logical name, size) over
  that name's axes (the norms' rows stay whole); `partitioning.kernel_spec`."""
  return kernel_spec('model.fused_ops=pallas', (('batch', num_rows), columns or (None, 0)))


# --- Norms: custom VJPs --------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _norm_cast(x_ND, params_KD, kind, eps, out_dtype):
  return _norm_forward(x_ND, None, params_KD, kind, eps, out_dtype)[1]


def _norm_cast_fwd(x_ND, params_KD, kind, eps, out_dtype):
  return _norm_cast(x_ND, params_KD, kind, eps, out_dtype), (x_ND, params_KD)


def _norm_cast_bwd(kind, eps, out_dtype, residuals, dy_ND):
  x_ND, params_KD = residuals
  dx_ND, _, dparams_KD = _norm_backward(x_ND, None, params_KD, None, dy_ND, kind, eps)
  return dx_ND, dparams_KD


_norm_cast.defvjp(_norm_cast_fwd, _norm_cast_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _residual_norm(x_ND, h_ND, params_KD, kind, eps, out_dtype, with_branch_bias):
  return _norm_forward(x_ND, h_ND, params_KD, kind, eps, out_dtype, with_branch_bias)


def _residual_norm_fwd(x_ND, h_ND, params_KD, kind, eps, out_dtype, with_branch_bias):
  out = _norm_forward(x_ND, h_ND, params_KD, kind, eps, out_dtype, with_branch_bias)
  return out, (x_ND, h_ND, params_KD)


def _residual_norm_bwd(kind, eps, out_dtype, with_branch_bias, residuals, cotangents):
  x_ND, h_ND, params_KD = residuals
  dstream_ND, dy_ND = cotangents
  return _norm_backward(x_ND, h_ND, params_KD, dstream_ND, dy_ND, kind, eps, with_branch_bias)


_residual_norm.defvjp(_residual_norm_fwd, _residual_norm_bwd)


# --- Norms: kernels ------------------------------------------------------------------------------------


def _norm_blocks(n: int, d: int) -> tuple[int, int]:
  """(rows, columns) of a norm kernel's block: the whole row padded to a power of two, and as many rows
  as fit in `BLOCK_ELEMENTS` (at least one, at most the rows there are, rounded up to a power of two)."""
  cols = pl.next_power_of_2(d)
  return min(max(1, BLOCK_ELEMENTS // cols), pl.next_power_of_2(n)), cols


def _block_indices(first_row, block_rows: int, block_cols: int, n: int, d: int, first_col=0):
  """Row and column index vectors of a block and its mask (rows < n and columns < d)."""
  rows = first_row + jnp.arange(block_rows)
  cols = first_col + jnp.arange(block_cols)
  return rows[:, None], cols[None, :], (rows < n)[:, None] & (cols < d)[None, :]


def _load(ref, rows, cols, mask) -> jax.Array:
  return plgpu.load(ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)


def _load_vector(ref, cols, d: int, row: int | None = None) -> jax.Array:
  """A (d,) parameter as a (1, columns) row, 0 past d; `row`: row `row` of a (k, d) array (one indexer:
  Triton's lowering takes no `ref.at[row].at[...]`)."""
  index = cols[0] if row is None else (row, cols[0])
  return plgpu.load(ref.at[index], mask=cols[0] < d, other=0.0).astype(jnp.float32)[None, :]


def _load_param(ref, names: tuple[str, ...], name: str, cols, d: int) -> jax.Array:
  """Row `name` of a packed (len(names), d) parameter array (`_packed`), as `_load_vector` loads a
  vector (loaded where it is used: a row loaded early holds its registers longer)."""
  return _load_vector(ref, cols, d, row=names.index(name))


def _store(ref, rows, cols, mask, value) -> None:
  plgpu.store(ref.at[rows, cols], value.astype(ref.dtype), mask=mask)


def _normalized(u, col_mask, kind: str, eps: float, d: int):
  """(x̂, rstd) of the rows of u (float32, padded columns 0): (u − mean)·rstd for LayerNorm, u·rstd for
  RMSNorm, with the statistics over the d real columns."""
  if kind == 'layernorm':
    u = jnp.where(col_mask, u - (u.sum(axis=1, keepdims=True) / d), 0.0)
  rstd = lax.rsqrt((u * u).sum(axis=1, keepdims=True) / d + eps)
  return u * rstd, rstd


def _branch(h_ref, rows, cols, mask, branch_bias):
  """h as the block computes it, float32: with the branch's bias (a (1, columns) row, or None), h + b in
  h's dtype (b rounded to it, then the sum), as `layers.Dense` adds a bias to its output."""
  h = _load(h_ref, rows, cols, mask)
  if branch_bias is None:
    return h
  in_h_dtype = lambda v: v.astype(h_ref.dtype).astype(jnp.float32)  # noqa: E731
  return in_h_dtype(h + in_h_dtype(branch_bias))


def _norm_forward(x_ND, h_ND, params_KD, kind, eps, out_dtype, with_branch_bias=False):
  """The forward kernel: (stream, y) with a residual add (h given), y alone without; `params_KD` packed
  as `_param_names` names them."""
  n, d = x_ND.shape
  block_rows, block_cols = _norm_blocks(n, d)
  residual = h_ND is not None
  names = _param_names(residual, with_branch_bias)

  def kernel(*refs):
    if residual:
      x_ref, h_ref, params_ref, stream_ref, y_ref = refs
    else:
      (x_ref, params_ref, y_ref), stream_ref = refs, None
    rows, cols, mask = _block_indices(pl.program_id(0) * block_rows, block_rows, block_cols, n, d)
    param = lambda name: _load_param(params_ref, names, name, cols, d)  # noqa: E731
    u = _load(x_ref, rows, cols, mask)
    if residual:
      branch_bias = param('branch_bias') if with_branch_bias else None
      u = param('skip') * u + param('branch') * _branch(h_ref, rows, cols, mask, branch_bias)
      _store(stream_ref, rows, cols, mask, u)
    xhat, _ = _normalized(u, cols < d, kind, eps, d)
    _store(y_ref, rows, cols, mask, xhat * param('gain') + param('bias'))

  y_shape = jax.ShapeDtypeStruct((n, d), out_dtype)
  out_shape = (jax.ShapeDtypeStruct((n, d), jnp.float32), y_shape) if residual else (y_shape,)
  inputs = (x_ND, h_ND, params_KD) if residual else (x_ND, params_KD)
  out = _call(kernel, (pl.cdiv(n, block_rows),), out_shape, 'fused_residual_norm', *inputs)
  return tuple(out) if residual else (None, out[0])


def _backward_programs(n: int, block_rows: int, max_programs: int | None = None) -> tuple[int, int]:
  """(programs, row blocks per program) for a backward kernel over n rows in blocks of block_rows, with
  at most `max_programs` (default `BACKWARD_PROGRAMS`) programs."""
  row_blocks = pl.cdiv(n, block_rows)
  per_program = pl.cdiv(row_blocks, min(row_blocks, max_programs or BACKWARD_PROGRAMS))
  return pl.cdiv(row_blocks, per_program), per_program


def _norm_backward(x_ND, h_ND, params_KD, dstream_ND, dy_ND, kind, eps, with_branch_bias=False):
  """The backward kernel: (dx, dh or None, the packed parameters' gradient, (k, d)); with h, the
  stream's gradient `dstream_ND` adds to the norm's input gradient."""
  n, d = x_ND.shape
  block_rows, block_cols = _norm_blocks(n, d)
  programs, per_program = _backward_programs(n, block_rows)
  residual = h_ND is not None
  names = _param_names(residual, with_branch_bias)

  def kernel(*refs):
    if residual:
      x_ref, h_ref, params_ref, dstream_ref, dy_ref, dx_ref, dh_ref, sums_ref = refs
    else:
      x_ref, params_ref, dy_ref, dx_ref, sums_ref = refs
    _, cols, _ = _block_indices(0, 1, block_cols, 1, d)
    gain = _load_param(params_ref, names, 'gain', cols, d)
    if residual:
      skip, branch = (_load_param(params_ref, names, name, cols, d) for name in ('skip', 'branch'))
      branch_bias = _load_param(params_ref, names, 'branch_bias', cols, d) if with_branch_bias else None
    program = pl.program_id(0)  # (read outside the loop: the interpreter replaces it only here)

    def row_block(i, sums):
      first = (program * per_program + i) * block_rows
      rows, cols, mask = _block_indices(first, block_rows, block_cols, n, d)
      x = _load(x_ref, rows, cols, mask)
      if residual:
        h = _branch(h_ref, rows, cols, mask, branch_bias)
        x_new = skip * x + branch * h
      else:
        x_new = x
      xhat, rstd = _normalized(x_new, cols < d, kind, eps, d)
      dy = _load(dy_ref, rows, cols, mask)
      g = dy * gain  # the gradient of x̂
      proj = xhat * ((g * xhat).sum(axis=1, keepdims=True) / d)
      if kind == 'layernorm':
        proj = proj + g.sum(axis=1, keepdims=True) / d
      du = rstd * (g - proj)  # the gradient of the norm's input (0 in the padded columns)
      new = {'gain': (dy * xhat).sum(axis=0), 'bias': dy.sum(axis=0)}
      if residual:
        du = du + _load(dstream_ref, rows, cols, mask)
        dh = branch * du
        _store(dh_ref, rows, cols, mask, dh)
        _store(dx_ref, rows, cols, mask, skip * du)
        new |= {'skip': (du * x).sum(axis=0), 'branch': (du * h).sum(axis=0)}
        if with_branch_bias:
          new['branch_bias'] = dh.sum(axis=0)
      else:
        _store(dx_ref, rows, cols, mask, du)
      return tuple(s + new[name][None, :] for s, name in zip(sums, names))

    zeros = jnp.zeros((1, block_cols), jnp.float32)
    sums = lax.fori_loop(0, per_program, row_block, (zeros,) * len(names))
    for j, total in enumerate(sums):  # side by side in one row per program: one sum over programs
      _store(sums_ref, jnp.full((1, 1), program), j * d + cols, cols < d, total)

  sums_shape = jax.ShapeDtypeStruct((programs, len(names) * d), jnp.float32)
  grads_shape = [jax.ShapeDtypeStruct((n, d), x_ND.dtype)]
  if residual:
    grads_shape.append(jax.ShapeDtypeStruct((n, d), h_ND.dtype))
    inputs = (x_ND, h_ND, params_KD, dstream_ND, dy_ND)
  else:
    inputs = (x_ND, params_KD, dy_ND)
  out = _call(kernel, (programs,), (*grads_shape, sums_shape), 'fused_residual_norm_backward', *inputs)
  *grads, partial_sums = out
  dparams_KD = partial_sums.sum(axis=0).reshape(len(names), d)
  return grads[0], (grads[1] if residual else None), dparams_KD


def _call(kernel, grid, out_shape, name: str, *inputs, num_warps: int | None = None):
  return pl.pallas_call(
    kernel,
    grid=grid,
    out_shape=out_shape,
    compiler_params=plgpu.CompilerParams(num_warps=num_warps or NUM_WARPS),
    interpret=_interpret(),
    name=name,
  )(*inputs)


# --- Bias + GELU ---------------------------------------------------------------------------------------


def _fma(a, b, c, fused: bool) -> jax.Array:
  """a·b + c in float32, broadcast together. `fused` (a kernel compiled for a GPU with `GELU_FMA` on): one
  fused multiply-add (`fma.rn.f32`, one rounding) by inline assembly, where Triton's lowering rounds the
  product and the sum apart (`mul.rn.f32`, then `add.rn.f32`: two instructions; XLA's own fusions
  contract them, as its float32 erf does). Otherwise a·b + c as written."""
  if not fused:
    return a * b + c
  shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in (a, b, c)))
  args = [jnp.broadcast_to(jnp.asarray(v, jnp.float32), shape) for v in (a, b, c)]
  [result] = plgpu.elementwise_inline_asm(
    'fma.rn.f32 $0, $1, $2, $3;',
    args=args,
    constraints='=f,f,f,f',
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)],
  )
  return result


def _fused_arithmetic() -> bool:
  """Whether the GELU kernels traced now take `GELU_FMA`'s arithmetic (never in the interpreter)."""
  return GELU_FMA and not _interpret()


def _erf(x: jax.Array, fused: bool = False) -> jax.Array:
  """erf of float32 x by XLA's own rational approximation for float32 (`RewriteErf32Pattern` in
  xla/codegen/emitters/transforms/expand_float_ops.cc): x·P(x²)/Q(x²), x clamped to ±erfinv(1 − 2⁻²³),
  where erf is ±1 to within float32 rounding; P and Q by Horner's rule (`_fma`)."""
  x = jnp.minimum(jnp.maximum(x, -3.7439211627767994), 3.7439211627767994)
  x2 = x * x
  p = _fma(x2, 0.00022905065861350646, 0.0034082910107109506, fused)
  for c in (0.050955695062380861, 0.18520832239976145, 1.128379143519084):
    p = _fma(p, x2, c, fused)
  q = _fma(x2, -1.1791602954361697e-7, 0.000023547966471313185, fused)
  for c in (0.0010179625278914885, 0.014070470171167667, 0.11098505178285362, 0.49746925110067538, 1.0):
    q = _fma(q, x2, c, fused)
  return x * p / q


def _gaussian(u: jax.Array, fused: bool = False) -> jax.Array:
  """φ(u) = exp(−u²/2)/√(2π), float32. `fused`: as 2^(−u²·log₂e/2 + log₂(1/√(2π))), one fused
  multiply-add and one `ex2` (`lax.exp2`) where `exp` and the product take some nine instructions; the
  same to within float32 rounding of the slope it enters (`ex2`'s relative error is a few units in the
  last place, and u·φ(u) ≤ 0.25)."""
  if not fused:
    return _INV_SQRT_2PI * jnp.exp(-0.5 * u * u)
  return jnp.exp2(_fma(u * u, -0.5 * _LOG2_E, _LOG2_INV_SQRT_2PI, fused))


def _gelu(u: jax.Array, fused: bool = False) -> jax.Array:
  """u·Φ(u) = ½u + ½u·erf(u/√2), float32."""
  half_u = 0.5 * u
  return _fma(half_u, _erf(u * _SQRT_HALF, fused), half_u, fused)


def _gelu_slope(u: jax.Array, fused: bool = False) -> jax.Array:
  """GELU'(u) = Φ(u) + u·φ(u), float32."""
  return _fma(u, _gaussian(u, fused), _fma(0.5, _erf(u * _SQRT_HALF, fused), 0.5, fused), fused)


def _gelu_blocks(n: int, f: int, tiles: GeluTiles) -> tuple[int, int]:
  cols = min(pl.next_power_of_2(f), tiles.column_block)
  return min(max(1, tiles.block_elements // cols), pl.next_power_of_2(n)), cols


@jax.custom_vjp
def _bias_gelu(z_NF: jax.Array, bias_F: jax.Array) -> jax.Array:
  n, f = z_NF.shape
  tiles, fused = gelu_tiles(), _fused_arithmetic()
  block_rows, block_cols = _gelu_blocks(n, f, tiles)

  def kernel(z_ref, bias_ref, a_ref):
    first_col = pl.program_id(1) * block_cols
    rows, cols, mask = _block_indices(pl.program_id(0) * block_rows, block_rows, block_cols, n, f, first_col)
    u = _load(z_ref, rows, cols, mask) + _load_vector(bias_ref, cols, f)
    _store(a_ref, rows, cols, mask, _gelu(u, fused))

  grid = (pl.cdiv(n, block_rows), pl.cdiv(f, block_cols))
  out_shape = jax.ShapeDtypeStruct((n, f), z_NF.dtype)
  return _call(kernel, grid, out_shape, 'fused_bias_gelu', z_NF, bias_F, num_warps=tiles.num_warps)


def _bias_gelu_fwd(z_NF, bias_F):
  return _bias_gelu(z_NF, bias_F), (z_NF, bias_F)


def _bias_gelu_bwd(residuals, da_NF):
  z_NF, bias_F = residuals
  n, f = z_NF.shape
  tiles, fused = gelu_tiles(), _fused_arithmetic()
  block_rows, block_cols = _gelu_blocks(n, f, tiles)
  programs, per_program = _backward_programs(n, block_rows, tiles.backward_programs)

  def kernel(z_ref, bias_ref, da_ref, dz_ref, dbias_ref):
    first_col = pl.program_id(1) * block_cols
    _, cols, _ = _block_indices(0, 1, block_cols, 1, f, first_col)
    bias = _load_vector(bias_ref, cols, f)
    program = pl.program_id(0)

    def row_block(i, dbias):
      first = (program * per_program + i) * block_rows
      rows, cols, mask = _block_indices(first, block_rows, block_cols, n, f, first_col)
      u = _load(z_ref, rows, cols, mask) + bias
      dz = _load(da_ref, rows, cols, mask) * _gelu_slope(u, fused)
      _store(dz_ref, rows, cols, mask, dz)
      return dbias + jnp.where(mask, dz, 0.0).sum(axis=0)[None, :]

    dbias = lax.fori_loop(0, per_program, row_block, jnp.zeros((1, block_cols), jnp.float32))
    _store(dbias_ref, jnp.full((1, 1), program), cols, cols < f, dbias)

  grid = (programs, pl.cdiv(f, block_cols))
  out_shape = (jax.ShapeDtypeStruct((n, f), z_NF.dtype), jax.ShapeDtypeStruct((programs, f), jnp.float32))
  dz_NF, dbias_PF = _call(
    kernel, grid, out_shape, 'fused_bias_gelu_backward', z_NF, bias_F, da_NF, num_warps=tiles.num_warps
  )
  return dz_NF, dbias_PF.sum(axis=0)


_bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)
