"""Initialisation and residual-scaling schemes, selected by `model.scheme`.

Each scheme module exposes `init_plan(model_config, dims) -> InitPlan` (see `base.py`).
"""

from __future__ import annotations

from dsjax.schemes import vanilla
from dsjax.schemes.base import InitPlan, ModelDims

SCHEMES = {'vanilla': vanilla.init_plan}


def make_init_plan(model_config, dims: ModelDims) -> InitPlan:
  if model_config.scheme not in SCHEMES:
    raise ValueError(f'model.scheme must be one of {sorted(SCHEMES)}, got {model_config.scheme!r}')
  return SCHEMES[model_config.scheme](model_config, dims)
