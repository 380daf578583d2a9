"""What an initialisation scheme decides, and the model dimensions it decides it from.

A scheme (`model.scheme`) turns the model config into an `InitPlan`: the initial standard deviation of
every weight (per layer for the six block matrices), the residual scales λ/β of both adds of every
layer, the scale of the final hidden state, and whether λ/β are learnable. The model code never
hard-codes an initialiser, so DSLM and the prior deep-transformer methods (SPEC §5) only add a scheme.
"""

from __future__ import annotations

import dataclasses

import numpy as np


# Per-layer arrays (each of shape (depth,)) that the scheme chooses for layer n and the model's scanned
# stack (dsjax.models.transformer) consumes: initial standard deviations of the six weight matrices
# and the four residual scales.
LAYER_INIT_KEYS = ('q', 'k', 'v', 'o', 'ffn1', 'ffn2',
                   'skip_attn', 'branch_attn', 'skip_ffn', 'branch_ffn')


@dataclasses.dataclass(frozen=True)
class ModelDims:
  """Sizes a scheme needs. `input_dim`: patch size²·channels (ViT) or vocabulary size (GPT)."""
  kind: str            # 'vit' | 'gpt'
  depth: int
  width: int
  num_heads: int
  mlp_hidden: int
  input_dim: int
  num_outputs: int     # classes (ViT) or vocabulary (GPT)
  seq_len: int
  num_embedding_tables: int  # K of SPEC §1.4: GPT token + position = 2; ViT patch (+ position) counts 2


@dataclasses.dataclass(frozen=True)
class InitPlan:
  distribution: str                 # 'normal' | 'truncated_normal' | 'uniform'
  layer: dict[str, np.ndarray]      # LAYER_INIT_KEYS -> (depth,) float arrays
  input_std: float                  # patch-embedding kernel (ViT) or token embedding table (GPT)
  pos_std: float                    # learned position embedding (and CLS token)
  head_std: float                   # classifier / LM head kernel (ignored when tied)
  output_scale: float = 1.0         # multiplies the final hidden state before the head
  learnable_skip_scale: bool = False
  learnable_branch_scale: bool = False

  def __post_init__(self):
    missing = set(LAYER_INIT_KEYS) - set(self.layer)
    if missing:
      raise ValueError(f'InitPlan.layer is missing {sorted(missing)}')


def per_layer(depth: int, value) -> np.ndarray:
  """Broadcasts a scalar (or checks an array) to one float per layer."""
  arr = np.broadcast_to(np.asarray(value, np.float64), (depth,)).astype(np.float32)
  return np.array(arr)


def xavier_std(fan_in: int, fan_out: int) -> float:
  """Glorot/Xavier: Var = 2 / (fan_in + fan_out)."""
  return float(np.sqrt(2.0 / (fan_in + fan_out)))
