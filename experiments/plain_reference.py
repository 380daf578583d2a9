r"""dsjax's GPT written out again in plain `jnp`, differentiated by `jax.grad` alone: an independent check.

The forward pass of `dsjax.models.gpt.GPT` — token and position embedding, embedding dropout, the Pre-LN or
Post-LN stack (`dsjax.models.transformer.Block`: x ← Norm(λ·x + β·Drop(f(x))), x ← λ·x + β·Drop(f(Norm(x)))),
final norm, output scale, head (its own or the token embedding's transpose) — and the next-token
cross-entropy of `dsjax.train.step.lm_loss`, written from their definitions with none of the project's
code on the path: no `custom_jvp` / `custom_vjp` anywhere (dsjax's dense layers and its 'xla' attention
have their own derivative rules; `jax.nn.softmax` and `jax.nn.relu` have JAX's), no dsjax attention
implementation, softmax and log-softmax as exp / sum.
The parameters are dsjax's own, read out of the model's nnx state (`reference_tree`), and so are the
dropout masks: `dropout_masks` draws them from the same key in the same order as the model does, so a
model and its reference compute the same function of the same numbers.

`dtype` runs it in float32 (dsjax's precision) or float64 (with `jax_enable_x64`), to see what float32
rounding does to a statistic. Layers run under `jax.lax.scan` with `jax.checkpoint` (recomputation, not a
derivative rule), so a 192-layer backward pass keeps only each layer's input.

What it covers: LayerNorm and RMSNorm; every norm placement of `dsjax.models.plan.NormLayout` — Pre-LN,
Post-LN, and DNT's InputNorm, PreNorm, MidNorm and QKNorm (Qi et al. 2025, arXiv:2507.17501, §3), so
the settings S1–S5 —; learned positions, ReLU / exact GeLU, dense layers with or without biases, dropout
on the embedding and both branch outputs, untied or tied embeddings, `model.matmul_cast`.
`reference_spec` refuses a model with anything else (attention dropout, a warmed-up logit scale,
identity-mixed attention, a concatenation trunk).
tests/test_plain_reference.py checks loss and every parameter gradient against dsjax's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Spec:
  """What the reference needs to know about the model besides its arrays."""

  depth: int
  width: int
  num_heads: int
  activation: str  # 'relu' | 'gelu'
  dropout: float
  eps: float
  causal: bool
  logit_scale: float
  norm: str  # 'layernorm' | 'rmsnorm', every norm of the model
  input_norm: bool  # after the embedding (DNT's InputNorm)
  pre_attn: bool  # before the attention branch (Pre-LN; DNT's PreNorm)
  pre_ffn: bool  # before the FFN branch
  qk_norm: bool  # on each head's queries and keys, gain shared across heads (DNT's QKNorm)
  mid_attn: bool  # on the attention branch's output, before its dropout (DNT's MidNorm)
  mid_ffn: bool  # on the FFN branch's output
  post_norm: bool  # Post-LN: a norm after each residual add
  final_norm: bool  # after the stack, before the head
  tied: bool  # the head is the token embedding's transpose
  matmul_cast: str = 'none'  # every weight matmul's inputs rounded to this format first (`_rounded`)


def reference_spec(model: nnx.Module) -> Spec:
  """Reads the stack's configuration from a dsjax GPT; raises for what the reference does not implement."""
  cfg = model.trunk.stack.layers.cfg
  attn = model.trunk.stack.layers.attn
  lay = cfg.layout
  unsupported = {
    'attention dropout': cfg.attn_dropout > 0,
    'a warmed-up logit scale': attn.logit_factor is not None,
    'a norm other than LayerNorm or RMSNorm': cfg.norm not in ('layernorm', 'rmsnorm'),
    'identity-mixed attention': cfg.attn_identity,
    'an activation other than relu or gelu': cfg.activation not in ('relu', 'gelu'),
  }
  missing = [name for name, present in unsupported.items() if present]
  if missing:
    raise ValueError(f'the plain reference does not implement: {", ".join(missing)}')
  return Spec(
    depth=cfg.depth,
    width=cfg.width,
    num_heads=cfg.num_heads,
    activation=cfg.activation,
    dropout=float(cfg.dropout),
    eps=float(cfg.norm_eps),
    causal=bool(attn.causal),
    logit_scale=float(attn.logit_scale),
    norm=cfg.norm,
    input_norm=lay.input_norm,
    pre_attn=lay.pre_attn,
    pre_ffn=lay.pre_ffn,
    qk_norm=lay.qk_norm,
    mid_attn=lay.mid_attn,
    mid_ffn=lay.mid_ffn,
    post_norm=lay.post,
    final_norm=lay.final_norm,
    tied=model.head is None,
    matmul_cast=cfg.matmul_cast,
  )


