"""The concatenation residual stream (Catformer: Davis et al. 2021, "Catformer: Designing Stable
Transformers via Sensitivity Analysis", ICML 2021, Fig. 4 and Appendix D.1).

Instead of adding a module's output to the stream, every module appends it:

    x_0     = embedded tokens (width w_0)
    x_{i+1} = concat[x_i, Drop(MidNorm(F_i(PreNorm(x_i))))]                 width w_{i+1} = w_i + g

with F_i attention for even i and the FFN for odd i (a layer is one attention and one FFN module, as in
the additive stack), g the growth (`ConcatPlan.growth`, the paper's d), so layer n's attention module
reads width w_{2n} and its FFN module w_{2n+1}. The final norm (when the layout has one), the output
scale and the head act on the last width w_{2N}. Each attention module projects its input to q, k, v of
width `ConcatPlan.attn_width` (the paper's a·d) and back to g; each FFN module to `ffn_hidden` (e·d) and
back to g.

Every module has its own input width, so the layers cannot be stacked and scanned like
`transformer.LayerStack`: `ConcatTrunk` holds a list of distinct `ConcatLayer`s and runs them in a
Python loop (trace and compile time grow with depth), each module under `jax.checkpoint` when
`model.remat` asks for it. Norm layout: pre-module norms, mid norms, QKNorm, input norm and final norm
follow the plan's layout; a norm after the residual (Post-LN) has no meaning for a concatenation and is
refused. The plan's residual scales λ, β are not used (there is no addition).

Probes: 'embedding' (layer −1) and, per layer n, 'attn_branch' / 'ffn_branch' (the g new features of
the module) and 'attn_residual' / 'ffn_residual' (the whole stream after the append, widths w_{2n+1} and
w_{2n+2}). Each site is visited once per layer as the probe contract asks (per-site statistics are
scalars), but the residual sites do not have a fixed width across layers, and the parameters live at
trunk/layers/<n>/... as one subtree per layer, not stacked on a leading depth axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.models import layers
from dsjax.models.partitioning import constrain_batch
from dsjax.models.plan import WEIGHT_KEYS, ConcatPlan, InitPlan
from dsjax.models.transformer import Probe, TransformerConfig, Trunk, apply_remat, attention, no_probe


def check_concat_plan(concat: ConcatPlan, depth: int, num_heads: int) -> None:
  """The stream widths a ConcatTrunk of `depth` layers needs: 2·depth + 1 of them, growing by `growth`."""
  widths = tuple(concat.stream_widths)
  if len(widths) != 2 * depth + 1:
    raise ValueError(
      f'ConcatPlan.stream_widths needs 2·depth + 1 = {2 * depth + 1} entries, got {len(widths)}'
    )
  if concat.growth < 1 or any(b - a != concat.growth for a, b in zip(widths, widths[1:])) or widths[0] < 1:
    raise ValueError(
      f'ConcatPlan.stream_widths must start positive and grow by growth={concat.growth} '
      f'per module, got {widths}'
    )
  if concat.attn_width % num_heads:
    raise ValueError(
      f'ConcatPlan.attn_width ({concat.attn_width}) must be divisible by model.num_heads ({num_heads})'
    )


def embedding_and_head_widths(cfg: TransformerConfig, plan: InitPlan) -> tuple[int, int]:
  """Width of the embedded input and of the final hidden state the head reads."""
  if plan.concat is None:
    return cfg.width, cfg.width
  return plan.concat.stream_widths[0], plan.concat.stream_widths[-1]


class ConcatLayer(nnx.Module):
  """Layer n of a concatenation stream: an attention module, then an FFN module, each appending
  `growth` features. `layer_init` holds this layer's initial standard deviations (floats)."""

  def __init__(
    self, cfg: TransformerConfig, concat: ConcatPlan, n: int, layer_init: dict[str, Any], *, rngs: nnx.Rngs
  ):
    lay = cfg.layout
    w_attn, w_ffn, g = concat.stream_widths[2 * n], concat.stream_widths[2 * n + 1], concat.growth
    norm = lambda enabled, dim: layers.make_norm(enabled, dim, cfg.norm, cfg.norm_eps)
    lr_scale = dict(cfg.lr_scale)
    self.dropout, self.dtype = cfg.dropout, cfg.dtype
    self.pre_attn_norm, self.mid_attn_norm = norm(lay.pre_attn, w_attn), norm(lay.mid_attn, g)
    self.attn = attention(
      cfg, w_attn, layer_init, lay.qk_norm, lr_scale, rngs, inner_width=concat.attn_width, out_width=g
    )
    self.pre_ffn_norm, self.mid_ffn_norm = norm(lay.pre_ffn, w_ffn), norm(lay.mid_ffn, g)
    self.ffn = layers.FFN(
      w_ffn,
      concat.ffn_hidden,
      activation=cfg.activation,
      stds=layer_init,
      distribution=cfg.distribution,
      use_bias=cfg.use_bias,
      lr_scale=lr_scale,
      out_width=g,
      fused_gelu=cfg.fused_ops == 'pallas',
      matmul_cast=cfg.matmul_cast,
      rngs=rngs,
    )

  def attention_module(
    self, x_BLW: jax.Array, keys: tuple[Any, Any], *, layer: jax.Array, probe: Probe = no_probe
  ) -> jax.Array:
    """x ← concat[x, Drop(MidNorm(Attention(PreNorm(x))))]; keys: (attention probabilities, output)."""
    h_BLG = self.attn(layers.apply_norm(self.pre_attn_norm, x_BLW).astype(self.dtype), keys[0])
    h_BLG = layers.dropout(layers.apply_norm(self.mid_attn_norm, h_BLG), self.dropout, keys[1])
    h_BLG = probe('attn_branch', constrain_batch(h_BLG), layer)
    return probe('attn_residual', constrain_batch(jnp.concatenate([x_BLW, h_BLG], axis=-1)), layer)

  def ffn_module(self, x_BLW: jax.Array, key: Any, *, layer: jax.Array, probe: Probe = no_probe) -> jax.Array:
    """x ← concat[x, Drop(MidNorm(FFN(PreNorm(x))))]."""
    h_BLG = self.ffn(layers.apply_norm(self.pre_ffn_norm, x_BLW).astype(self.dtype))
    h_BLG = layers.dropout(layers.apply_norm(self.mid_ffn_norm, h_BLG), self.dropout, key)
    h_BLG = probe('ffn_branch', constrain_batch(h_BLG), layer)
    return probe('ffn_residual', constrain_batch(jnp.concatenate([x_BLW, h_BLG], axis=-1)), layer)


