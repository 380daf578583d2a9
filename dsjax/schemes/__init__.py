"""Initialisation and residual-scaling methods, selected by `model.scheme`: one module each.

Every module of this package that defines `SCHEME` (a `dsjax.schemes.base.Scheme`) is registered under
`SCHEME.name`; adding a method is adding a file. The rest of dsjax uses only the functions below.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from typing import Any, Callable, Iterable

import ml_collections
from flax import nnx

from dsjax import models
from dsjax.models.config import one_of
from dsjax.models.plan import InitPlan, ModelDims
from dsjax.schemes.base import Prepared, Scheme

# The method whose plan is a plain residual stack (λ = β = 1, output scale 1): what `dsjax.export`
# folds a scaled model into.
PLAIN = 'vanilla'
# Where a run keeps the result of its method's preparation step (read back on resume and by the CLIs).
PREPARATION_FILE = 'scheme_preparation.json'


def _discover() -> dict[str, Scheme]:
  found = {}
  for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
    if info.name == 'base':
      continue
    module = importlib.import_module(f'{__name__}.{info.name}')
    scheme = getattr(module, 'SCHEME', None)
    if isinstance(scheme, Scheme):
      if scheme.name in found:
        raise ValueError(f'two modules of dsjax.schemes register model.scheme={scheme.name!r}')
      found[scheme.name] = scheme
  return found


SCHEMES: dict[str, Scheme] = _discover()


def get(name: str) -> Scheme:
  one_of('model.scheme', name, sorted(SCHEMES))
  return SCHEMES[name]


def add_config_sections(model_config: ml_collections.ConfigDict) -> None:
  """Adds `model.scheme` and every method's own section (`model.<name>`) with its published defaults."""
  model_config.scheme = PLAIN  # initialisation + residual scaling method (dsjax/schemes/<name>.py)
  for name, scheme in SCHEMES.items():
    section = scheme.config(model_config.name)
    if section is not None:
      model_config[name] = section


def validate(model_config) -> None:
  get(model_config.scheme).validate(model_config)


def make_init_plan(model_config, dims: ModelDims, prepared: Prepared | None = None) -> InitPlan:
  return get(model_config.scheme).init_plan(model_config, dims, prepared)


def build_model(config, data_info, rngs: nnx.Rngs, prepared: Prepared | None = None) -> nnx.Module:
  """The model of `config`, initialised by its method (`prepared`: the method's preparation result)."""
  seq_len = config.data.seq_len
  plan = make_init_plan(config.model, models.model_dims(config.model, data_info, seq_len=seq_len), prepared)
  return models.build_model(config.model, data_info, plan, rngs, seq_len=seq_len)


def preparation_for_run(
  config, data_info, input_batches: Callable[[], Iterable[Any]], workdir: str | None = None
) -> Prepared | None:
  """The method's preparation result for a run, or None when its method has no such step.

  Read from `workdir/scheme_preparation.json` when it exists (a resumed run, `dsjax.export`,
  `dsjax.moments --checkpoint`); otherwise computed on `input_batches()` (model inputs of real training
  batches). The training loop saves a computed one (`save_preparation`) once all its checks have passed.
  """
  scheme = get(config.model.scheme)
  if not scheme.needs_preparation(config.model):
    return None
  path = None if workdir is None else os.path.join(workdir, PREPARATION_FILE)
  if path is not None and os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
    if saved.get('scheme') == scheme.name:
      return saved['result']
  return scheme.prepare(config, data_info, input_batches())


def save_preparation(config, workdir: str, result: Prepared) -> None:
  """Writes `result` to `workdir/scheme_preparation.json`, atomically (a file written beside it, then
  renamed): another process reading it on resume never sees half of it."""
  path = os.path.join(workdir, PREPARATION_FILE)
  with open(path + '.tmp', 'w') as f:
    json.dump({'scheme': get(config.model.scheme).name, 'result': result}, f, indent=1)
  os.replace(path + '.tmp', path)


def table() -> list[dict[str, Any]]:
  """name, paper, summary and blocks of every registered method (for docs and tests)."""
  return [
    {'name': s.name, 'paper': s.paper, 'summary': s.summary, 'blocks': s.blocks} for s in SCHEMES.values()
  ]
