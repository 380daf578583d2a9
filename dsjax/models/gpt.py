"""Decoder-only language model: token + learned position embedding, causal trunk, LM head."""

from __future__ import annotations

import jax
from flax import nnx

from dsjax.models import layers
from dsjax.models.transformer import Probe, TransformerConfig, Trunk, no_probe
from dsjax.models.plan import InitPlan


class GPT(nnx.Module):

  def __init__(self, cfg: TransformerConfig, plan: InitPlan, *, vocab_size: int, max_len: int,
               tie_embeddings: bool, rngs: nnx.Rngs):
    d, lr = cfg.width, plan.lr_scale
    self.token_embed = layers.param(layers.init_weight(rngs.params(), (vocab_size, d), plan.input_std,
                                                       plan.distribution), ('vocab', 'embed'),
                                    lr.get('input', 1.0))
    self.pos_embedding = layers.param(layers.init_weight(rngs.params(), (max_len, d), plan.pos_std,
                                                         plan.distribution), (None, 'embed'),
                                      lr.get('pos', 1.0))
    self.trunk = Trunk(cfg, plan.layer, output_scale=plan.output_scale, rngs=rngs)
    self.head = None if tie_embeddings else layers.Dense(
        d, vocab_size, std=0.0 if plan.zero_head else plan.head_std, distribution=plan.distribution,
        use_bias=False, axes=('embed', 'vocab'), lr_scale=lr.get('head', 1.0), rngs=rngs)

  def embed(self, tokens_BL: jax.Array) -> jax.Array:
    return self.token_embed[...][tokens_BL] + self.pos_embedding[...][:tokens_BL.shape[1]]

  def __call__(self, tokens_BL: jax.Array, *, dropout_key: jax.Array | None = None,
               probe: Probe = no_probe) -> jax.Array:
    """Next-token logits (B, L, vocab)."""
    x_BLD = self.trunk(self.embed(tokens_BL), dropout_key, probe)
    if self.head is None:
      return x_BLD @ self.token_embed[...].T
    return self.head(x_BLD)
