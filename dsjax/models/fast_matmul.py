"""The dense layers' matmul, with the derivative rules that make its backward pass fast.

`matmul_last_axis(x, kernel, out_dtype)` is x (..., d_in) contracted with kernel (d_in, *out): mathematically
`jnp.tensordot(x, kernel, axes=1)`. What it adds, none of which changes the value:
  * the leading axes of x are flattened into one before the matmul (XLA's CPU backend ran the weight
    gradient of the (B, L, d) form ~3x slower than the forward matmul);
  * a narrowing kernel (more rows than columns, e.g. the FFN's second matmul) computes its weight
    gradient on the CPU as (dyᵀ·x)ᵀ (`_matmul_narrowing`; the switch `TRANSPOSED_NARROW_WEIGHT_GRADIENT`);
  * a bf16 matmul written in float32 (`out_dtype`, e.g. the logits head) keeps its input and weight
    gradients bf16 matmuls (`_matmul_wider_output`).
`dsjax.models.layers.Dense` uses it. `benchmarks/cpu_weight_gradient_form.py` and
`benchmarks/cpu_matmul_kernels.py` time the forms; tests/models/test_precision_attention.py checks them
against the plain matmul's autodiff.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

# On the CPU, a narrowing kernel's weight gradient is computed as (dyᵀ·x)ᵀ (`_matmul_narrowing`); False
# keeps the plain form (`benchmarks/cpu_weight_gradient_form.py` times the train step both ways).
TRANSPOSED_NARROW_WEIGHT_GRADIENT = True


def matmul_last_axis(x: jax.Array, kernel: jax.Array, out_dtype: Any = None) -> jax.Array:
  """x (..., d_in) contracted with kernel (d_in, *out) into (..., *out), written as one matmul over all
  leading axes of x flattened: with (B, L) kept as two axes, the weight gradient contracts over both,
  and XLA's CPU backend then transposed the output gradient and fell back to a matmul kernel ~3x slower
  than the forward one. A narrowing kernel (more rows than columns) computes its weight gradient in the
  form the CPU runs faster (`_matmul_narrowing`). `out_dtype`: the product's dtype (accumulated and
  written in it; default the inputs' dtype)."""
  x_ND = x.reshape(-1, x.shape[-1])
  if out_dtype is not None and jnp.dtype(out_dtype) != x.dtype:
    y = _matmul_wider_output(x_ND, kernel, jnp.dtype(out_dtype))
  elif TRANSPOSED_NARROW_WEIGHT_GRADIENT and kernel.ndim == 2 and kernel.shape[0] > kernel.shape[1]:
    y = _matmul_narrowing(x_ND, kernel)
  else:  # (A kernel of more axes is not reshaped: that would undo a sharding of its output axes.)
    y = jnp.tensordot(x_ND, kernel, axes=1)
  return y.reshape(*x.shape[:-1], *kernel.shape[1:])


@jax.custom_jvp
def _matmul_narrowing(x_NI: jax.Array, kernel_IO: jax.Array) -> jax.Array:
  """x·kernel for a kernel with more rows than columns (I > O, e.g. the FFN's second matmul)."""
  return x_NI @ kernel_IO


def _matmul_narrowing_jvp(primals, tangents):
  # The weight gradient xᵀ·dy contracts the token axis, the major one of both operands. On the CPU, XLA
  # runs that product more slowly when its output has more rows than columns (I > O) than the same
  # product computed as (dyᵀ·x)ᵀ: `benchmarks/cpu_matmul_kernels.py` times both forms for the FFN's
  # 512 → 128. The kernel's tangent term below is written so that its transpose, the weight gradient, is
  # that product; the barrier keeps XLA from folding the final transpose back into the matmul. Other
  # platforms' matmuls take either operand transposed at no cost and keep the plain form. Tangents that
  # are symbolically zero (an input that depends on nothing differentiated) cost no matmul.
  (x_NI, kernel_IO), (dx_NI, dkernel_IO) = primals, tangents

  def kernel_term_cpu(dkernel_IO):
    dkernel_OI = jax.lax.optimization_barrier(dkernel_IO.T)
    return jax.lax.dot_general(dkernel_OI, x_NI, (((1,), (1,)), ((), ()))).T

  y = _matmul_narrowing(x_NI, kernel_IO)
  terms = []
  if not isinstance(dx_NI, jax.custom_derivatives.SymbolicZero):
    terms.append(dx_NI @ kernel_IO)
  if not isinstance(dkernel_IO, jax.custom_derivatives.SymbolicZero):
    terms.append(jax.lax.platform_dependent(dkernel_IO, cpu=kernel_term_cpu, default=lambda d: x_NI @ d))
  return y, functools.reduce(jnp.add, terms) if terms else jnp.zeros_like(y)


_matmul_narrowing.defjvp(_matmul_narrowing_jvp, symbolic_zeros=True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _matmul_wider_output(x_ND: jax.Array, kernel: jax.Array, out_dtype) -> jax.Array:
  """x·kernel in the inputs' dtype (bf16), accumulated and written in `out_dtype` (float32)."""
  return jnp.tensordot(x_ND, kernel, axes=1, preferred_element_type=out_dtype)


@_matmul_wider_output.defjvp
def _matmul_wider_output_jvp(out_dtype, primals, tangents):
  # The derivative's matmuls take the inputs' dtype, as the forward one does: without this rule the
  # float32 output gradient would make the input and weight gradients float32 matmuls (for a head
  # over a large vocabulary, the costliest of the backward pass). Forward mode stays available.
  (x_ND, kernel), (dx_ND, dkernel) = primals, tangents
  dy = jnp.tensordot(dx_ND, kernel, axes=1).astype(out_dtype) + jnp.tensordot(x_ND, dkernel, axes=1).astype(
    out_dtype
  )
  return _matmul_wider_output(x_ND, kernel, out_dtype), dy
