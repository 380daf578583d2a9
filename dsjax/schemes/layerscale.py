r"""LayerScale: a learnable per-channel scale diag(λ) on every residual branch of a Pre-LN stack.

Touvron, Cord, Sablayrolles, Synnaeve & Jégou 2021, "Going Deeper with Image Transformers" (CaiT,
ICCV 2021, arXiv:2103.17239), LayerScale.

Definition as implemented, for both residual adds of every layer of a Pre-LN stack:

    x ← x + diag(λ)·Drop(f(LN(x))),    λ ∈ R^d learnable, one vector per add (attention and FFN of every
                                       layer), every entry initialised to ε

    ε = 0.1    for depth N ≤ 18
        1e-5   for 18 < N ≤ 24
        1e-6   for N > 24                                  (`model.layerscale.init = 'depth_rule'`)

or ε = `model.layerscale.init` when it is a number. λ is an `nnx.Param` (trained, never weight-decayed);
the skip scale is a fixed 1.

Choices where the paper is open:
  * Depth is the number of layers N of the stack (one layer = attention block + FFN block), which is
    what the paper's depth counts (its transformer blocks, each with both sublayers).
  * The paper gives ε for depth up to 18, for 24 and for deeper networks; depths between 18 and 24
    take 1e-5.
  * The weights are Xavier (the Xavier base of `dsjax.schemes.vanilla`), so that LayerScale changes only
    the residual branch; CaiT itself keeps its DeiT-style weight init. The class-attention stage of
    CaiT is a separate proposal and not implemented.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from dsjax.models.config import is_number
from dsjax.models.plan import InitPlan, ModelDims, ResidualScale, per_layer
from dsjax.schemes.base import Scheme
from dsjax.schemes.vanilla import xavier_plan

DEPTH_RULE = 'depth_rule'


def depth_rule_init(depth: int) -> float:
  """CaiT's ε: 0.1 up to depth 18, 1e-5 up to 24, 1e-6 deeper (Touvron et al. 2021, LayerScale)."""
  if depth <= 18:
    return 0.1
  if depth <= 24:
    return 1e-5
  return 1e-6


def initial_scale(m, depth: int) -> float:
  init = m.layerscale.init
  return depth_rule_init(depth) if init == DEPTH_RULE else float(init)


class LayerScale(Scheme):
  name = 'layerscale'
  paper = (
    'Touvron et al. 2021, Going Deeper with Image Transformers (CaiT, ICCV 2021, arXiv:2103.17239), '
    'LayerScale'
  )
  summary = (
    'Pre-LN; x + diag(λ)·f(LN(x)), learnable λ ∈ R^d per add, init 0.1 (N ≤ 18), 1e-5 (N ≤ 24), '
    '1e-6 (deeper); Xavier weights'
  )
  blocks = ('preln',)

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    # Initial value ε of every entry of λ: 'depth_rule' (0.1 for depth ≤ 18, 1e-5 for ≤ 24, 1e-6 deeper;
    # Touvron et al. 2021, LayerScale) or a number. Of type object so that both can be set.
    c.init = config_dict.FieldReference(DEPTH_RULE, field_type=object)
    return c

  def validate(self, m):
    super().validate(m)
    init = m.layerscale.init
    if not (init == DEPTH_RULE or (is_number(init) and init > 0)):
      raise ValueError(f"model.layerscale.init must be '{DEPTH_RULE}' or a number > 0, got {init!r}")

  def init_plan(self, m, dims: ModelDims, prepared=None) -> InitPlan:
    base = xavier_plan(m, dims)
    eps = per_layer(dims.depth, initial_scale(m, dims.depth))
    layer = {**base.layer, 'branch_attn': eps, 'branch_ffn': eps.copy()}
    return xavier_plan(m, dims, layer=layer, branch=ResidualScale(learnable=True, vector=True))


SCHEME = LayerScale()
