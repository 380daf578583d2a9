r"""Catformer: the residual by concatenation, with the parameter count matched to the Pre-LN baseline.

Davis, Gu, Choromanski, Dao, Ré, Finn & Liang 2021, "Catformer: Designing Stable Transformers via
Sensitivity Analysis" (ICML 2021), Fig. 4 and Appendix D.1 (widths), Appendix E.1 (a = 2, e = 4).

    x_0 = embedding (width d),   x_{i+1} = concat[x_i, F_i(LN(x_i))]        F_i: attention, FFN, attention, …

so layer n (attention + FFN, n = 0 … N−1) reads width (2n+1)·d at its attention module and (2n+2)·d at
its FFN module, and the head reads (2N+1)·d. Attention module: q, k, v project (2n+1)·d → a·d, the
output projection a·d → d; FFN module: (2n+2)·d → e·d → d (App. D.1). Per layer that is
d²·(a(6n+4) + e(2n+3)) weights, on average d²·(3aN + eN + a + 2e) against (4 + 2r)·w² for a Pre-LN layer
of width w and FFN ratio r (12w² for r = 4). The model is built by `dsjax.models.concat.ConcatTrunk`.

d, the growth (the paper's "embedding dimension", the width each module adds), is chosen so that the
model has the parameter count of the Pre-LN model with the same model.depth, model.width and
model.mlp_ratio (`model.catformer.match`):
  * 'total' (default): the d ≥ 1 whose whole model — embeddings, every block matrix, bias and norm, the
    final norm and the head — has the parameter count closest to the Pre-LN model's. App. D.1 counts
    the block matrices only; at the paper's sizes the rest is small, but at ours the head, which reads
    the (2N+1)·d-wide stream, is not (a 4-layer byte-level GPT of width 128, sequence length 256, has
    7–11% more parameters than its baseline at App. D.1's d = 62–63), so we count everything. One step
    of d changes the count by about 2/d of itself, so the match is within about 1/d.
  * 'paper': App. D.1's closed form d = w·sqrt((4 + 2r)/(3aN + eN + a + 2e)) rounded down to a multiple
    of 8; this reproduces the paper's d = 320, 248, 208 for w = 512, r = 4, N = 2, 4, 6 (App. E.1).

What the paper leaves open, and our choices:
  * Heads: model.num_heads heads share the a·d attention width; when num_heads does not divide a·d,
    the attention width is a·d rounded to the nearest multiple of num_heads (d itself is left free so
    that the parameter match stays fine-grained). ViT with sincos2d position embeddings needs d to be a
    multiple of 4; d is searched among those.
  * Norms: Pre-LN inside every module (as in the definition above) and a final norm over the last width
    before the head, like the Pre-LN baseline. Post-LN has no concatenation form, so only
    model.block='preln' is accepted.
  * Initialisation: the paper does not give one; every matrix is Xavier (Glorot & Bengio 2010) for its
    own fan-in and fan-out, as the vanilla baseline, embeddings Xavier for width d, the head for
    (2N+1)·d. Biases 0, norm gains 1. Dropout acts on each module's output before it is appended.
  * Tied embeddings are impossible (the head reads a wider stream than the token table) and refused.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from dsjax.models.config import one_of, positive_int
from dsjax.models.plan import ConcatPlan, InitPlan, ModelDims, per_layer, unit_scales, xavier_std
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan

MATCHES = ('total', 'paper')
PAPER_MULTIPLE = 8  # App. E.1's widths 320, 248, 208 are App. D.1's closed form rounded down to this


def _norm_params(m, width: int) -> int:
  return (2 if m.norm == 'layernorm' else 1) * width


def _dense_params(m, d_in: int, d_out: int) -> int:
  return d_in * d_out + (d_out if m.use_bias else 0)


def _outside_params(m, dims: ModelDims, embed_width: int, head_width: int) -> int:
  """Embeddings and head: the parameters outside the blocks and norms (dsjax.models.gpt / .vit)."""
  if dims.kind == 'gpt':
    count = (dims.input_dim + dims.seq_len) * embed_width  # token and position tables
    return count + (0 if m.tie_embeddings else head_width * dims.num_outputs)  # head without bias
  cls = m.pooling == 'cls'
  count = dims.input_dim * embed_width + embed_width  # patch embedding with bias
  if m.pos_embedding == 'learned':
    count += (dims.seq_len - cls) * embed_width
  count += embed_width if cls else 0
  return count + head_width * dims.num_outputs + dims.num_outputs  # classifier with bias


def preln_param_count(m, dims: ModelDims) -> int:
  """Parameters of the Pre-LN model of width w = model.width (the baseline to match)."""
  w, f = dims.width, dims.mlp_hidden
  layer = (
    4 * _dense_params(m, w, w) + _dense_params(m, w, f) + _dense_params(m, f, w) + 2 * _norm_params(m, w)
  )
  return dims.depth * layer + _norm_params(m, w) + _outside_params(m, dims, w, w)


def attn_width(m, dims: ModelDims, growth: int) -> int:
  """a·d, rounded to the nearest multiple of model.num_heads (at least one head dimension each)."""
  h = dims.num_heads
  return h * max(1, math.floor(m.catformer.attn_expansion * growth / h + 0.5))


def concat_plan(m, dims: ModelDims, growth: int) -> ConcatPlan:
  n = dims.depth
  return ConcatPlan(
    growth=growth,
    attn_width=attn_width(m, dims, growth),
    ffn_hidden=m.catformer.ffn_expansion * growth,
    stream_widths=tuple((k + 1) * growth for k in range(2 * n + 1)),
  )


def catformer_param_count(m, dims: ModelDims, growth: int) -> int:
  """Parameters of the Catformer with growth d (module docstring), in closed form over the layers."""
  n, d = dims.depth, growth
  c = concat_plan(m, dims, growth)
  a, f = c.attn_width, c.ffn_hidden
  attn_in = d * n * n  # Σ_n (2n+1)·d: the attention modules' input widths
  ffn_in = d * n * (n + 1)  # Σ_n (2n+2)·d: the FFN modules' input widths
  bias = 1 if m.use_bias else 0
  norm = 2 if m.norm == 'layernorm' else 1
  attention = 3 * (a * attn_in + bias * a * n) + n * _dense_params(m, a, d) + norm * attn_in
  ffn = f * ffn_in + bias * f * n + n * _dense_params(m, f, d) + norm * ffn_in
  return (
    attention
    + ffn
    + _norm_params(m, c.stream_widths[-1])
    + _outside_params(m, dims, c.stream_widths[0], c.stream_widths[-1])
  )


def _growth_step(m) -> int:
  return 4 if m.name == 'vit' and m.pos_embedding == 'sincos2d' else 1  # sincos2d needs width % 4 == 0


def paper_growth(m, dims: ModelDims) -> int:
  """App. D.1: d²·(3aN + eN + a + 2e) = (4 + 2r)·w² per layer, d rounded down to a multiple of 8."""
  a, e, n = m.catformer.attn_expansion, m.catformer.ffn_expansion, dims.depth
  exact = dims.width * math.sqrt((4 + 2 * dims.mlp_hidden / dims.width) / (3 * a * n + e * n + a + 2 * e))
  return PAPER_MULTIPLE * math.floor(exact / PAPER_MULTIPLE)


def matched_growth(m, dims: ModelDims) -> int:
  """The growth d of `model.catformer.match` (module docstring)."""
  if m.catformer.match == 'paper':
    d = paper_growth(m, dims)
    if d < 1:
      raise ValueError(
        f"model.catformer.match='paper' gives d = 0 for model.width={dims.width} and "
        f"model.depth={dims.depth} (App. D.1 rounded down to a multiple of 8); use 'total'"
      )
    return d
  target, step = preln_param_count(m, dims), _growth_step(m)
  # The count increases with d: walk up to the first d at or above the target, keep the closer neighbour.
  d = step
  while catformer_param_count(m, dims, d) < target:
    d += step
  if d > step and (
    target - catformer_param_count(m, dims, d - step) <= catformer_param_count(m, dims, d) - target
  ):
    d -= step
  return d


def init_plan(m, dims: ModelDims) -> InitPlan:
  d = matched_growth(m, dims)
  c = concat_plan(m, dims, d)
  n = dims.depth
  attn_in = [c.stream_widths[2 * i] for i in range(n)]
  ffn_in = [c.stream_widths[2 * i + 1] for i in range(n)]
  layer = dict(
    q=per_layer(n, [xavier_std(w, c.attn_width) for w in attn_in]),
    k=per_layer(n, [xavier_std(w, c.attn_width) for w in attn_in]),
    v=per_layer(n, [xavier_std(w, c.attn_width) for w in attn_in]),
    o=per_layer(n, xavier_std(c.attn_width, d)),
    ffn1=per_layer(n, [xavier_std(w, c.ffn_hidden) for w in ffn_in]),
    ffn2=per_layer(n, xavier_std(c.ffn_hidden, d)),
    **unit_scales(n),
  )  # Not used: there is no addition.
  embed_dims = dataclasses.replace(dims, width=d, mlp_hidden=c.ffn_hidden)
  return xavier_plan(
    m, embed_dims, layer=layer, head_std=xavier_std(c.stream_widths[-1], dims.num_outputs), concat=c
  )


class Catformer(Scheme):
  name = 'catformer'
  paper = (
    'Davis et al. 2021, Catformer: Designing Stable Transformers via Sensitivity Analysis '
    '(ICML 2021), App. D.1'
  )
  summary = (
    'residual by concatenation x ← [x, F(LN(x))], the stream growing by d per module; d matches '
    'the Pre-LN parameter count'
  )
  blocks = ('preln',)

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.attn_expansion = 2  # a: q/k/v width a·d (App. D.1; a = 2 in all §5.1–5.2 runs, App. E.1)
    c.ffn_expansion = 4  # e: FFN hidden width e·d (App. D.1; e = 4, as the baseline's ratio)
    c.match = 'total'  # how d is chosen: 'total' (whole-model parameter count of the Pre-LN
    # model) | 'paper' (App. D.1's block-only closed form, multiple of 8)
    return c

  def validate(self, m):
    super().validate(m)
    positive_int('model.catformer.attn_expansion', m.catformer.attn_expansion)
    positive_int('model.catformer.ffn_expansion', m.catformer.ffn_expansion)
    one_of('model.catformer.match', m.catformer.match, MATCHES)
    if m.name == 'gpt' and m.tie_embeddings:
      raise ValueError(
        "model.tie_embeddings must be False with model.scheme='catformer': the head reads "
        'the (2·depth+1)·d-wide concatenated stream, the token table has width d'
      )

  def init_plan(self, m, dims, prepared=None):
    return init_plan(m, dims)


SCHEME = Catformer()
