"""Initialisation and residual-scaling schemes, selected by `model.scheme`.

Each scheme module exposes `init_plan(model_config, dims, input_moments=None) -> InitPlan` (see
`base.py`); `input_moments` are measured moments of the embedded input, which only DSLM with
`model.dslm.input_corr='measure'` uses.
"""

from __future__ import annotations

from dsjax.schemes import dslm, vanilla
from dsjax.schemes.base import InitPlan, ModelDims

SCHEMES = {'vanilla': vanilla.init_plan, 'dslm': dslm.init_plan}


def make_init_plan(model_config, dims: ModelDims, input_moments: dict | None = None) -> InitPlan:
  if model_config.scheme not in SCHEMES:
    raise ValueError(f'model.scheme must be one of {sorted(SCHEMES)}, got {model_config.scheme!r}')
  return SCHEMES[model_config.scheme](model_config, dims, input_moments=input_moments)
