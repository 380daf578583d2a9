"""Leaf layers of the transformer: dense projections, norms, dropout, attention and the FFN.

Everything is written out rather than taken from `flax.nnx.Linear` & co. for two reasons that matter to
signal-propagation research:
  * the initial standard deviation of every weight is an explicit (possibly traced, per-layer) number set
    by the initialisation scheme (`dsjax.schemes`), so DSLM can give layer n its own V/O variance while the
    layers are still created in one vmapped call;
  * dropout takes an explicit PRNG key (or None = deterministic), so the whole forward pass is a pure
    function of (parameters, inputs, key): resumable bit-for-bit and easy to scan over layers.

Shape suffixes: B batch, L sequence, D model width, H heads, K head dim, F FFN hidden width.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.models.tpu_attention import splash_attention

# E[z²] of a standard normal truncated to [-2, 2]; dividing by its sqrt makes truncated draws have
# exactly the requested variance, which the theory (`dsjax.theory`) assumes.
_TRUNC2_STD = 0.87962566103423978


class Constant(nnx.Variable):
  """A non-trainable array stored with the model (e.g. fixed residual scales λ, β).

  It is split off with `nnx.split(model, nnx.Param, ...)` into the non-trainable state, so it gets no
  gradient and no optimizer slot, but it is saved in checkpoints and read by `dsjax.export`.
  """


# Every array of a model carries its logical axes as metadata (`axes=`), declared where it is created;
# `dsjax.train.sharding` maps them to mesh axes and refuses an array without them. Names: 'embed'
# (model width), 'heads' (attention width), 'mlp' (FFN hidden), 'vocab' (vocabulary or classes),
# 'patch' (patch pixels), 'seq' (positions), None (never sharded: norm gains, scalars).
# `lr_scale=` multiplies the learning rate of a parameter (μP; read by the optimizer builder).

def param(value: jax.Array, axes: tuple[str | None, ...], lr_scale: float = 1.0) -> nnx.Param:
  if len(axes) != jnp.ndim(value):
    raise ValueError(f'logical axes {axes} do not match a parameter of shape {jnp.shape(value)}')
  return nnx.Param(value, axes=axes, lr_scale=lr_scale)


def constant(value: jax.Array, axes: tuple[str | None, ...]) -> Constant:
  return Constant(value, axes=axes)


def init_weight(key: jax.Array, shape: tuple[int, ...], std: Any, distribution: str,
                dtype=jnp.float32) -> jax.Array:
  """Draws a weight with standard deviation `std` (a Python or traced scalar)."""
  if distribution == 'normal':
    z = jax.random.normal(key, shape, dtype)
  elif distribution == 'truncated_normal':
    z = jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) / _TRUNC2_STD
  elif distribution == 'uniform':  # U(-a, a) with a = sqrt(3)·std has standard deviation std.
    z = jax.random.uniform(key, shape, dtype, -jnp.sqrt(3.0), jnp.sqrt(3.0))
  else:
    raise ValueError(f'init distribution must be normal|truncated_normal|uniform, got {distribution!r}')
  return z * jnp.asarray(std, dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout; `key=None` (evaluation) or `rate=0` is the identity."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


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
    terms.append(jax.lax.platform_dependent(dkernel_IO, cpu=kernel_term_cpu,
                                            default=lambda d: x_NI @ d))
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
  dy = (jnp.tensordot(dx_ND, kernel, axes=1).astype(out_dtype)
        + jnp.tensordot(x_ND, dkernel, axes=1).astype(out_dtype))
  return _matmul_wider_output(x_ND, kernel, out_dtype), dy


class Dense(nnx.Module):
  """y = x @ kernel (+ bias). kernel: (d_in, d_out) drawn with standard deviation `std`.

  `lr_scale` multiplies the kernel's learning rate only: a bias is a vector-like parameter, whose Adam
  learning rate μP leaves unscaled (Yang et al. 2021, Tensor Programs V, Table 3: "all biases").
  """

  def __init__(self, d_in: int, d_out: int, *, std: Any, distribution: str, use_bias: bool,
               axes: tuple[str | None, str | None], rngs: nnx.Rngs, lr_scale: float = 1.0):
    self.kernel = param(init_weight(rngs.params(), (d_in, d_out), std, distribution), axes, lr_scale)
    self.bias = param(jnp.zeros((d_out,)), axes[1:]) if use_bias else None

  def __call__(self, x: jax.Array, out_dtype: Any = None) -> jax.Array:
    """The matmul runs in the input's dtype (the compute dtype the block casts its branch input to),
    whatever the parameters are stored in; its output is in `out_dtype` (default the input's)."""
    y = matmul_last_axis(x, self.kernel[...].astype(x.dtype), out_dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(y.dtype)
    return y


class Norm(nnx.Module):
  """LayerNorm or RMSNorm over the last axis, learnable gain `scale` (init 1) and, for LayerNorm, bias.

  RMSNorm is the DNT paper's form `scale ⊙ x / sqrt(mean(x²) + eps)` (= γ ⊙ sqrt(d)·x/sqrt(‖x‖² + d·eps)).
  """

  def __init__(self, dim: int, *, kind: str, eps: float):
    if kind not in ('layernorm', 'rmsnorm'):
      raise ValueError(f'model.norm must be layernorm|rmsnorm, got {kind!r}')
    self.kind, self.eps = kind, eps
    self.scale = param(jnp.ones((dim,)), (None,))
    self.bias = param(jnp.zeros((dim,)), (None,)) if kind == 'layernorm' else None

  def __call__(self, x: jax.Array) -> jax.Array:
    # Rows flattened to one axis: with (B, L) kept apart, XLA's GPU backend laid some of ViT-B/16's
    # norm computations out with the batch axis minor and paid a transpose each way.
    x32 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # Statistics in float32 also for bf16.
    if self.kind == 'layernorm':
      x32 = x32 - x32.mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.eps)
    y = y.astype(x.dtype) * self.scale[...].astype(x.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    return y.reshape(x.shape)


def make_norm(enabled: bool, dim: int, kind: str, eps: float) -> Norm | None:
  return Norm(dim, kind=kind, eps=eps) if enabled else None


def apply_norm(norm: Norm | None, x: jax.Array) -> jax.Array:
  return x if norm is None else norm(x)


class Attention(nnx.Module):
  """Multi-head self-attention with separate q/k/v/o projections and optional QKNorm (DNT).

  Separate projection parameters (rather than one fused qkv kernel) keep each weight's initial
  variance a single knob, as the DSLM recipe needs (Kedia et al. 2024 §3.5: q, k at 1/d; v, o per
  layer); `project_qkv` still multiplies by the three of them in one matmul.
  `logit_scale` multiplies q·k (default 1/sqrt(d_head); μP uses 1/d_head, Noci et al. 2022 τ/sqrt(d_head)).
  `identity_mix`: the attention matrix is α·I + β·A(X) with learnable scalars α (init 1) and β (init 0),
  Value-SkipInit (He et al. 2023, arXiv:2302.10322 §4).

  `implementation`: 'xla' (the probabilities materialised, B·H·L² memory, 5/8 of that when causal;
  attention dropout applies to them), 'cudnn' (the fused flash-attention kernel of cuDNN through
  `jax.nn.dot_product_attention`, NVIDIA GPUs, bf16/fp16, memory linear in L, no dropout) or 'splash'
  (the Pallas splash-attention kernel for TPUs, `dsjax.models.tpu_attention`, memory linear in L, no
  dropout; q·scale is rounded to q's dtype before the kernel's product, an extra rounding in bfloat16).
  All compute the logits and the softmax in float32; the 'xla' path is written out
  (`_xla_attention`) rather than taken from `jax.nn.dot_product_attention(implementation='xla')`, which
  computes the same (tested) but is slower on the CPU and has no dropout.
  """

  def __init__(self, d: int, num_heads: int, *, stds: dict[str, Any], distribution: str,
               use_bias: bool, qk_norm: bool, norm_kind: str, norm_eps: float, causal: bool,
               attn_dropout: float, rngs: nnx.Rngs, logit_scale: float | None = None,
               identity_mix: bool = False, lr_scale: dict[str, float] | None = None,
               inner_width: int | None = None, out_width: int | None = None,
               implementation: str = 'xla'):
    if implementation not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f'model.attention must be one of {list(ATTENTION_IMPLEMENTATIONS)}, '
                       f'got {implementation!r}')
    self.implementation = implementation
    inner = d if inner_width is None else inner_width
    out = d if out_width is None else out_width
    self.num_heads, self.head_dim = num_heads, inner // num_heads
    self.causal, self.attn_dropout = causal, attn_dropout
    self.logit_scale = float(self.head_dim ** -0.5 if logit_scale is None else logit_scale)
    lr = lr_scale or {}

    def dense(name, d_in, d_out, axes):
      return Dense(d_in, d_out, std=stds[name], distribution=distribution, use_bias=use_bias,
                   axes=axes, lr_scale=lr.get(name, 1.0), rngs=rngs)
    self.q, self.k = dense('q', d, inner, ('embed', 'heads')), dense('k', d, inner, ('embed', 'heads'))
    self.v, self.o = dense('v', d, inner, ('embed', 'heads')), dense('o', inner, out, ('heads', 'embed'))
    # QKNorm normalises each head's query/key over the head dimension (gain shared across heads).
    self.q_norm = make_norm(qk_norm, self.head_dim, norm_kind, norm_eps)
    self.k_norm = make_norm(qk_norm, self.head_dim, norm_kind, norm_eps)
    self.mix_identity = param(jnp.ones(()), ()) if identity_mix else None
    self.mix_attention = param(jnp.zeros(()), ()) if identity_mix else None

  def project_qkv(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x·W_q + b_q, x·W_k + b_k, x·W_v + b_v as one matmul against the three kernels side by side, and
    so one matmul each for their input and weight gradients: at the small widths the CPU trains, three
    matmuls of a third of the width run well below the matmul rate of one. The parameters stay three
    `Dense` modules (their own init, learning-rate scale and sharding). The kernels are stacked on a
    new middle axis, (d, 3, inner), and contracted without reshaping the kernel: each projection is then a
    contiguous block of every row of the product (a cheap slice, and contiguous writes of the three
    gradients in the backward pass, where the interleaved (d, inner, 3) layout cost a strided copy each
    way), and a kernel sharded over its output axis ('heads') gives a stack sharded over the same axis,
    shard by shard, with no communication."""
    denses = (self.q, self.k, self.v)
    kernel_D3I = jnp.stack([d.kernel[...].astype(x_BLD.dtype) for d in denses], axis=1)
    # The bias is added to the product with the tokens on one axis, before (B, L) is restored: its
    # gradient is then a sum over one axis, the form the benchmarks in README.md measured.
    qkv_N3I = matmul_last_axis(x_BLD.reshape(-1, x_BLD.shape[-1]), kernel_D3I)
    if self.q.bias is not None:
      qkv_N3I = qkv_N3I + jnp.stack([d.bias[...].astype(x_BLD.dtype) for d in denses], axis=0)
    qkv_BL3I = qkv_N3I.reshape(*x_BLD.shape[:2], *qkv_N3I.shape[1:])
    return qkv_BL3I[:, :, 0], qkv_BL3I[:, :, 1], qkv_BL3I[:, :, 2]

  def __call__(self, x_BLD: jax.Array, dropout_key: jax.Array | None) -> jax.Array:
    b, l, _ = x_BLD.shape
    split_heads = lambda t: t.reshape(b, l, self.num_heads, self.head_dim)
    q_BLD, k_BLD, v_BLD = self.project_qkv(x_BLD)
    q_BLHK = apply_norm(self.q_norm, split_heads(q_BLD))
    k_BLHK = apply_norm(self.k_norm, split_heads(k_BLD))
    v_BLHK = split_heads(v_BLD)
    if self.implementation == 'cudnn':
      out_BLHK = _cudnn_attention(q_BLHK, k_BLHK, v_BLHK, self.logit_scale, self.causal)
    elif self.implementation == 'splash':
      out_BLHK = splash_attention(q_BLHK, k_BLHK, v_BLHK, self.logit_scale, self.causal)
    else:
      out_BLHK = _xla_attention(q_BLHK, k_BLHK, v_BLHK, self.logit_scale, self.causal,
                                self.attn_dropout, dropout_key)
    if self.mix_identity is not None:  # (α·I + β·A)·V = α·V + β·A·V
      mix = lambda a: a[...].astype(v_BLHK.dtype)
      out_BLHK = mix(self.mix_identity) * v_BLHK + mix(self.mix_attention) * out_BLHK
    return self.o(out_BLHK.reshape(b, l, self.num_heads * self.head_dim))


ATTENTION_IMPLEMENTATIONS = ('xla', 'cudnn', 'splash')
# Blocks of queries in the XLA path's causal attention (`_xla_attention`): more blocks skip more of the
# masked half but add copies of the key/value prefixes. In the 2-core CPU's train step of
# configs/gpt_preln.py (seq 128) 2 and 4 were within run-to-run noise of each other and 8 slower; the
# one masked matrix (1) was slowest in isolation. 4 blocks leave 5/8 of the work, 2 leave 3/4.
CAUSAL_QUERY_BLOCKS = 4


def _cudnn_attention(q_BLHK: jax.Array, k_BLHK: jax.Array, v_BLHK: jax.Array, logit_scale: float,
                     causal: bool) -> jax.Array:
  """cuDNN's fused attention. Its training kernels take only even sequence lengths, so an odd one (ViT's
  patches plus the class token, e.g. 197) is padded by one position that the sequence-length arguments
  mask out of every softmax, and cut off again."""
  b, l = q_BLHK.shape[:2]
  if l % 2 == 0:
    return jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, scale=logit_scale, is_causal=causal,
                                        implementation='cudnn')
  pad = lambda t: jnp.pad(t, ((0, 0), (0, 1), (0, 0), (0, 0)))
  lengths_B = jnp.full((b,), l, jnp.int32)
  out_BLHK = jax.nn.dot_product_attention(pad(q_BLHK), pad(k_BLHK), pad(v_BLHK), scale=logit_scale,
                                          is_causal=causal, query_seq_lengths=lengths_B,
                                          key_value_seq_lengths=lengths_B, implementation='cudnn')
  return out_BLHK[:, :l]


def _xla_attention(q_BLHK: jax.Array, k_BLHK: jax.Array, v_BLHK: jax.Array, logit_scale: float,
                   causal: bool, dropout_rate: float, dropout_key: jax.Array | None) -> jax.Array:
  """softmax(scale·q·kᵀ (causally masked)) · v with the logits and softmax in float32, and dropout on
  the probabilities when a key is given.

  Causal attention is computed in `CAUSAL_QUERY_BLOCKS` blocks of queries, each against only the keys
  up to its last query: every query's softmax still sees all the keys it may see, so the result is
  the masked full attention's, with (n+1)/2n of its matmul work and logits memory (5/8 for n = 4) —
  the fully masked blocks that flash attention skips (Dao et al. 2022, arXiv:2205.14135) are never
  formed. The blocks are independent, so XLA's CPU runtime also runs them side by side on its threads.
  Without dropout the derivative is `_attention_blocks`' own rule.
  """
  l = q_BLHK.shape[1]
  # Heads are moved next to the batch first, so both matmuls are batched over leading axes: on XLA's
  # CPU backend that halves the forward time against contracting the (B, L, H, K) layout directly.
  swap_heads = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731 (B, L, H, K) <-> (B, H, L, K)
  q_BHLK, k_BHLK, v_BHLK = swap_heads(q_BLHK), swap_heads(k_BLHK), swap_heads(v_BLHK)
  # Block boundaries ceil(l·i/n), i = 0..n (a set: short sequences give fewer, non-empty blocks).
  bounds = (tuple(sorted({-(-l * i // CAUSAL_QUERY_BLOCKS) for i in range(CAUSAL_QUERY_BLOCKS + 1)}))
            if causal else (0, l))
  if dropout_key is None or dropout_rate == 0.0:
    return swap_heads(_attention_blocks(q_BHLK, k_BHLK, v_BHLK, logit_scale, bounds, causal))
  return swap_heads(_attention_over_blocks(q_BHLK, k_BHLK, v_BHLK, logit_scale, bounds, causal,
                                           dropout_rate, dropout_key))


def _query_blocks(q_BHLK: jax.Array, k_BHLK: jax.Array, v_BHLK: jax.Array, bounds: tuple[int, ...],
                  causal: bool):
  """For each block of queries [start, end): its queries, the keys and values up to `end` (all of them
  for the one block of non-causal attention) and the mask (True: may attend; None: all)."""
  for start, end in zip(bounds[:-1], bounds[1:]):
    # Causal: query start + j may see keys 0 .. start + j.
    mask_QT = jnp.tril(jnp.ones((end - start, end), dtype=bool), k=start) if causal else None
    yield q_BHLK[:, :, start:end], k_BHLK[:, :, :end], v_BHLK[:, :, :end], mask_QT


def _attention_over_blocks(q_BHLK: jax.Array, k_BHLK: jax.Array, v_BHLK: jax.Array, logit_scale: float,
                           bounds: tuple[int, ...], causal: bool, dropout_rate: float = 0.0,
                           dropout_key: jax.Array | None = None) -> jax.Array:
  """Attention over the query blocks `bounds` (`_query_blocks`), (B, H, L, K) layout, with dropout on
  the probabilities when a key is given (each causal block draws its own mask)."""
  out_blocks = []
  for i, (q_BHQK, k_BHTK, v_BHTK, mask_QT) in enumerate(
      _query_blocks(q_BHLK, k_BHLK, v_BHLK, bounds, causal)):
    key = jax.random.fold_in(dropout_key, i) if causal and dropout_key is not None else dropout_key
    probs_BHQT = _attention_probabilities(q_BHQK, k_BHTK, logit_scale, mask_QT).astype(v_BHTK.dtype)
    out_blocks.append(jnp.einsum('bhqt,bhtk->bhqk', dropout(probs_BHQT, dropout_rate, key), v_BHTK))
  return jnp.concatenate(out_blocks, axis=2)


def _attention_probabilities(q_BHQK: jax.Array, k_BHTK: jax.Array, logit_scale: float,
                             mask_QT: jax.Array | None) -> jax.Array:
  """softmax(scale·q·kᵀ) in float32 of queries Q against keys T, with `mask_QT` (True: may attend)."""
  logits_BHQT = jnp.einsum('bhqk,bhtk->bhqt', q_BHQK, k_BHTK, preferred_element_type=jnp.float32)
  logits_BHQT = logits_BHQT * logit_scale
  if mask_QT is not None:
    logits_BHQT = jnp.where(mask_QT, logits_BHQT, jnp.finfo(jnp.float32).min)
  # The softmax over rows flattened to one axis, as the norms take their statistics: XLA's CPU backend
  # ran the train step of configs/gpt_preln.py a little faster this way than with the four axes kept
  # (paired comparison of the two compiled steps in one process).
  rows_NT = jax.nn.softmax(logits_BHQT.reshape(-1, logits_BHQT.shape[-1]), axis=-1)
  return rows_NT.reshape(logits_BHQT.shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _attention_blocks(q_BHLK: jax.Array, k_BHLK: jax.Array, v_BHLK: jax.Array, logit_scale: float,
                      bounds: tuple[int, ...], causal: bool) -> jax.Array:
  """`_attention_over_blocks` without dropout, differentiated by its own rule (below)."""
  return _attention_over_blocks(q_BHLK, k_BHLK, v_BHLK, logit_scale, bounds, causal)


# On the CPU, the attention's key and value gradients are computed in transposed forms
# (`_attention_blocks_jvp`); False keeps that one's plain form (`benchmarks/cpu_weight_gradient_form.py
# --form=attention|attention_key|attention_value` times the train step both ways).
TRANSPOSED_ATTENTION_KEY_GRADIENT = True
TRANSPOSED_ATTENTION_VALUE_GRADIENT = True


@_attention_blocks.defjvp
def _attention_blocks_jvp(logit_scale, bounds, causal, primals, tangents):
  # The derivative of P·V with P = softmax(S), S = scale·Q·Kᵀ: dS = scale·(dQ·Kᵀ + Q·dKᵀ),
  # dP = P ⊙ (dS − rowsum(P ⊙ dS)) (masked entries have P = 0), d(P·V) = dP·V + P·dV. JAX transposes
  # it into the backward pass. Two of its products contract over the queries, with the left operand
  # read transposed, which XLA's CPU matmuls run slowly: dK = dSᵀ·Q and dV = Pᵀ·dO. On the CPU the key
  # term is written so that its transpose writes dSᵀ out first and multiplies it as it lies, and the
  # value term so that the transpose computes dVᵀ = dOᵀ·P (K rows, not T) and transposes that; the
  # barriers keep XLA from folding the transposes back into the matmuls. With both forms the CPU's train
  # steps of configs/gpt_preln.py, gpt_dnt.py and vit_dnt.py take 0.92–0.96 of the plain forms' time,
  # most of it from the key term's (README, "Performance"). Other platforms take the plain forms.
  swap = lambda t: jnp.swapaxes(t, 2, 3)  # noqa: E731 (B, H, X, Y) <-> (B, H, Y, X)
  barrier = jax.lax.optimization_barrier
  f32 = jnp.float32

  def on_cpu_transposed(switch, tangent, cpu, plain):
    if not switch:
      return plain(tangent)
    return jax.lax.platform_dependent(tangent, cpu=cpu, default=plain)

  def key_term(q_BHQK, dk_BHTK):  # Q·dKᵀ
    return on_cpu_transposed(
        TRANSPOSED_ATTENTION_KEY_GRADIENT, dk_BHTK,
        lambda dk: swap(barrier(jnp.einsum('bhtk,bhqk->bhtq', dk, q_BHQK, preferred_element_type=f32))),
        lambda dk: jnp.einsum('bhqk,bhtk->bhqt', q_BHQK, dk, preferred_element_type=f32))

  def value_term(probs_BHQT, dv_BHTK):  # P·dV
    return on_cpu_transposed(
        TRANSPOSED_ATTENTION_VALUE_GRADIENT, dv_BHTK,
        lambda dv: jnp.einsum('bhkt,bhqt->bhqk', barrier(swap(dv)), probs_BHQT),
        lambda dv: jnp.einsum('bhqt,bhtk->bhqk', probs_BHQT, dv))

  out_blocks, tangent_blocks = [], []
  for (q_BHQK, k_BHTK, v_BHTK, mask_QT), (dq_BHQK, dk_BHTK, dv_BHTK, _) in zip(
      _query_blocks(*primals, bounds, causal), _query_blocks(*tangents, bounds, causal)):
    probs_f32_BHQT = _attention_probabilities(q_BHQK, k_BHTK, logit_scale, mask_QT)
    probs_BHQT = probs_f32_BHQT.astype(v_BHTK.dtype)
    out_blocks.append(jnp.einsum('bhqt,bhtk->bhqk', probs_BHQT, v_BHTK))
    dlogits_BHQT = logit_scale * (
        jnp.einsum('bhqk,bhtk->bhqt', dq_BHQK, k_BHTK, preferred_element_type=f32)
        + key_term(q_BHQK, dk_BHTK))
    dprobs_BHQT = probs_f32_BHQT * (
        dlogits_BHQT - jnp.sum(probs_f32_BHQT * dlogits_BHQT, axis=-1, keepdims=True))
    tangent_blocks.append(jnp.einsum('bhqt,bhtk->bhqk', dprobs_BHQT.astype(v_BHTK.dtype), v_BHTK)
                          + value_term(probs_BHQT, dv_BHTK))
  return jnp.concatenate(out_blocks, axis=2), jnp.concatenate(tangent_blocks, axis=2)


def _gelu(x: jax.Array) -> jax.Array:
  """The exact GELU x·Φ(x) = x·(1 + erf(x/√2))/2 (Hendrycks & Gimpel 2016, arXiv:1606.08415), written
  with erf as PyTorch writes it. `jax.nn.gelu(approximate=False)` uses erfc instead, exact also far in
  the negative tail, at the price of three polynomial branches and an exp per element: 3x slower on
  the CPU; the two differ by less than 1e-6, values and derivatives (tests/test_models.py)."""
  return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))


# The exact GELU is recomputed in the backward pass from its input (`jax.checkpoint`) instead of
# keeping the several intermediates of its erf that XLA otherwise saves: on one H100 at GPT-2-small size
# the activation's forward and backward kernels moved ~900 MB per layer that way, ~500 MB this way.
ACTIVATIONS = {'relu': jax.nn.relu, 'gelu': jax.checkpoint(_gelu)}


class FFN(nnx.Module):
  """Linear d→F, activation, Linear F→d."""

  def __init__(self, d: int, hidden: int, *, activation: str, stds: dict[str, Any], distribution: str,
               use_bias: bool, rngs: nnx.Rngs, lr_scale: dict[str, float] | None = None,
               out_width: int | None = None):
    if activation not in ACTIVATIONS:
      raise ValueError(f'model.activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}')
    self.activation = activation
    lr = lr_scale or {}
    self.ffn1 = Dense(d, hidden, std=stds['ffn1'], distribution=distribution, use_bias=use_bias,
                      axes=('embed', 'mlp'), lr_scale=lr.get('ffn1', 1.0), rngs=rngs)
    self.ffn2 = Dense(hidden, d if out_width is None else out_width, std=stds['ffn2'],
                      distribution=distribution, use_bias=use_bias, axes=('mlp', 'embed'),
                      lr_scale=lr.get('ffn2', 1.0), rngs=rngs)

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    return self.ffn2(ACTIVATIONS[self.activation](self.ffn1(x_BLD)))
