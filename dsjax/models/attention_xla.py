"""`model.attention='xla'`: softmax attention in query blocks with its own derivative, tuned for the CPU.

It computes what `dsjax.models.layers.plain_attention` computes (the logits and the softmax in float32,
dropout on the probabilities), faster:
  * causal attention runs in `CAUSAL_QUERY_BLOCKS` blocks of queries, each against only the keys up to
    its last query, so the fully masked blocks are never formed (flash attention's skipping, Dao et al.
    2022, arXiv:2205.14135, without the kernel);
  * without dropout it is differentiated by its own rule (`_attention_blocks`), whose key and value
    gradients take transposed forms on the CPU (the switches `TRANSPOSED_ATTENTION_KEY_GRADIENT` and
    `TRANSPOSED_ATTENTION_VALUE_GRADIENT`; `benchmarks/cpu_weight_gradient_form.py` times them);
  * the heads are moved next to the batch and the softmax runs over rows flattened to one axis, the
    layouts XLA's CPU backend runs fastest.
With dropout, each causal query block draws its own mask, so its draws differ from the plain form's for
the same key (non-causal attention, one block, draws the same mask); that path is differentiated by JAX.
'auto' takes this form wherever no fused kernel applies (`dsjax.models.config.attention_implementation`).
tests/models/test_attention_implementations.py checks it against the plain form, outputs and gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Blocks of queries in causal attention: more blocks skip more of the masked half but add copies of the
# key/value prefixes. In the 2-core CPU's train step of configs/gpt_preln.py (seq 128) 2 and 4 were
# within run-to-run noise of each other and 8 slower; the one masked matrix (1) was slowest in isolation.
# 4 blocks leave 5/8 of the work, 2 leave 3/4.
CAUSAL_QUERY_BLOCKS = 4

# On the CPU, the attention's key and value gradients are computed in transposed forms
# (`_attention_blocks_jvp`); False keeps that one's plain form (`benchmarks/cpu_weight_gradient_form.py
# --form=attention|attention_key|attention_value` times the train step both ways).
TRANSPOSED_ATTENTION_KEY_GRADIENT = True
TRANSPOSED_ATTENTION_VALUE_GRADIENT = True


def xla_attention(
  q_BLHK: jax.Array,
  k_BLHK: jax.Array,
  v_BLHK: jax.Array,
  logit_scale: float,
  causal: bool,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """softmax(scale·q·kᵀ (causally masked)) · v with the logits and softmax in float32, and dropout on
  the probabilities when a key is given; (B, L, H, K) in and out.

  Causal attention is computed in `CAUSAL_QUERY_BLOCKS` blocks of queries, each against only the keys
  up to its last query: every query's softmax still sees all the keys it may see, so the result is
  the masked full attention's, with (n+1)/2n of its matmul work and logits memory (5/8 for n = 4).
  The blocks are independent, so XLA's CPU runtime also runs them side by side on its threads.
  Without dropout the derivative is `_attention_blocks`' own rule.
  """
  l = q_BLHK.shape[1]
  # Heads are moved next to the batch first, so both matmuls are batched over leading axes: on XLA's
  # CPU backend that halves the forward time against contracting the (B, L, H, K) layout directly.
  swap_heads = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731 (B, L, H, K) <-> (B, H, L, K)
  q_BHLK, k_BHLK, v_BHLK = swap_heads(q_BLHK), swap_heads(k_BLHK), swap_heads(v_BLHK)
  # Block boundaries ceil(l·i/n), i = 0..n (a set: short sequences give fewer, non-empty blocks).
  bounds = (
    tuple(sorted({-(-l * i // CAUSAL_QUERY_BLOCKS) for i in range(CAUSAL_QUERY_BLOCKS + 1)}))
    if causal
    else (0, l)
  )
  if dropout_key is None or dropout_rate == 0.0:
    return swap_heads(_attention_blocks(q_BHLK, k_BHLK, v_BHLK, logit_scale, bounds, causal))
  return swap_heads(
    _attention_over_blocks(q_BHLK, k_BHLK, v_BHLK, logit_scale, bounds, causal, dropout_rate, dropout_key)
  )


def _dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  """Inverted dropout, the same draw as `dsjax.models.layers.dropout` (which builds on this module)."""
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _query_blocks(
  q_BHLK: jax.Array, k_BHLK: jax.Array, v_BHLK: jax.Array, bounds: tuple[int, ...], causal: bool
):
  """For each block of queries [start, end): its queries, the keys and values up to `end` (all of them
  for the one block of non-causal attention) and the mask (True: may attend; None: all)."""
  for start, end in zip(bounds[:-1], bounds[1:]):
    # Causal: query start + j may see keys 0 .. start + j.
    mask_QT = jnp.tril(jnp.ones((end - start, end), dtype=bool), k=start) if causal else None
    yield q_BHLK[:, :, start:end], k_BHLK[:, :, :end], v_BHLK[:, :, :end], mask_QT


def _attention_over_blocks(
  q_BHLK: jax.Array,
  k_BHLK: jax.Array,
  v_BHLK: jax.Array,
  logit_scale: float,
  bounds: tuple[int, ...],
  causal: bool,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """Attention over the query blocks `bounds` (`_query_blocks`), (B, H, L, K) layout, with dropout on
  the probabilities when a key is given (each causal block draws its own mask)."""
  out_blocks = []
  for i, (q_BHQK, k_BHTK, v_BHTK, mask_QT) in enumerate(
    _query_blocks(q_BHLK, k_BHLK, v_BHLK, bounds, causal)
  ):
    key = jax.random.fold_in(dropout_key, i) if causal and dropout_key is not None else dropout_key
    probs_BHQT = _attention_probabilities(q_BHQK, k_BHTK, logit_scale, mask_QT).astype(v_BHTK.dtype)
    if key is not None and dropout_rate != 0.0:
      probs_BHQT = _dropout(probs_BHQT, dropout_rate, key)
    out_blocks.append(jnp.einsum('bhqt,bhtk->bhqk', probs_BHQT, v_BHTK))
  return jnp.concatenate(out_blocks, axis=2)


def _attention_probabilities(
  q_BHQK: jax.Array, k_BHTK: jax.Array, logit_scale: float, mask_QT: jax.Array | None
) -> jax.Array:
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
def _attention_blocks(
  q_BHLK: jax.Array,
  k_BHLK: jax.Array,
  v_BHLK: jax.Array,
  logit_scale: float,
  bounds: tuple[int, ...],
  causal: bool,
) -> jax.Array:
  """`_attention_over_blocks` without dropout, differentiated by its own rule (below)."""
  return _attention_over_blocks(q_BHLK, k_BHLK, v_BHLK, logit_scale, bounds, causal)


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
  # most of it from the key term's (benchmarks/README.md). Other platforms take the plain forms.
  swap = lambda t: jnp.swapaxes(t, 2, 3)  # noqa: E731 (B, H, X, Y) <-> (B, H, Y, X)
  barrier = jax.lax.optimization_barrier
  f32 = jnp.float32

  def on_cpu_transposed(switch, tangent, cpu, plain):
    if not switch:
      return plain(tangent)
    return jax.lax.platform_dependent(tangent, cpu=cpu, default=plain)

  def key_term(q_BHQK, dk_BHTK):  # Q·dKᵀ
    return on_cpu_transposed(
      TRANSPOSED_ATTENTION_KEY_GRADIENT,
      dk_BHTK,
      lambda dk: swap(barrier(jnp.einsum('bhtk,bhqk->bhtq', dk, q_BHQK, preferred_element_type=f32))),
      lambda dk: jnp.einsum('bhqk,bhtk->bhqt', q_BHQK, dk, preferred_element_type=f32),
    )

  def value_term(probs_BHQT, dv_BHTK):  # P·dV
    return on_cpu_transposed(
      TRANSPOSED_ATTENTION_VALUE_GRADIENT,
      dv_BHTK,
      lambda dv: jnp.einsum('bhkt,bhqt->bhqk', barrier(swap(dv)), probs_BHQT),
      lambda dv: jnp.einsum('bhqt,bhtk->bhqk', probs_BHQT, dv),
    )

  out_blocks, tangent_blocks = [], []
  for (q_BHQK, k_BHTK, v_BHTK, mask_QT), (dq_BHQK, dk_BHTK, dv_BHTK, _) in zip(
    _query_blocks(*primals, bounds, causal), _query_blocks(*tangents, bounds, causal)
  ):
    probs_f32_BHQT = _attention_probabilities(q_BHQK, k_BHTK, logit_scale, mask_QT)
    probs_BHQT = probs_f32_BHQT.astype(v_BHTK.dtype)
    out_blocks.append(jnp.einsum('bhqt,bhtk->bhqk', probs_BHQT, v_BHTK))
    dlogits_BHQT = logit_scale * (
      jnp.einsum('bhqk,bhtk->bhqt', dq_BHQK, k_BHTK, preferred_element_type=f32) + key_term(q_BHQK, dk_BHTK)
    )
    dprobs_BHQT = probs_f32_BHQT * (
      dlogits_BHQT - jnp.sum(probs_f32_BHQT * dlogits_BHQT, axis=-1, keepdims=True)
    )
    tangent_blocks.append(
      jnp.einsum('bhqt,bhtk->bhqk', dprobs_BHQT.astype(v_BHTK.dtype), v_BHTK)
      + value_term(probs_BHQT, dv_BHTK)
    )
  return jnp.concatenate(out_blocks, axis=2), jnp.concatenate(tangent_blocks, axis=2)
