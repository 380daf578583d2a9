r"""DeepNorm: Post-LN with an up-weighted skip and down-scaled residual-branch weights.

Wang, Ma, Dong, Huang, Zhang & Wei 2022, "DeepNet: Scaling Transformers to 1,000 Layers"
(arXiv:2203.00555), Figure 2 (the DeepNorm pseudocode) and Table 1.

Definition as implemented, for a stack of N layers (one layer = attention add + FFN add):

    every residual add (Post-LN)    x ← LN(α·x + G(x))          α a fixed constant (skip scale λ = α,
                                                                  branch scale 1)
    FFN (both), values, out-proj    Xavier normal with gain β:  std = β·sqrt(2/(fan_in + fan_out))
    queries, keys                   Xavier normal, gain 1
    embeddings, head                Xavier (`vanilla.xavier_plan`), untouched by the method
    encoder-only (ViT)              α = (2N)^{1/4},  β = (8N)^{-1/4}     (Table 1, "Encoder-only")
    decoder-only (GPT)              α = (2M)^{1/4},  β = (8M)^{-1/4}, M = N (Table 1, "Decoder-only")

β is a weight gain, not a branch multiplier: the model's branch scale stays 1 and the drawn V, O, FFN
kernels are β times their Xavier draw. Both model kinds use the same formula with the layer count, so one
config serves both: α = (alpha_base·N)^alpha_exponent and β = (beta_base·N)^(−beta_exponent) with the
published constants as defaults. (Table 1's encoder–decoder constants, α_enc = 0.81(N⁴M)^{1/16} etc.,
do not apply: dsjax has no encoder–decoder model.)

Choices the paper leaves open:
  * The draw follows `model.init_distribution` (default 'normal', the paper's Xavier normal); biases 0,
    LayerNorm gains 1 (the model's defaults).
  * α is fixed (a `Constant`), as in the paper: it is a constant of the architecture, not a parameter.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from dsjax.models.config import number
from dsjax.models.plan import ModelDims, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan

BETA_SCALED = ('v', 'o', 'ffn1', 'ffn2')  # Xavier gain β; q and k keep gain 1 (the paper's Figure 2)


def deepnorm_constants(c, depth: int) -> tuple[float, float]:
  """(α, β) for N = depth layers: α = (alpha_base·N)^alpha_exponent, β = (beta_base·N)^(−beta_exponent)."""
  alpha = float((c.alpha_base * depth) ** c.alpha_exponent)
  beta = float((c.beta_base * depth) ** -c.beta_exponent)
  return alpha, beta


class DeepNorm(Scheme):
  name = 'deepnorm'
  paper = (
    'Wang et al. 2022, DeepNet: Scaling Transformers to 1,000 Layers (arXiv:2203.00555), Fig. 2, Table 1'
  )
  summary = 'Post-LN LN(α·x + G(x)), α = (2N)^{1/4}; Xavier with gain β = (8N)^{-1/4} for V, O and FFN'
  blocks = ('postln',)

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    # Table 1 of the paper, encoder-only and decoder-only rows (M = N): α = (2N)^{1/4}, β = (8N)^{-1/4}.
    c.alpha_base = 2.0
    c.alpha_exponent = 0.25
    c.beta_base = 8.0
    c.beta_exponent = 0.25
    return c

  def validate(self, m):
    super().validate(m)
    c = m.deepnorm
    for key in ('alpha_base', 'beta_base'):
      number(f'model.deepnorm.{key}', c[key], low=0, low_open=True)
    for key in ('alpha_exponent', 'beta_exponent'):
      number(f'model.deepnorm.{key}', c[key])

  def init_plan(self, m, dims: ModelDims, prepared=None):
    n = dims.depth
    alpha, beta = deepnorm_constants(m.deepnorm, n)
    base = xavier_plan(m, dims)
    layer = dict(base.layer)
    for key in BETA_SCALED:
      layer[key] = np.asarray(layer[key] * beta, np.float32)
    layer.update(skip_attn=per_layer(n, alpha), skip_ffn=per_layer(n, alpha))
    return xavier_plan(m, dims, layer=layer)


SCHEME = DeepNorm()
