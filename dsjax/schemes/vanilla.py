"""The plain initialisations: Xavier (default) and GPT-2 style, with λ = β = 1.

* `model.init = 'xavier'`: every matrix N(0, 2/(fan_in + fan_out)) — truncated normal when
  `model.init_distribution = 'truncated_normal'` (the DNT paper's ViT recipe, seed 004 Tables 4–5;
  variance kept exactly 2/(fan_in+fan_out) by rescaling the truncated draw). Embedding tables are
  treated as (vocab → width) matrices.
* `model.init = 'gpt2'`: every matrix N(0, 0.02²) and, as in GPT-2, the projections that write into the
  residual stream (attention output `o`, FFN `ffn2`) scaled by 1/sqrt(2·depth).
"""

from __future__ import annotations

import numpy as np

from dsjax.schemes.base import InitPlan, ModelDims, per_layer, xavier_std

INITS = ('xavier', 'gpt2')


def init_plan(model_config, dims: ModelDims, input_moments: dict | None = None) -> InitPlan:
  del input_moments  # Xavier / GPT-2 do not depend on the data.
  n, d, f = dims.depth, dims.width, dims.mlp_hidden
  ones = per_layer(n, 1.0)
  scales = dict(skip_attn=ones, branch_attn=ones, skip_ffn=ones, branch_ffn=ones)
  if model_config.init == 'xavier':
    layer = dict(q=per_layer(n, xavier_std(d, d)), k=per_layer(n, xavier_std(d, d)),
                 v=per_layer(n, xavier_std(d, d)), o=per_layer(n, xavier_std(d, d)),
                 ffn1=per_layer(n, xavier_std(d, f)), ffn2=per_layer(n, xavier_std(f, d)))
    input_std = xavier_std(dims.input_dim, d)
    return InitPlan(distribution=model_config.init_distribution, layer={**layer, **scales},
                    input_std=input_std, pos_std=input_std if dims.kind == 'gpt' else 0.02,
                    head_std=xavier_std(d, dims.num_outputs))
  if model_config.init == 'gpt2':
    residual_std = 0.02 / np.sqrt(2.0 * n)
    layer = dict(q=per_layer(n, 0.02), k=per_layer(n, 0.02), v=per_layer(n, 0.02),
                 o=per_layer(n, residual_std), ffn1=per_layer(n, 0.02), ffn2=per_layer(n, residual_std))
    return InitPlan(distribution=model_config.init_distribution, layer={**layer, **scales},
                    input_std=0.02, pos_std=0.02, head_std=0.02)
  raise ValueError(f'model.init must be one of {list(INITS)}, got {model_config.init!r}')
