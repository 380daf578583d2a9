"""Decoder-only language model: token + learned position embedding, causal trunk, LM head.

The trunk is the additive stack, or the concatenation stream of `dsjax.models.concat` when the plan asks
for one (then the embeddings have the stream's first width and the head reads its last).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.models import layers
from dsjax.models.concat import embedding_and_head_widths, make_trunk
from dsjax.models.partitioning import constrain_batch
from dsjax.models.plan import InitPlan
from dsjax.models.transformer import Probe, TransformerConfig, no_probe


class GPT(nnx.Module):
  def __init__(
    self,
    cfg: TransformerConfig,
    plan: InitPlan,
    *,
    vocab_size: int,
    max_len: int,
    tie_embeddings: bool,
    rngs: nnx.Rngs,
  ):
    d, head_width = embedding_and_head_widths(cfg, plan)
    lr = plan.lr_scale
    if tie_embeddings and head_width != d:
      raise ValueError(
        f'model.tie_embeddings needs the head to read the embedding width ({d}), but the '
        f'residual stream ends at width {head_width}'
      )
    self.token_embed = layers.param(
      layers.init_weight(rngs.params(), (vocab_size, d), plan.input_std, plan.distribution),
      ('vocab', 'embed'),
      lr.get('input', 1.0),
    )
    self.pos_embedding = layers.param(
      layers.init_weight(rngs.params(), (max_len, d), plan.pos_std, plan.distribution),
      (None, 'embed'),
      lr.get('pos', 1.0),
    )
    self.trunk = make_trunk(cfg, plan, rngs=rngs)
    self.dtype, self.matmul_cast = cfg.dtype, cfg.matmul_cast
    self.head = (
      None
      if tie_embeddings
      else layers.Dense(
        head_width,
        vocab_size,
        std=0.0 if plan.zero_head else plan.head_std,
        distribution=plan.distribution,
        use_bias=False,
        axes=('embed', 'vocab'),
        lr_scale=lr.get('head', 1.0),
        rngs=rngs,
        input_cast=cfg.matmul_cast,
      )
    )

  def embed(self, tokens_BL: jax.Array) -> jax.Array:
    """Token plus position embedding; with `model.matmul_cast` both tables are read as cast to it (the
    lookup picks entries, so this is the table stored in that format)."""
    token_VD = layers.direct_cast(self.token_embed[...], self.matmul_cast)
    pos_LD = layers.direct_cast(self.pos_embedding[...][: tokens_BL.shape[1]], self.matmul_cast)
    return token_VD[tokens_BL] + pos_LD

  def __call__(
    self, tokens_BL: jax.Array, *, dropout_key: jax.Array | None = None, probe: Probe = no_probe
  ) -> jax.Array:
    """Next-token logits (B, L, vocab), float32: the head's matmul runs in the compute dtype and
    writes float32, so the loss's softmax sees logits that were never rounded to bfloat16."""
    x_BLD = self.trunk(self.embed(tokens_BL), dropout_key, probe).astype(self.dtype)
    if self.head is None:
      embed_DV = self.token_embed[...].astype(self.dtype).T
      logits_BLV = layers.cast_matmul(x_BLD, embed_DV, self.matmul_cast, jnp.float32)
    else:
      logits_BLV = self.head(x_BLD, out_dtype=jnp.float32)
    return constrain_batch(logits_BLV)
