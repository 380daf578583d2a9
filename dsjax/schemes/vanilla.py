"""The plain initialisations: Xavier (default) and GPT-2 style, with λ = β = 1.

* `model.vanilla.init = 'xavier'` (Glorot & Bengio 2010): every matrix N(0, 2/(fan_in + fan_out)) —
  truncated normal when `model.init_distribution = 'truncated_normal'` (the DNT paper's ViT recipe,
  Qi et al. 2025, Table 4; the variance is kept exactly 2/(fan_in+fan_out) by rescaling the truncated
  draw). Embedding tables are treated as (vocab → width) matrices.
* `model.vanilla.init = 'gpt2'` (Radford et al. 2019): every matrix N(0, 0.02²) and, as in GPT-2, the
  projections that write into the residual stream (attention output `o`, FFN `ffn2`) scaled by
  1/sqrt(2·depth).
"""

from __future__ import annotations

import ml_collections
import numpy as np

from dsjax.models.config import one_of
from dsjax.models.plan import (
  BLOCKS,
  InitPlan,
  ModelDims,
  per_layer,
  unit_scales,
  xavier_layer_stds,
  xavier_std,
)
from dsjax.schemes.base import Scheme

INITS = ('xavier', 'gpt2')


def xavier_plan(m, dims: ModelDims, **overrides) -> InitPlan:
  """Xavier everywhere, λ = β = 1; `overrides` replace InitPlan fields (the base of several methods)."""
  input_std = xavier_std(dims.input_dim, dims.width)
  fields = dict(
    distribution=m.init_distribution,
    layer={**xavier_layer_stds(dims), **unit_scales(dims.depth)},
    input_std=input_std,
    pos_std=input_std if dims.kind == 'gpt' else 0.02,
    head_std=xavier_std(dims.width, dims.num_outputs),
  )
  fields.update(overrides)
  return InitPlan(**fields)


class Vanilla(Scheme):
  name = 'vanilla'
  paper = 'Glorot & Bengio 2010 (Xavier); Radford et al. 2019 (GPT-2 init)'
  summary = 'Xavier or GPT-2 (N(0, 0.02²), residual projections / sqrt(2N)) weights; λ = β = 1'
  blocks = BLOCKS

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.init = 'xavier'  # 'xavier' | 'gpt2'
    return c

  def validate(self, m):
    super().validate(m)
    one_of('model.vanilla.init', m.vanilla.init, INITS)

  def init_plan(self, m, dims, prepared=None):
    if m.vanilla.init == 'xavier':
      return xavier_plan(m, dims)
    n = dims.depth
    residual_std = 0.02 / np.sqrt(2.0 * n)
    layer = dict(
      q=per_layer(n, 0.02),
      k=per_layer(n, 0.02),
      v=per_layer(n, 0.02),
      o=per_layer(n, residual_std),
      ffn1=per_layer(n, 0.02),
      ffn2=per_layer(n, residual_std),
    )
    return InitPlan(
      distribution=m.init_distribution,
      layer={**layer, **unit_scales(n)},
      input_std=0.02,
      pos_std=0.02,
      head_std=0.02,
    )


SCHEME = Vanilla()
