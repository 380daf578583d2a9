"""Initialisation and residual-scaling schemes, selected by `model.scheme`.

Each scheme module exposes `init_plan(model_config, dims) -> InitPlan` (see `base.py`). A scheme that
uses measured moments of the embedded input (DSLM with `model.dslm.input_corr='measure'`) also takes
`input_moments=`.
"""

from __future__ import annotations

from dsjax.schemes import dslm, vanilla
from dsjax.schemes.base import InitPlan, ModelDims

SCHEMES = {'vanilla': vanilla.init_plan, 'dslm': dslm.init_plan}


def make_init_plan(model_config, dims: ModelDims, input_moments: dict | None = None) -> InitPlan:
  if model_config.scheme not in SCHEMES:
    raise ValueError(f'model.scheme must be one of {sorted(SCHEMES)}, got {model_config.scheme!r}')
  if input_moments is None:
    return SCHEMES[model_config.scheme](model_config, dims)
  return SCHEMES[model_config.scheme](model_config, dims, input_moments=input_moments)
