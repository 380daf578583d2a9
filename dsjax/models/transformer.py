"""The transformer block, parameterised by norm placement and residual scales, and the scanned stack.

One block covers every architecture the project studies:

    Pre-LN  (block='preln'):  x ← λ·x + β·Drop(f(Norm(x)))                       final Norm after the stack
    Post-LN (block='postln'): x ← Norm(λ·x + β·Drop(f(x)))                       no final Norm
    DNT     (block='dnt'):    x ← λ·x + β·Drop(MidNorm(f(PreNorm(x))))           InputNorm before the stack,
                              QKNorm in attention; settings S1–S5 (Qi et al. 2025, §4.4, Fig. 7) pick which.
    no norm (block='nonorm'): x ← λ·x + β·Drop(f(x))                             (T-Fixup, SkipInit, ReZero)

f is attention for the first residual add of a layer and the FFN for the second. λ ("skip scale") and
β ("branch scale") are per-layer, per-add values set by the method's `InitPlan` (`dsjax.models.plan`):
1 and 1 for vanilla models, sqrt(1−k/N) and sqrt(k/N) for DeepScaleLM, a learnable 0 for ReZero. They
are stored in the model — as `Constant`s, or as `nnx.Param`s when the plan makes them learnable; scalars
or width-d vectors; one per add or one per layer — so a checkpoint carries them.

The layers are created with `nnx.vmap` (parameters stacked on a leading `depth` axis) and run with
`jax.lax.scan`, so trace and compile time do not grow with depth (`scan_unroll` puts that many layers in
one scan iteration, `scan_layers=False` runs the same stacked layers in a Python loop: both give XLA
more to fuse and schedule across layers, for the last percent on a GPU); `remat` names a
`jax.checkpoint_policies` policy to trade compute for memory in deep stacks ('dots_saveable' saves
every matmul output and recomputes the rest, 'full' saves only each layer's input).

Precision: the residual stream and every norm's statistics are float32; each branch (attention, FFN)
runs in `dtype` (bfloat16 for speed on GPUs/TPUs), its input cast on entry, and its output joins the
float32 stream by type promotion — the mixed precision of PyTorch autocast. A concatenation residual
(`InitPlan.concat`) replaces the stack by `dsjax.models.concat.ConcatTrunk`, whose modules have distinct
widths and are not scanned.

Fused forms (`fused_ops='pallas'`, `dsjax.models.fused_ops`): a layer's first norm and its cast, the
attention's residual add with the FFN's norm and cast after it (where the layout puts no norm on the
stream between them: Pre-LN, DNT; with the attention's output bias too where no MidNorm or dropout lies
between), and the FFN's bias with its GELU each run as one kernel, computing the math written here. An
instrumented step's probes must see the stream between a residual add and the norm that follows it, which
the residual-norm kernel keeps inside: that step runs the attention's residual add as written and keeps
the norm-and-cast kernels, each fed the stream a probe has seen (the FFN's kernel runs in every step: no
probe looks inside the FFN).

Layout: the stream after the embedding and every branch output and residual add keep their batch axis
on the mesh axes of the logical axis 'batch' (`dsjax.models.partitioning.constrain_batch`; the identity
outside a training run's mesh), before any probe sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.models import fused_ops, layers
from dsjax.models.partitioning import constrain_batch
from dsjax.models.plan import LAYER_INIT_KEYS, NormLayout, ResidualScale

REMAT_POLICIES = (
  'none',
  'full',
  'dots_saveable',
  'dots_with_no_batch_dims_saveable',
  'nothing_saveable',
  'everything_saveable',
)

# A probe sees every instrumented tensor on its way: probe(site, x, layer) -> x. The default does
# nothing; `dsjax.instrument` passes one that records statistics (forward and, through a custom VJP,
# backward). Sites: 'attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual' (= layer output).
Probe = Callable[[str, jax.Array, jax.Array], jax.Array]


def no_probe(site: str, x: jax.Array, layer: jax.Array) -> jax.Array:
  del site, layer
  return x


@dataclasses.dataclass(frozen=True)
class ScannedProbe:
  """A probe that also gets its own arrays in each layer of the stack.

  `per_layer` (a pytree of arrays with leading axis depth) is scanned with the layer parameters, and
  layer n is probed by `in_layer(entry n of per_layer)`; the sites outside the stack (the embedding),
  and layers that are not stacked (`concat.ConcatTrunk`), by the probe itself (`outside`). Why: a value
  that a probe's custom VJP returns as the cotangent of its layer's entry leaves the backward layer
  scan as that layer's output, where the cotangent of an array that the probe closes over is added up
  over the layers (`dsjax.instrument.probe`).
  """

  outside: Probe
  per_layer: Any
  in_layer: Callable[[Any], Probe]

  def __call__(self, site: str, x: jax.Array, layer: jax.Array) -> jax.Array:
    return self.outside(site, x, layer)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Static description of the stack (everything that shapes the graph; no array values)."""

  depth: int
  width: int
  num_heads: int
  mlp_hidden: int
  activation: str = 'gelu'
  dropout: float = 0.0  # embedding and branch outputs
  attn_dropout: float = 0.0  # attention probabilities
  norm: str = 'layernorm'
  norm_eps: float = 1e-6
  layout: NormLayout = NormLayout()
  causal: bool = False
  use_bias: bool = True
  distribution: str = 'normal'  # of every weight's initial draw
  skip_scale: ResidualScale = ResidualScale()
  branch_scale: ResidualScale = ResidualScale()
  attn_logit_scale: float | None = None
  attn_logit_warmup_steps: int = 0  # InitPlan.attn_logit_warmup_steps
  attn_identity: bool = False
  lr_scale: tuple[tuple[str, float], ...] = ()  # (weight type, learning-rate multiplier) pairs
  remat: str = 'none'
  scan_layers: bool = True  # False: a Python loop over the layers (per-layer values can leave it)
  scan_unroll: int = 1  # layers per scan iteration (jax.lax.scan's `unroll`)
  dtype: str = 'float32'  # compute dtype of the branches (the residual stream stays float32)
  attention: str = 'xla'  # attention implementation: 'xla' | 'cudnn' | 'splash' (layers.Attention)
  fused_ops: str = 'none'  # 'none' | 'pallas' (`dsjax.models.fused_ops`; module docstring)
  matmul_cast: str = 'none'  # every weight matmul's inputs rounded to this format (layers.direct_cast)


