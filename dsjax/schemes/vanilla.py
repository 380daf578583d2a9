"""The plain initialisations: Xavier (default), GPT-2 and BERT style, with λ = β = 1.

* `model.vanilla.init = 'xavier'` (Glorot & Bengio 2010): every matrix N(0, 2/(fan_in + fan_out)) —
  truncated normal when `model.init_distribution = 'truncated_normal'` (the DNT paper's ViT recipe,
  Qi et al. 2025, Table 4; the variance is kept exactly 2/(fan_in+fan_out) by rescaling the truncated
  draw). Embedding tables are treated as (vocab → width) matrices.
* `model.vanilla.init = 'gpt2'` (Radford et al. 2019): every matrix N(0, 0.02²) and, as in GPT-2, the
  projections that write into the residual stream (attention output `o`, FFN `ffn2`) scaled by
  1/sqrt(2·depth).
* `model.vanilla.init = 'bert'` (Devlin et al. 2019, arXiv:1810.04805; the vanilla baseline of Kedia et
  al. 2024, arXiv:2403.09635, Table 14: σ = 0.02): every matrix, both embedding tables (token or patch,
  and position) and the head N(0, 0.02²), with no depth scaling (that is GPT-2's). BERT's reference code
  draws every weight from TensorFlow's truncated normal with stddev 0.02 (cut at ±2σ and not rescaled,
  so its standard deviation is about 0.88·0.02); here the draw follows `model.init_distribution` as for
  the other inits: 'normal' by default, 'truncated_normal' cut at ±2σ and rescaled to std 0.02 exactly.
  Biases 0, norm gains 1, as BERT's (the model's defaults).
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

INITS = ('xavier', 'gpt2', 'bert')


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
  paper = 'Glorot & Bengio 2010 (Xavier); Radford et al. 2019 (GPT-2 init); Devlin et al. 2019 (BERT init)'
  summary = (
    'Xavier, GPT-2 (N(0, 0.02²), residual projections / sqrt(2N)) or BERT (N(0, 0.02²)) weights; λ = β = 1'
  )
  blocks = BLOCKS

  def config(self, model_name):
    c = ml_collections.ConfigDict()
    c.init = 'xavier'  # 'xavier' | 'gpt2' | 'bert' (module docstring)
    return c

  def validate(self, m):
    super().validate(m)
    one_of('model.vanilla.init', m.vanilla.init, INITS)

  def init_plan(self, m, dims, prepared=None):
    if m.vanilla.init == 'xavier':
      return xavier_plan(m, dims)
    n = dims.depth
    # GPT-2 scales the projections into the residual stream by 1/sqrt(2N); BERT does not.
    residual_std = 0.02 / np.sqrt(2.0 * n) if m.vanilla.init == 'gpt2' else 0.02
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
