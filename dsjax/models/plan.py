"""The model/method contract: what an initialisation or residual-scaling method decides about a model.

A method (`model.scheme`, one module of `dsjax.schemes`) turns the config into an `InitPlan`; the model
code builds exactly what the plan says and never hard-codes an initialiser, a residual scale or a norm
placement. The plan holds

  * the initial standard deviation of every weight, per layer for the six block matrices
    (`layer[q|k|v|o|ffn1|ffn2]`, shape (depth,)), and of the embeddings and the head;
  * the residual scales of both adds of every layer, x ← λ·x + β·f(x) (`layer[skip_*|branch_*]`), and
    how they are stored (`ResidualScale`: fixed or learnable, one scalar or a vector of width d, one per
    add or one per layer shared by both adds);
  * which norms exist (`layout`, a `NormLayout`; None = the one `model.block` names);
  * the attention logit scale (None = 1/sqrt(d_head)), its warm-up over the first training steps
    (`attn_logit_warmup_steps`, Noci et al. 2022) and the attention-matrix edit α·I + β·A
    (`attn_identity`, He et al. 2023);
  * concatenation instead of addition as the residual (`concat`, Catformer, Davis et al. 2021);
  * per-weight-type learning-rate multipliers (`lr_scale`, μP), which the optimizer builder reads from
    the parameters' metadata.

`ModelDims` are the sizes a method decides from. Models import nothing of the methods.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

# Per-layer arrays (each of shape (depth,)) that the scheme chooses for layer n and the scanned stack
# consumes: initial standard deviations of the six weight matrices and the four residual scales.
WEIGHT_KEYS = ('q', 'k', 'v', 'o', 'ffn1', 'ffn2')
SCALE_KEYS = ('skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn')
LAYER_INIT_KEYS = WEIGHT_KEYS + SCALE_KEYS
# Weight types outside the blocks that may carry a learning-rate multiplier.
EMBEDDING_KEYS = ('input', 'pos', 'head')

BLOCKS = ('preln', 'postln', 'dnt', 'nonorm')
DNT_SETTINGS = ('S1', 'S2', 'S3', 'S4', 'S5')


@dataclasses.dataclass(frozen=True)
class NormLayout:
  """Where the norms sit. Field names follow the DNT paper (Qi et al. 2025, §3)."""

  input_norm: bool = False  # after the embedding, before the first block
  pre_attn: bool = True  # on the attention branch input
  pre_ffn: bool = True  # on the FFN branch input
  qk_norm: bool = False  # on each head's queries and keys
  mid_attn: bool = False  # on the attention branch output (before dropout and β)
  mid_ffn: bool = False  # on the FFN branch output
  post: bool = False  # after each residual add (Post-LN)
  final_norm: bool = True  # after the stack, before the head

  @classmethod
  def for_block(cls, block: str, dnt_setting: str = 'S5', final_norm: bool | None = None) -> 'NormLayout':
    """The layout of `model.block` (and `model.dnt_setting` for DNT, Qi et al. 2025 §4.4 and Fig. 7).

    'nonorm' has no norm anywhere (T-Fixup, SkipInit, ReZero)."""
    if block == 'preln':
      layout = cls()
    elif block == 'postln':
      layout = cls(pre_attn=False, pre_ffn=False, post=True, final_norm=False)
    elif block == 'nonorm':
      layout = cls(pre_attn=False, pre_ffn=False, final_norm=False)
    elif block == 'dnt':
      #                      input  pre_attn pre_ffn  qk     mid_attn mid_ffn
      flags = {
        'S1': (False, True, True, False, False, False),
        'S2': (False, True, True, True, False, False),
        'S3': (True, True, True, True, False, False),
        'S4': (True, True, True, True, True, True),
        'S5': (True, True, False, True, True, True),
      }
      if dnt_setting not in flags:
        raise ValueError(f'model.dnt_setting must be one of {list(flags)}, got {dnt_setting!r}')
      layout = cls(*flags[dnt_setting])
    else:
      raise ValueError(f'model.block must be one of {list(BLOCKS)}, got {block!r}')
    if final_norm is not None:
      layout = dataclasses.replace(layout, final_norm=final_norm)
    return layout


@dataclasses.dataclass(frozen=True)
class ModelDims:
  """Sizes a scheme needs. `input_dim`: patch size²·channels (ViT) or vocabulary size (GPT)."""

  kind: str  # 'vit' | 'gpt'
  depth: int
  width: int
  num_heads: int
  mlp_hidden: int
  input_dim: int
  num_outputs: int  # classes (ViT) or vocabulary (GPT)
  seq_len: int
  num_embedding_tables: (
    int  # K of the DSLM paper's App. A.1: GPT token + position = 2; ViT patch + position = 2
  )

  @property
  def head_dim(self) -> int:
    return self.width // self.num_heads


@dataclasses.dataclass(frozen=True)
class ResidualScale:
  """How the skip scales λ (or the branch scales β) of a stack are stored.

  learnable: an `nnx.Param` (trained, never weight-decayed) instead of a fixed `Constant`.
  vector:    a vector of width d per add (LayerScale's diag(λ), ADMIN's ω), every entry initialised to
             the plan's per-layer value, instead of one scalar.
  shared:    one value per layer used at both adds (ReZero's α); the plan's `*_attn` value initialises it.
  """

  learnable: bool = False
  vector: bool = False
  shared: bool = False


@dataclasses.dataclass(frozen=True)
class ConcatPlan:
  """Concatenation residual (Catformer): module i maps the stream of width `stream_widths[i]` to
  `growth` new features appended to it; module order is attention, FFN, attention, FFN, ...

  `stream_widths` has 2·depth + 1 entries (the last is the width the head sees); `attn_width` is the
  width of q/k/v inside every attention module and `ffn_hidden` the FFN hidden width. Built by
  `dsjax.models.concat.ConcatTrunk`, which reads the plan's per-layer weight stds (for these shapes) but
  not its residual scales (there is no addition)."""

  growth: int
  attn_width: int
  ffn_hidden: int
  stream_widths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class InitPlan:
  distribution: str  # 'normal' | 'truncated_normal' | 'uniform'
  layer: Mapping[str, np.ndarray]  # LAYER_INIT_KEYS -> (depth,) float arrays
  input_std: float  # patch-embedding kernel (ViT) or token embedding table (GPT)
  pos_std: float  # learned position embedding (and CLS token)
  head_std: float  # classifier / LM head kernel (ignored when tied)
  output_scale: float = 1.0  # multiplies the final hidden state before the head
  skip: ResidualScale = ResidualScale()
  branch: ResidualScale = ResidualScale()
  layout: NormLayout | None = None  # None: the layout of model.block
  attn_logit_scale: float | None = None  # multiplies q·k; None: 1/sqrt(d_head)
  # Training multiplies the logit scale by min(1, step/attn_logit_warmup_steps) (step: the training
  # steps done); 0: no warm-up. Evaluation and the built model use the full scale.
  attn_logit_warmup_steps: int = 0
  attn_identity: bool = False  # attention matrix α·I + β·A(X), learnable α (init 1), β (init 0)
  concat: ConcatPlan | None = None  # None: additive residual
  lr_scale: Mapping[str, float] = dataclasses.field(default_factory=dict)  # weight type -> lr multiplier
  zero_head: bool = False  # head kernel initialised to zero (μP's optional readout init)

  def __post_init__(self):
    missing = set(LAYER_INIT_KEYS) - set(self.layer)
    if missing:
      raise ValueError(f'InitPlan.layer is missing {sorted(missing)}')
    unknown = set(self.lr_scale) - set(WEIGHT_KEYS + EMBEDDING_KEYS)
    if unknown:
      raise ValueError(f'InitPlan.lr_scale has unknown weight types {sorted(unknown)}')


def per_layer(depth: int, value) -> np.ndarray:
  """Broadcasts a scalar (or checks an array) to one float per layer."""
  arr = np.broadcast_to(np.asarray(value, np.float64), (depth,)).astype(np.float32)
  return np.array(arr)


def xavier_std(fan_in: int, fan_out: int) -> float:
  """Glorot/Xavier: Var = 2 / (fan_in + fan_out)."""
  return float(np.sqrt(2.0 / (fan_in + fan_out)))


def xavier_layer_stds(dims: ModelDims) -> dict[str, np.ndarray]:
  """Xavier standard deviations of the six block matrices, per layer."""
  n, d, f = dims.depth, dims.width, dims.mlp_hidden
  square = per_layer(n, xavier_std(d, d))
  return dict(
    q=square,
    k=square.copy(),
    v=square.copy(),
    o=square.copy(),
    ffn1=per_layer(n, xavier_std(d, f)),
    ffn2=per_layer(n, xavier_std(f, d)),
  )


def unit_scales(depth: int) -> dict[str, np.ndarray]:
  """λ = β = 1 at both adds of every layer (a plain residual stack)."""
  return {key: per_layer(depth, 1.0) for key in SCALE_KEYS}