def _residual_scale(value: Any, how: ResidualScale, width: int) -> nnx.Variable:
  value = jnp.asarray(value, jnp.float32)
  axes: tuple[str | None, ...] = ()
  if how.vector:
    value, axes = jnp.full((width,), value, jnp.float32), (None,)
  return layers.param(value, axes) if how.learnable else layers.constant(value, axes)


def attention(
  cfg: TransformerConfig, width: int, stds, qk_norm: bool, lr_scale, rngs: nnx.Rngs, **widths
) -> layers.Attention:
  """The attention block of a layer as the config and the method's plan set it (one place for both the
  additive and the concatenating layers); `widths`: `inner_width`/`out_width` where they differ."""
  return layers.Attention(
    width,
    cfg.num_heads,
    stds=stds,
    distribution=cfg.distribution,
    use_bias=cfg.use_bias,
    qk_norm=qk_norm,
    norm_kind=cfg.norm,
    norm_eps=cfg.norm_eps,
    causal=cfg.causal,
    attn_dropout=cfg.attn_dropout,
    logit_scale=cfg.attn_logit_scale,
    logit_warmup_steps=cfg.attn_logit_warmup_steps,
    identity_mix=cfg.attn_identity,
    lr_scale=lr_scale,
    implementation=cfg.attention,
    matmul_cast=cfg.matmul_cast,
    rngs=rngs,
    **widths,
  )