class ConcatTrunk(nnx.Module):
  """Embedded tokens (width w_0) in, final hidden states (width w_{2N}) out: embedding dropout,
  InputNorm, the concatenating layers, final norm, output scale (module docstring)."""

  def __init__(
    self,
    cfg: TransformerConfig,
    layer_init: dict[str, Any],
    concat: ConcatPlan,
    *,
    output_scale: float,
    rngs: nnx.Rngs,
  ):
    """`layer_init[name]` has shape (depth,): layer n is built from entry n of each array."""
    if cfg.layout.post:
      raise ValueError(
        'a concatenation residual has no Post-LN form (norm after the residual); use a '
        'layout without post norms (model.block=preln)'
      )
    check_concat_plan(concat, cfg.depth, cfg.num_heads)
    self.dropout, self.remat, self.depth = cfg.dropout, cfg.remat, cfg.depth
    widths = concat.stream_widths
    self.input_norm = layers.make_norm(cfg.layout.input_norm, widths[0], cfg.norm, cfg.norm_eps)
    self.layers = nnx.List(
      [
        ConcatLayer(cfg, concat, n, {k: float(layer_init[k][n]) for k in WEIGHT_KEYS}, rngs=rngs)
        for n in range(cfg.depth)
      ]
    )
    self.final_norm = layers.make_norm(cfg.layout.final_norm, widths[-1], cfg.norm, cfg.norm_eps)
    self.output_scale = layers.constant(jnp.asarray(output_scale, jnp.float32), ())

  def __call__(self, x_BLW: jax.Array, dropout_key: jax.Array | None, probe: Probe = no_probe) -> jax.Array:
    embed_key, stack_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    x_BLW = layers.dropout(x_BLW.astype(jnp.float32), self.dropout, embed_key)  # a float32 stream
    x_BLW = probe('embedding', constrain_batch(layers.apply_norm(self.input_norm, x_BLW)), jnp.asarray(-1))
    layer_keys = None if stack_key is None else jax.random.split(stack_key, self.depth)
    for n, layer in enumerate(self.layers):
      keys = [None] * 3 if layer_keys is None else list(jax.random.split(layer_keys[n], 3))
      # Each module is a pure function of (stream, layer parameters, keys), so `jax.checkpoint` can
      # wrap it (per-module remat).
      graphdef, state = nnx.split(layer)
      index = jnp.asarray(n)

      def attention(x, state, keys, graphdef=graphdef, index=index):
        return nnx.merge(graphdef, state).attention_module(x, keys, layer=index, probe=probe)

      def ffn(x, state, key, graphdef=graphdef, index=index):
        return nnx.merge(graphdef, state).ffn_module(x, key, layer=index, probe=probe)

      x_BLW = apply_remat(attention, self.remat)(x_BLW, state, (keys[0], keys[1]))
      x_BLW = apply_remat(ffn, self.remat)(x_BLW, state, keys[2])
    return layers.apply_norm(self.final_norm, x_BLW) * self.output_scale[...]


def make_trunk(cfg: TransformerConfig, plan: InitPlan, *, rngs: nnx.Rngs) -> Trunk | ConcatTrunk:
  """The additive `Trunk`, or a `ConcatTrunk` when the plan asks for a concatenation residual."""
  if plan.concat is None:
    return Trunk(cfg, plan.layer, output_scale=plan.output_scale, rngs=rngs)
  return ConcatTrunk(cfg, plan.layer, plan.concat, output_scale=plan.output_scale, rngs=rngs)
