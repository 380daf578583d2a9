"""`model.attention='cudnn'`: cuDNN's fused flash attention on NVIDIA GPUs, through
`jax.nn.dot_product_attention(implementation='cudnn')`.

The kernel never forms the B·H·L² probabilities (memory linear in L), computes the softmax in float32,
takes bf16/fp16 inputs and has no attention dropout. 'auto' picks it on a capable GPU with bf16 compute
(`dsjax.models.config.attention_implementation`); tests/models/test_attention_implementations.py checks
it against `dsjax.models.layers.plain_attention` where a GPU is present.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cudnn_attention(
  q_BLHK: jax.Array,
  k_BLHK: jax.Array,
  v_BLHK: jax.Array,
  logit_scale: float,
  causal: bool,
  dropout_rate: float = 0.0,
  dropout_key: jax.Array | None = None,
) -> jax.Array:
  """softmax(scale·q·kᵀ (causally masked))·v by cuDNN; (B, L, H, K) in and out. Its training kernels
  take only even sequence lengths, so an odd one (ViT's patches plus the class token, e.g. 197) is padded
  by one position that the sequence-length arguments mask out of every softmax, and cut off again."""
  if dropout_key is not None and dropout_rate > 0:
    raise ValueError('cuDNN attention has no attention dropout (model.attn_dropout must be 0)')
  b, l = q_BLHK.shape[:2]
  if l % 2 == 0:
    return jax.nn.dot_product_attention(
      q_BLHK, k_BLHK, v_BLHK, scale=logit_scale, is_causal=causal, implementation='cudnn'
    )
  pad = lambda t: jnp.pad(t, ((0, 0), (0, 1), (0, 0), (0, 0)))  # noqa: E731
  # The lengths (l everywhere) are computed from q's values, not made as a constant, so that under
  # `jax.vmap` (a population of models) they are batched as q is: jax 0.10's batching rule folds the
  # mapped axis into q/k/v's batch but does not broadcast an unbatched length vector to it.
  lengths_B = jnp.where(jnp.isnan(q_BLHK[:, 0, 0, 0]), l, l).astype(jnp.int32)
  out_BLHK = jax.nn.dot_product_attention(
    pad(q_BLHK),
    pad(k_BLHK),
    pad(v_BLHK),
    scale=logit_scale,
    is_causal=causal,
    query_seq_lengths=lengths_B,
    key_value_seq_lengths=lengths_B,
    implementation='cudnn',
  )
  return out_BLHK[:, :l]