class Block(nnx.Module):
  """One layer: the attention residual add followed by the FFN residual add."""

  def __init__(self, cfg: TransformerConfig, layer_init: dict[str, Any], *, rngs: nnx.Rngs):
    self.cfg = cfg
    lay = cfg.layout
    norm = lambda enabled: layers.make_norm(enabled, cfg.width, cfg.norm, cfg.norm_eps)
    self.pre_attn_norm, self.mid_attn_norm = norm(lay.pre_attn), norm(lay.mid_attn)
    self.post_attn_norm = norm(lay.post)
    self.pre_ffn_norm, self.mid_ffn_norm = norm(lay.pre_ffn), norm(lay.mid_ffn)
    self.post_ffn_norm = norm(lay.post)
    lr_scale = dict(cfg.lr_scale)
    self.attn = attention(cfg, cfg.width, layer_init, lay.qk_norm, lr_scale, rngs)
    self.ffn = layers.FFN(
      cfg.width,
      cfg.mlp_hidden,
      activation=cfg.activation,
      stds=layer_init,
      distribution=cfg.distribution,
      use_bias=cfg.use_bias,
      lr_scale=lr_scale,
      fused_gelu=cfg.fused_ops == 'pallas',
      matmul_cast=cfg.matmul_cast,
      rngs=rngs,
    )
    # λ (skip) and β (branch) of both adds; a shared scale is one variable used at both adds.
    skip, branch = cfg.skip_scale, cfg.branch_scale
    self.skip_attn = _residual_scale(layer_init['skip_attn'], skip, cfg.width)
    self.skip_ffn = None if skip.shared else _residual_scale(layer_init['skip_ffn'], skip, cfg.width)
    self.branch_attn = _residual_scale(layer_init['branch_attn'], branch, cfg.width)
    self.branch_ffn = None if branch.shared else _residual_scale(layer_init['branch_ffn'], branch, cfg.width)

  def scales(self) -> dict[str, jax.Array]:
    """The four residual scales λ_attn, β_attn, λ_ffn, β_ffn (a shared one appears twice)."""
    skip_ffn = self.skip_attn if self.skip_ffn is None else self.skip_ffn
    branch_ffn = self.branch_attn if self.branch_ffn is None else self.branch_ffn
    return {
      'skip_attn': self.skip_attn[...],
      'branch_attn': self.branch_attn[...],
      'skip_ffn': skip_ffn[...],
      'branch_ffn': branch_ffn[...],
    }

  def __call__(
    self, x_BLD: jax.Array, dropout_key: jax.Array | None, *, layer: jax.Array, probe: Probe = no_probe
  ) -> jax.Array:
    p = self.cfg.dropout
    keys = [None] * 3 if dropout_key is None else list(jax.random.split(dropout_key, 3))
    scale = self.scales()
    fused = self.cfg.fused_ops == 'pallas'
    fuse_residual_norm = fused and probe is no_probe  # (module docstring)
    fuse_residual_norm &= self.post_attn_norm is None and self.pre_ffn_norm is not None
    # Where nothing lies between the output projection and the add, the kernel adds its bias too.
    bias_in_kernel = fuse_residual_norm and self.mid_attn_norm is None and (p == 0 or keys[1] is None)

    attn_input_BLD = self.branch_input(self.pre_attn_norm, x_BLD, fused)
    h_BLD = self.attn(attn_input_BLD, keys[0], out_bias=not bias_in_kernel)
    h_BLD = layers.dropout(layers.apply_norm(self.mid_attn_norm, h_BLD), p, keys[1])
    h_BLD = probe('attn_branch', constrain_batch(h_BLD), layer)
    if fuse_residual_norm:
      # λ·x + β·h and the FFN's input Norm(λ·x + β·h), as below, in one pass.
      skip, branch = scale['skip_attn'], scale['branch_attn']
      x_BLD, ffn_input_BLD = self.fused_residual_norm(x_BLD, h_BLD, skip, branch, add_out_bias=bias_in_kernel)
    else:
      x_BLD = scale['skip_attn'] * x_BLD + scale['branch_attn'] * h_BLD
      x_BLD = probe('attn_residual', constrain_batch(layers.apply_norm(self.post_attn_norm, x_BLD)), layer)
      ffn_input_BLD = self.branch_input(self.pre_ffn_norm, x_BLD, fused)

    h_BLD = self.ffn(ffn_input_BLD)
    h_BLD = layers.dropout(layers.apply_norm(self.mid_ffn_norm, h_BLD), p, keys[2])
    h_BLD = probe('ffn_branch', constrain_batch(h_BLD), layer)
    x_BLD = scale['skip_ffn'] * x_BLD + scale['branch_ffn'] * h_BLD
    return probe('ffn_residual', constrain_batch(layers.apply_norm(self.post_ffn_norm, x_BLD)), layer)

  def fused_residual_norm(self, x_BLD, h_BLD, skip, branch, add_out_bias: bool) -> tuple[jax.Array, ...]:
    """(λ·x + β·h, Norm(λ·x + β·h) in the compute dtype) by `fused_ops.residual_norm`, Norm the
    layer's pre-FFN norm; `add_out_bias`: h is the attention's output without its output projection's
    bias, which the kernel adds."""
    norm = self.pre_ffn_norm
    params, kind = _norm_params(norm), _norm_kind(norm, self.cfg)
    bias = self.attn.o.bias
    out_bias = bias[...] if add_out_bias and bias is not None else None
    x_BLD, y_BLD = fused_ops.residual_norm(x_BLD, h_BLD, skip, branch, *params, **kind, branch_bias=out_bias)
    return constrain_batch(x_BLD), y_BLD

  def branch_input(self, norm: layers.Norm | None, x_BLD: jax.Array, fused: bool) -> jax.Array:
    """Norm(x) (x where the layout has no such norm) in the branches' compute dtype."""
    if fused and norm is not None:
      return fused_ops.norm_cast(x_BLD, *_norm_params(norm), **_norm_kind(norm, self.cfg))
    return layers.apply_norm(norm, x_BLD).astype(self.cfg.dtype)