def reference_tree(model: nnx.Module) -> dict[str, Any]:
  """Every array of the model (parameters and constants such as λ, β) as a nested dict of numpy arrays,
  keyed as in the model's nnx state ('token_embed', 'trunk' → 'stack' → 'layers' → 'attn' → 'q' → …)."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def split_model(model: nnx.Module) -> tuple[dict[str, Any], dict[str, Any]]:
  """(the trainable parameters, the constants such as λ, β and the output scale) of a dsjax model, as
  nested dicts of jnp arrays: what an independent training loop differentiates, and what it keeps."""
  as_jnp = lambda state: jax.tree.map(jnp.asarray, nnx.to_pure_dict(state))  # noqa: E731
  return as_jnp(nnx.state(model, nnx.Param)), as_jnp(nnx.state(model, nnx.Not(nnx.Param)))


def merge(params: dict[str, Any], constants: dict[str, Any]) -> dict[str, Any]:
  """`split_model`'s two trees as one, the tree `reference_tree` gives (nested dicts merged key by key)."""
  tree = dict(params)
  for key, value in constants.items():
    tree[key] = merge(tree[key], value) if key in tree and isinstance(value, dict) else value
  return tree


def dropout_masks(spec: Spec, dropout_key: jax.Array | None, batch: int, seq_len: int) -> dict | None:
  """The keep-masks of the model's dropouts for `dropout_key`, drawn as dsjax draws them: the key is split
  into (embedding, stack), the stack key into one per layer, each layer's into three (attention
  probabilities — unused without attention dropout —, attention branch, FFN branch). None: no dropout.
  The keep probability is passed as float32, so the draws are the same with `jax_enable_x64`."""
  if dropout_key is None or spec.dropout == 0.0:
    return None
  shape = (batch, seq_len, spec.width)
  keep = jnp.float32(1.0 - spec.dropout)
  embed_key, stack_key = jax.random.split(dropout_key)

  def layer_masks(layer_key):
    keys = jax.random.split(layer_key, 3)
    return jnp.stack([jax.random.bernoulli(keys[i], keep, shape) for i in (1, 2)])

  return {
    'embedding': jax.random.bernoulli(embed_key, keep, shape),
    'layers': jax.vmap(layer_masks)(jax.random.split(stack_key, spec.depth)),  # (N, 2, B, L, D)
  }


def _norm(x, p, spec: Spec):
  """LayerNorm ((x − mean) / sqrt(var + eps) · scale + bias) or RMSNorm (x / sqrt(mean(x²) + eps) · scale)
  over the last axis."""
  if spec.norm == 'layernorm':
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + spec.eps) * p['scale'] + p['bias']
  return x / jnp.sqrt((x * x).mean(-1, keepdims=True) + spec.eps) * p['scale']


def _rounded(t, spec: Spec):
  """t rounded to `spec.matmul_cast` and back, unscaled; the gradient passes unrounded, as if the cast
  were the identity (written here as t + stop_gradient(rounded − t): no derivative rule)."""
  if spec.matmul_cast == 'none':
    return t
  return t + jax.lax.stop_gradient(t.astype(spec.matmul_cast).astype(t.dtype) - t)


