"""Leaf layers of the transformer: dense projections, norms, dropout, attention and the FFN.

Everything is written out rather than taken from `flax.nnx.Linear` & co. for two reasons that matter to
signal-propagation research:
  * the initial standard deviation of every weight is an explicit (possibly traced, per-layer) number set
    by the initialisation scheme (`dsjax.schemes`), so DSLM can give layer n its own V/O variance while the
    layers are still created in one vmapped call;
  * dropout takes an explicit PRNG key (or None = deterministic), so the whole forward pass is a pure
    function of (parameters, inputs, key): resumable bit-for-bit and easy to scan over layers.

The attention is written as plain math (`Attention`, `plain_attention`); its fast forms, selected by
`model.attention`, each live in their own module: `attention_xla` (query blocks and a derivative rule
tuned for the CPU), `attention_cudnn` (cuDNN's fused kernel) and `tpu_attention` (Pallas' splash
kernel). The dense layers' derivative rules live in `fast_matmul`, the FFN's fused bias and GELU
(`model.fused_ops`) in `fused_ops`. This module defines no derivative rule of its own: whatever is
changed here, JAX differentiates (the fast forms compute the math as it is written now, not an edit).

Shape suffixes: B batch, L sequence, D model width, H heads, K head dim, F FFN hidden width.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.models import fast_matmul, fused_ops
from dsjax.models.attention_cudnn import cudnn_attention
from dsjax.models.attention_xla import xla_attention
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


def init_weight(
  key: jax.Array, shape: tuple[int, ...], std: Any, distribution: str, dtype=jnp.float32
) -> jax.Array:
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


# Dense layers multiply through `fast_matmul.matmul_last_axis`: the same product as `jnp.tensordot`,
# with derivative rules that make the backward pass faster (on the CPU; bf16 matmuls with float32
# outputs everywhere). False: the plain product, differentiated by JAX.
FAST_MATMUL = True


def matmul_last_axis(x: jax.Array, kernel: jax.Array, out_dtype: Any = None) -> jax.Array:
  """x (..., d_in) contracted with kernel (d_in, *out) into (..., *out), accumulated and written in
  `out_dtype` (default the inputs' dtype)."""
  if FAST_MATMUL:
    return fast_matmul.matmul_last_axis(x, kernel, out_dtype)
  return jnp.tensordot(x, kernel, axes=1, preferred_element_type=out_dtype)


# `model.matmul_cast`: the number formats a weight matmul's inputs may be rounded to ('none': no cast).
MATMUL_CASTS = ('none', 'float8_e4m3fn', 'float8_e5m2')


def direct_cast(x: jax.Array, fmt: str) -> jax.Array:
  """x rounded to the number format `fmt` (to nearest) and back to x's dtype, unscaled ("direct casting",
  Kedia et al. 2024, arXiv:2403.09635, §4.6, Table 12): values below half the format's smallest subnormal
  become 0, values past its largest finite number's rounding range become NaN (float8_e4m3fn has no
  infinity) or ±inf (float8_e5m2). The gradient passes as if the cast were the identity (the
  straight-through estimator): the cotangent itself is not rounded."""
  if fmt == 'none':
    return x
  return x + jax.lax.stop_gradient(x.astype(fmt).astype(x.dtype) - x)


def cast_matmul(x: jax.Array, kernel: jax.Array, fmt: str, out_dtype: Any = None) -> jax.Array:
  """`matmul_last_axis` of x and kernel, both `direct_cast` to `fmt` first (`model.matmul_cast`)."""
  return matmul_last_axis(direct_cast(x, fmt), direct_cast(kernel, fmt), out_dtype)


class Dense(nnx.Module):
  """y = x @ kernel (+ bias). kernel: (d_in, d_out) drawn with standard deviation `std`.

  `lr_scale` multiplies the kernel's learning rate only: a bias is a vector-like parameter, whose Adam
  learning rate μP leaves unscaled (Yang et al. 2021, Tensor Programs V, Table 3: "all biases").
  `input_cast` (`model.matmul_cast`): the matmul's two inputs, x and the kernel, are `direct_cast` to that
  format first (the bias stays unrounded).
  """

  def __init__(
    self,
    d_in: int,
    d_out: int,
    *,
    std: Any,
    distribution: str,
    use_bias: bool,
    axes: tuple[str | None, str | None],
    rngs: nnx.Rngs,
    lr_scale: float = 1.0,
    input_cast: str = 'none',
  ):
    self.kernel = param(init_weight(rngs.params(), (d_in, d_out), std, distribution), axes, lr_scale)
    self.bias = param(jnp.zeros((d_out,)), axes[1:]) if use_bias else None
    self.input_cast = input_cast

  def matmul(self, x: jax.Array, out_dtype: Any = None) -> jax.Array:
    """x @ kernel in x's dtype (the compute dtype the block casts its branch input to), whatever the
    parameters are stored in, with the inputs cast as `input_cast` says; written in `out_dtype`."""
    return cast_matmul(x, self.kernel[...].astype(x.dtype), self.input_cast, out_dtype)

  def __call__(self, x: jax.Array, out_dtype: Any = None) -> jax.Array:
    """The matmul (`matmul`), then the bias; the output is in `out_dtype` (default the input's)."""
    y = self.matmul(x, out_dtype)
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


def plain_attention(
  q_BLHK: jax.Array,
  k_BLHK: jax.Array,
  v_BLHK: jax.Array,
  logit_scale: float,
  causal: bool,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """softmax(scale·q·kᵀ (causally masked))·v, the attention's definition, differentiated by JAX; (B, L,
  H, K) in and out. The logits and the softmax are float32 whatever the inputs' dtype; the probabilities
  are rounded to v's dtype, dropped out (with a key) and applied to v. Edit this to change the attention
  (e.g. ALiBi, a logit soft-cap) and run it with `model.attention='plain'`: the fast forms in
  `ATTENTION_IMPLEMENTATIONS` compute this function as it is written here, not an edit of it."""
  logits_BHQT = logit_scale * jnp.einsum(
    'bqhk,bthk->bhqt', q_BLHK, k_BLHK, preferred_element_type=jnp.float32
  )
  if causal:  # Query i sees the keys 0..i.
    l = q_BLHK.shape[1]
    logits_BHQT = jnp.where(jnp.tril(jnp.ones((l, l), bool)), logits_BHQT, jnp.finfo(jnp.float32).min)
  probs_BHQT = jax.nn.softmax(logits_BHQT, axis=-1).astype(v_BLHK.dtype)
  probs_BHQT = dropout(probs_BHQT, dropout_rate, dropout_key)
  return jnp.einsum('bhqt,bthk->bqhk', probs_BHQT, v_BLHK)


# `model.attention`'s implementations, each f(q_BLHK, k_BLHK, v_BLHK, logit_scale, causal, dropout_rate,
# dropout_key) -> out_BLHK computing `plain_attention` (tests/models/test_attention_implementations.py):
#   'xla': query blocks and a derivative rule tuned for the CPU, with dropout (`attention_xla`);
#   'cudnn': cuDNN's fused flash attention, NVIDIA GPUs, bf16, no dropout (`attention_cudnn`);
#   'splash': Pallas' splash kernel for TPUs, no dropout; q·scale is rounded to q's dtype before the
#     kernel's product, an extra rounding in bfloat16 (`tpu_attention`).
# `dsjax.models.config.attention_implementation` resolves 'auto' to one of them.
ATTENTION_IMPLEMENTATIONS = {
  'plain': plain_attention,
  'xla': xla_attention,
  'cudnn': cudnn_attention,
  'splash': splash_attention,
}


def warmup_factor(step: Any, warmup_steps: int) -> jax.Array:
  """min(1, step/warmup_steps) in float32: 0 at step 0, rising linearly to 1 at `warmup_steps`."""
  return jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / float(warmup_steps))


class Attention(nnx.Module):
  """Multi-head self-attention with separate q/k/v/o projections and optional QKNorm (DNT).

  Separate projection parameters (rather than one fused qkv kernel) keep each weight's initial
  variance a single knob, as the DSLM recipe needs (Kedia et al. 2024 §3.5: q, k at 1/d; v, o per
  layer). `logit_scale` multiplies q·k (default 1/sqrt(d_head); μP uses 1/d_head, Noci et al. 2022
  τ/sqrt(d_head)). `logit_warmup_steps` > 0: during training the logit scale is multiplied by
  `warmup_factor(step, logit_warmup_steps)` (Noci et al. 2022, App. C.3, warm up τ): a non-trainable
  factor, `logit_factor`, that the train step sets from its step count (`set_training_step`) and that is
  1 as built, so evaluation and every other caller see the full scale. It multiplies the queries, so the
  attention implementations keep their static scale; without a warm-up there is no factor at all.
  `identity_mix`: the attention matrix is α·I + β·A(X) with learnable scalars α (init 1)
  and β (init 0), Value-SkipInit (He et al. 2023, arXiv:2302.10322 §4). `implementation`: the key of
  `ATTENTION_IMPLEMENTATIONS` that computes softmax(scale·q·kᵀ)·v from the heads ('plain' is
  `plain_attention`, the definition; the others are its fast forms).
  """

  def __init__(
    self,
    d: int,
    num_heads: int,
    *,
    stds: dict[str, Any],
    distribution: str,
    use_bias: bool,
    qk_norm: bool,
    norm_kind: str,
    norm_eps: float,
    causal: bool,
    attn_dropout: float,
    rngs: nnx.Rngs,
    logit_scale: float | None = None,
    logit_warmup_steps: int = 0,
    identity_mix: bool = False,
    lr_scale: dict[str, float] | None = None,
    inner_width: int | None = None,
    out_width: int | None = None,
    implementation: str = 'xla',
    matmul_cast: str = 'none',
  ):
    if implementation not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(
        f'model.attention must be one of {list(ATTENTION_IMPLEMENTATIONS)}, got {implementation!r}'
      )
    self.implementation = implementation
    inner = d if inner_width is None else inner_width
    out = d if out_width is None else out_width
    self.num_heads, self.head_dim = num_heads, inner // num_heads
    self.causal, self.attn_dropout = causal, attn_dropout
    self.logit_scale = float(self.head_dim**-0.5 if logit_scale is None else logit_scale)
    self.logit_warmup_steps = logit_warmup_steps
    self.logit_factor = constant(jnp.ones((), jnp.float32), ()) if logit_warmup_steps else None
    lr = lr_scale or {}

    def dense(name, d_in, d_out, axes):
      return Dense(
        d_in,
        d_out,
        std=stds[name],
        distribution=distribution,
        use_bias=use_bias,
        axes=axes,
        lr_scale=lr.get(name, 1.0),
        rngs=rngs,
        input_cast=matmul_cast,
      )

    self.q, self.k = dense('q', d, inner, ('embed', 'heads')), dense('k', d, inner, ('embed', 'heads'))
    self.v, self.o = dense('v', d, inner, ('embed', 'heads')), dense('o', inner, out, ('heads', 'embed'))
    # QKNorm normalises each head's query/key over the head dimension (gain shared across heads).
    self.q_norm = make_norm(qk_norm, self.head_dim, norm_kind, norm_eps)
    self.k_norm = make_norm(qk_norm, self.head_dim, norm_kind, norm_eps)
    self.mix_identity = param(jnp.ones(()), ()) if identity_mix else None
    self.mix_attention = param(jnp.zeros(()), ()) if identity_mix else None

  def set_training_step(self, step: Any) -> None:
    """Sets the logit-scale warm-up factor for the training step that starts after `step` steps (a
    scalar, traced or not); nothing without a warm-up."""
    if self.logit_factor is not None:
      factor = warmup_factor(step, self.logit_warmup_steps)
      self.logit_factor.set_value(jnp.broadcast_to(factor, self.logit_factor.shape))

  def project_qkv(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x·W_q + b_q, x·W_k + b_k, x·W_v + b_v as one matmul against the three kernels stacked on a new
    middle axis (d, 3, inner): at the small widths the CPU trains, three matmuls of a third of the width
    (and their gradients) run well below the rate of one. On that axis each projection is a contiguous
    block of every row of the product (no strided copies in the backward pass), and kernels sharded over
    'heads' give a stack sharded the same way. The parameters stay three `Dense` modules, and the inputs
    are cast as theirs would be (`Dense.input_cast`)."""
    denses = (self.q, self.k, self.v)
    kernel_D3I = jnp.stack([d.kernel[...].astype(x_BLD.dtype) for d in denses], axis=1)
    qkv_N3I = cast_matmul(x_BLD.reshape(-1, x_BLD.shape[-1]), kernel_D3I, self.q.input_cast)
    if self.q.bias is not None:  # Added before (B, L) is restored: its gradient is a sum over one axis.
      qkv_N3I = qkv_N3I + jnp.stack([d.bias[...].astype(x_BLD.dtype) for d in denses], axis=0)
    qkv_BL3I = qkv_N3I.reshape(*x_BLD.shape[:2], *qkv_N3I.shape[1:])
    return qkv_BL3I[:, :, 0], qkv_BL3I[:, :, 1], qkv_BL3I[:, :, 2]

  def __call__(self, x_BLD: jax.Array, dropout_key: jax.Array | None, out_bias: bool = True) -> jax.Array:
    """The attention's output; `out_bias=False`: without the output projection's bias (a fused kernel
    adds it, `dsjax.models.transformer.Block`)."""
    b, l, _ = x_BLD.shape
    split_heads = lambda t: t.reshape(b, l, self.num_heads, self.head_dim)  # noqa: E731
    q_BLD, k_BLD, v_BLD = self.project_qkv(x_BLD)
    q_BLHK = apply_norm(self.q_norm, split_heads(q_BLD))
    if self.logit_factor is not None:  # (factor·q)·k = factor·(q·k): the warmed-up logit scale
      q_BLHK = q_BLHK * self.logit_factor[...].astype(q_BLHK.dtype)
    k_BLHK = apply_norm(self.k_norm, split_heads(k_BLD))
    v_BLHK = split_heads(v_BLD)
    attend = ATTENTION_IMPLEMENTATIONS[self.implementation]
    out_BLHK = attend(q_BLHK, k_BLHK, v_BLHK, self.logit_scale, self.causal, self.attn_dropout, dropout_key)
    if self.mix_identity is not None:  # (α·I + β·A)·V = α·V + β·A·V
      mix = lambda a: a[...].astype(v_BLHK.dtype)  # noqa: E731
      out_BLHK = mix(self.mix_identity) * v_BLHK + mix(self.mix_attention) * out_BLHK
    out_BLD = out_BLHK.reshape(b, l, self.num_heads * self.head_dim)
    return self.o(out_BLD) if out_bias else self.o.matmul(out_BLD)


def _gelu(x: jax.Array) -> jax.Array:
  """The exact GELU x·Φ(x) = x·(1 + erf(x/√2))/2 (Hendrycks & Gimpel 2016, arXiv:1606.08415), written
  with erf as PyTorch writes it. `jax.nn.gelu(approximate=False)` uses erfc instead, exact also far in
  the negative tail, at the price of three polynomial branches and an exp per element: 3x slower on
  the CPU; the two differ by less than 1e-6, values and derivatives (tests/models/test_models.py)."""
  return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))


# The exact GELU is recomputed in the backward pass from its input (`jax.checkpoint`) instead of
# keeping the several intermediates of its erf that XLA otherwise saves: on one H100 at GPT-2-small size
# the activation's forward and backward kernels moved ~900 MB per layer that way, ~500 MB this way.
ACTIVATIONS = {'relu': jax.nn.relu, 'gelu': jax.checkpoint(_gelu)}


class FFN(nnx.Module):
  """Linear d→F, activation, Linear F→d. `fused_gelu`: the first layer's bias and the exact GELU run as
  one Pallas kernel (`fused_ops.bias_gelu`, the same math up to rounding; `model.fused_ops`)."""

  def __init__(
    self,
    d: int,
    hidden: int,
    *,
    activation: str,
    stds: dict[str, Any],
    distribution: str,
    use_bias: bool,
    rngs: nnx.Rngs,
    lr_scale: dict[str, float] | None = None,
    out_width: int | None = None,
    fused_gelu: bool = False,
    matmul_cast: str = 'none',
  ):
    if activation not in ACTIVATIONS:
      raise ValueError(f'model.activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}')
    self.activation = activation
    self.fused_gelu = fused_gelu and activation == 'gelu'
    lr = lr_scale or {}
    self.ffn1 = Dense(
      d,
      hidden,
      std=stds['ffn1'],
      distribution=distribution,
      use_bias=use_bias,
      axes=('embed', 'mlp'),
      lr_scale=lr.get('ffn1', 1.0),
      rngs=rngs,
      input_cast=matmul_cast,
    )
    self.ffn2 = Dense(
      hidden,
      d if out_width is None else out_width,
      std=stds['ffn2'],
      distribution=distribution,
      use_bias=use_bias,
      axes=('mlp', 'embed'),
      lr_scale=lr.get('ffn2', 1.0),
      rngs=rngs,
      input_cast=matmul_cast,
    )

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    if self.fused_gelu:  # ffn1's matmul, then its bias and the GELU in one pass
      z_BLF = self.ffn1.matmul(x_BLD)
      bias_F = None if self.ffn1.bias is None else self.ffn1.bias[...]
      return self.ffn2(fused_ops.bias_gelu(z_BLF, bias_F))
    return self.ffn2(ACTIVATIONS[self.activation](self.ffn1(x_BLD)))