def _norm_params(norm: layers.Norm) -> tuple[jax.Array, jax.Array | None]:
  return norm.scale[...], None if norm.bias is None else norm.bias[...]


def _norm_kind(norm: layers.Norm, cfg: TransformerConfig) -> dict[str, Any]:
  return dict(kind=norm.kind, eps=norm.eps, out_dtype=cfg.dtype)


def apply_remat(fn: Callable, policy: str) -> Callable:
  """`fn` under `jax.checkpoint` with the named policy ('none': `fn` itself)."""
  if policy == 'none':
    return fn
  if policy == 'full':
    return jax.checkpoint(fn)
  return jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy))


class LayerStack(nnx.Module):
  """`depth` Blocks with parameters stacked on axis 0, applied with `jax.lax.scan`."""

  def __init__(self, cfg: TransformerConfig, layer_init: dict[str, Any], *, rngs: nnx.Rngs):
    """`layer_init[name]` has shape (depth,): layer n is built from entry n of each array."""
    self.depth, self.remat = cfg.depth, cfg.remat
    self.scan_layers, self.scan_unroll = cfg.scan_layers, cfg.scan_unroll

    @nnx.split_rngs(splits=cfg.depth)
    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def create_layers(rngs: nnx.Rngs, init_n: dict[str, Any]) -> Block:
      return Block(cfg, init_n, rngs=rngs)

    self.layers = create_layers(rngs, {k: jnp.asarray(layer_init[k], jnp.float32) for k in LAYER_INIT_KEYS})

  def __call__(self, x_BLD: jax.Array, dropout_key: jax.Array | None, probe: Probe = no_probe) -> jax.Array:
    graphdef, stacked_state = nnx.split(self.layers)
    layer_keys = None if dropout_key is None else jax.random.split(dropout_key, self.depth)
    probe_per_layer = probe.per_layer if isinstance(probe, ScannedProbe) else None

    def apply_layer(x_BLD, layer_xs):
      layer_state, key, index, probe_entry = layer_xs
      layer_probe = probe.in_layer(probe_entry) if isinstance(probe, ScannedProbe) else probe
      return nnx.merge(graphdef, layer_state)(x_BLD, key, layer=index, probe=layer_probe), None

    layer_fn = apply_remat(apply_layer, self.remat)
    xs = (stacked_state, layer_keys, jnp.arange(self.depth), probe_per_layer)
    if not self.scan_layers:
      for n in range(self.depth):
        x_BLD, _ = layer_fn(x_BLD, jax.tree.map(lambda a: a[n], xs))
      return x_BLD
    x_BLD, _ = jax.lax.scan(layer_fn, x_BLD, xs, unroll=min(self.scan_unroll, self.depth))
    return x_BLD


class Trunk(nnx.Module):
  """Embedded tokens in, final hidden states out: dropout, InputNorm, the stack, final norm, output scale.

  `output_scale` multiplies the final hidden state before the head (DSLM: 1/sqrt(d), Kedia et al. 2024
  §3.5).
  """

  def __init__(
    self, cfg: TransformerConfig, layer_init: dict[str, Any], *, output_scale: float, rngs: nnx.Rngs
  ):
    self.dropout = cfg.dropout
    self.input_norm = layers.make_norm(cfg.layout.input_norm, cfg.width, cfg.norm, cfg.norm_eps)
    self.stack = LayerStack(cfg, layer_init, rngs=rngs)
    self.final_norm = layers.make_norm(cfg.layout.final_norm, cfg.width, cfg.norm, cfg.norm_eps)
    self.output_scale = layers.constant(jnp.asarray(output_scale, jnp.float32), ())

  def __call__(self, x_BLD: jax.Array, dropout_key: jax.Array | None, probe: Probe = no_probe) -> jax.Array:
    embed_key, stack_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
    # The stream is float32 from here on, whatever the embedding tables are stored in (param_dtype):
    # the scan's carry keeps the type it enters with.
    x_BLD = layers.dropout(x_BLD.astype(jnp.float32), self.dropout, embed_key)
    x_BLD = probe('embedding', constrain_batch(layers.apply_norm(self.input_norm, x_BLD)), jnp.asarray(-1))
    x_BLD = self.stack(x_BLD, stack_key, probe)
    return layers.apply_norm(self.final_norm, x_BLD) * self.output_scale[...]