def _dense(x, p, spec: Spec):
  y = jnp.einsum('...i,io->...o', _rounded(x, spec), _rounded(p['kernel'], spec), precision='highest')
  return y + p['bias'] if 'bias' in p else y


def _softmax(z, mask):
  """exp(z − max) / Σ exp(z − max) over the last axis, entries where `mask` is False excluded."""
  z_max = jax.lax.stop_gradient(jnp.max(jnp.where(mask, z, -jnp.inf), axis=-1, keepdims=True))
  e = jnp.where(mask, jnp.exp(jnp.where(mask, z, 0.0) - z_max), 0.0)
  return e / e.sum(-1, keepdims=True)


def _attention(x_BLD, p, spec: Spec):
  b, l, d = x_BLD.shape
  heads = lambda t: t.reshape(b, l, spec.num_heads, d // spec.num_heads)  # noqa: E731
  q, k, v = (heads(_dense(x_BLD, p[name], spec)) for name in ('q', 'k', 'v'))
  if spec.qk_norm:
    q, k = _norm(q, p['q_norm'], spec), _norm(k, p['k_norm'], spec)
  logits_BHQT = spec.logit_scale * jnp.einsum('bqhk,bthk->bhqt', q, k, precision='highest')
  mask_QT = jnp.tril(jnp.ones((l, l), bool)) if spec.causal else jnp.ones((l, l), bool)
  probs_BHQT = _softmax(logits_BHQT, mask_QT)
  out_BLHK = jnp.einsum('bhqt,bthk->bqhk', probs_BHQT, v, precision='highest')
  return _dense(out_BLHK.reshape(b, l, d), p['o'], spec)


def _activation(h, name):
  if name == 'relu':
    return jnp.where(h > 0, h, 0.0)
  return 0.5 * h * (1.0 + jax.lax.erf(h / np.sqrt(2.0).astype(h.dtype)))


def _dropout(x, keep, rate):
  return x if keep is None else jnp.where(keep, x / (1.0 - rate), 0.0)


def _block(x_BLD, p, keep_2BLD, spec: Spec):
  """One layer: attention add, then FFN add, in the layout of `dsjax.models.transformer.Block`."""
  return _block_with_terms(x_BLD, p, keep_2BLD, spec)[0]


def _block_with_terms(x_BLD, p, keep_2BLD, spec: Spec):
  """The layer's output, and for each of its two residual adds (attention's, then the FFN's) the terms
  of the sum λ·x + β·h that a Post-LN norm normalises: (λ, x_BLD, β, h_BLD), x the stream entering the
  add (the skip) and h the branch's output after its dropout."""
  keep = (None, None) if keep_2BLD is None else (keep_2BLD[0], keep_2BLD[1])
  skip_ffn = p.get('skip_ffn', p['skip_attn'])
  branch_ffn = p.get('branch_ffn', p['branch_attn'])
  norm = lambda name, t, on: _norm(t, p[name], spec) if on else t  # noqa: E731

  h = _attention(norm('pre_attn_norm', x_BLD, spec.pre_attn), p['attn'], spec)
  h = _dropout(norm('mid_attn_norm', h, spec.mid_attn), keep[0], spec.dropout)
  attn_terms = (p['skip_attn'], x_BLD, p['branch_attn'], h)
  x_BLD = norm('post_attn_norm', _residual_sum(*attn_terms), spec.post_norm)
  ffn_in = norm('pre_ffn_norm', x_BLD, spec.pre_ffn)
  h = _dense(_activation(_dense(ffn_in, p['ffn']['ffn1'], spec), spec.activation), p['ffn']['ffn2'], spec)
  h = _dropout(norm('mid_ffn_norm', h, spec.mid_ffn), keep[1], spec.dropout)
  ffn_terms = (skip_ffn, x_BLD, branch_ffn, h)
  return norm('post_ffn_norm', _residual_sum(*ffn_terms), spec.post_norm), attn_terms, ffn_terms


def _residual_sum(skip, x_BLD, branch, h_BLD):
  return skip * x_BLD + branch * h_BLD


def _sum_parts(skip, x_BLD, branch, h_BLD) -> jax.Array:
  """The variance over the hidden units of λ·x + β·h, averaged over tokens, split into its parts
  (`SUM_PARTS`): λ²·Var(x), β²·Var(h) and 2λβ·Cov(x, h), the covariance split by writing each token's
  vector (centred over the hidden units) as its sequence's mean over tokens plus the token's deviation
  from it — the part all tokens share and the token's own; the cross terms of the two average to zero
  over a sequence. Also the shared part's fraction of Var(x) and of Var(h)."""
  x_BLD = x_BLD - x_BLD.mean(-1, keepdims=True)
  h_BLD = h_BLD - h_BLD.mean(-1, keepdims=True)
  x_shared_B1D, h_shared_B1D = x_BLD.mean(1, keepdims=True), h_BLD.mean(1, keepdims=True)
  mean_product = lambda a, b: (a * b).mean(-1).mean()  # noqa: E731  (per token, then over tokens)
  var_x, var_h = mean_product(x_BLD, x_BLD), mean_product(h_BLD, h_BLD)
  cross_shared = mean_product(x_shared_B1D, h_shared_B1D)
  cross_own = mean_product(x_BLD - x_shared_B1D, h_BLD - h_shared_B1D)
  return jnp.stack(
    [
      skip**2 * var_x,
      branch**2 * var_h,
      2 * skip * branch * cross_shared,
      2 * skip * branch * cross_own,
      mean_product(x_shared_B1D, x_shared_B1D) / var_x,
      mean_product(h_shared_B1D, h_shared_B1D) / var_h,
    ]
  )


SUM_PARTS = (
  'skip_var',
  'branch_var',
  'cross_shared',
  'cross_own',
  'skip_shared_fraction',
  'branch_shared_fraction',
)


def _embed(tree, tokens_BL, spec: Spec, masks):
  """Token and position embedding, its dropout, and the InputNorm where there is one."""
  token_VD, pos_LD = tree['token_embed'], tree['pos_embedding'][: tokens_BL.shape[1]]
  x_BLD = _rounded(token_VD, spec)[tokens_BL] + _rounded(pos_LD, spec)
  x_BLD = _dropout(x_BLD, None if masks is None else masks['embedding'], spec.dropout)
  if spec.input_norm:
    x_BLD = _norm(x_BLD, tree['trunk']['input_norm'], spec)
  return x_BLD


def logits(tree, tokens_BL, spec: Spec, masks=None, deltas_NBLD=None):
  """Next-token logits (B, L, vocab) in the dtype of `tree`'s arrays. `deltas_NBLD`: added to each layer's
  output (the residual stream entering the next layer), so that the gradient with respect to them is the
  gradient with respect to the layer outputs."""
  x_BLD = _embed(tree, tokens_BL, spec, masks)
  layer_masks = None if masks is None else masks['layers']
  deltas = jnp.zeros((spec.depth,), x_BLD.dtype) if deltas_NBLD is None else deltas_NBLD

  @jax.checkpoint
  def layer(x_BLD, xs):
    p, keep, delta = xs
    return _block(x_BLD, p, keep, spec) + delta, None

  x_BLD, _ = jax.lax.scan(layer, x_BLD, (tree['trunk']['stack']['layers'], layer_masks, deltas))
  if spec.final_norm:
    x_BLD = _norm(x_BLD, tree['trunk']['final_norm'], spec)
  x_BLD = x_BLD * tree['trunk']['output_scale']
  head_DV = tree['token_embed'].T if spec.tied else tree['head']['kernel']
  return jnp.einsum('bld,dv->blv', _rounded(x_BLD, spec), _rounded(head_DV, spec), precision='highest')


def layer_outputs(tree, tokens_BL, spec: Spec, masks=None) -> tuple[jax.Array, jax.Array]:
  """The output of every layer (the residual stream entering the next one), (N, B, L, D), and the
  variance over the hidden units of the two residual sums each layer adds (what a Post-LN layer's norms
  divide by), averaged over tokens: (N, 2), attention's then the FFN's."""
  outputs_NBLD, sum_vars_N2, _ = layer_outputs_and_sums(tree, tokens_BL, spec, masks)
  return outputs_NBLD, sum_vars_N2


def residual_sum_parts(tree, tokens_BL, spec: Spec, masks=None) -> jax.Array:
  """(N, 2, len(SUM_PARTS)): each layer's two residual sums (attention's, the FFN's) split by `_sum_parts`;
  the first four parts add up to the sum's variance that `layer_outputs` returns."""
  return layer_outputs_and_sums(tree, tokens_BL, spec, masks)[2]


def layer_outputs_and_sums(tree, tokens_BL, spec: Spec, masks=None):
  """In one pass over the layers: `layer_outputs`' two arrays and `residual_sum_parts`' array."""
  x_BLD = _embed(tree, tokens_BL, spec, masks)
  layer_masks = None if masks is None else masks['layers']

  def layer(x_BLD, xs):
    p, keep = xs
    x_BLD, *terms = _block_with_terms(x_BLD, p, keep, spec)
    sum_vars = jnp.stack([_residual_sum(*t).var(-1).mean() for t in terms])
    return x_BLD, (x_BLD, sum_vars, jnp.stack([_sum_parts(*t) for t in terms]))

  layers = tree['trunk']['stack']['layers']
  _, (outputs_NBLD, sum_vars_N2, parts_N2P) = jax.lax.scan(layer, x_BLD, (layers, layer_masks))
  return outputs_NBLD, sum_vars_N2, parts_N2P


def loss(tree, tokens_BL1, spec: Spec, masks=None, deltas_NBLD=None):
  """Mean next-token cross-entropy over the batch: the model reads tokens[:, :-1], predicts tokens[:, 1:]."""
  return cross_entropy(logits(tree, tokens_BL1[:, :-1], spec, masks, deltas_NBLD), tokens_BL1[:, 1:])


def token_losses(z_BLV, targets_BL):
  """log Σ exp(z) − z[target] at every position (B, L)."""
  z_max = jax.lax.stop_gradient(z_BLV.max(-1, keepdims=True))
  log_norm_BL = jnp.log(jnp.exp(z_BLV - z_max).sum(-1)) + z_max[..., 0]
  target_BL = jnp.take_along_axis(z_BLV, targets_BL[..., None], axis=-1)[..., 0]
  return log_norm_BL - target_BL


def cross_entropy(z_BLV, targets_BL):
  """Mean of `token_losses` over the positions."""
  return token_losses(z_BLV, targets_BL).mean()


def cast(tree, dtype):
  """`tree`'s floating arrays in `dtype` (float64 needs `jax_enable_x64`)."""
  return jax.tree.map(lambda a: jnp.asarray(a, dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def layer_output_grads(tree, tokens_BL1, spec: Spec, masks=None) -> jax.Array:
  """∂loss/∂(output of layer n) for every layer n: (N, B, L, D), by `jax.grad` with respect to zero
  tensors added to the layer outputs."""
  b, l1 = tokens_BL1.shape
  dtype = tree['token_embed'].dtype
  deltas_NBLD = jnp.zeros((spec.depth, b, l1 - 1, spec.width), dtype)
  return jax.grad(lambda deltas: loss(tree, tokens_BL1, spec, masks, deltas))(deltas_NBLD)
