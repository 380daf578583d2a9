"""The interface every method (`model.scheme`) implements.

A method is one module of `dsjax/schemes/` that defines `SCHEME = <a Scheme subclass instance>`:

  name, paper, summary   its `model.scheme` value, the citation, what it changes (the methods table)
  blocks                 the `model.block` values it is defined for (its first is the natural one)
  config(model_name)     its config section `model.<name>`: the method's constants with their published
                         defaults and a citation each (None: the method has no constants)
  validate(m)            one-line ValueErrors for its section and the model settings it cannot work with
  init_plan(m, dims, prepared)
                         the `InitPlan` (`dsjax.models.plan`): weight scales, residual scales, norms, ...
  needs_preparation(m), prepare(config, data_info, inputs)
                         an optional data-dependent step before the model is built (DSLM's measured
                         input correlation, ADMIN's profiling pass). `inputs` iterates over model inputs
                         of real training batches; the result is a flat JSON-able dict that the trainer
                         saves in the workdir and hands back to `init_plan` as `prepared` (also when
                         resuming, exporting or measuring moments of that run).

The trainer and the CLIs call these through `dsjax.schemes` without knowing which method it is.
"""

from __future__ import annotations

from typing import Any, Iterable

import ml_collections

from dsjax.models.config import one_of
from dsjax.models.plan import InitPlan, ModelDims

Prepared = dict[str, Any]


class Scheme:
  name: str = ''
  paper: str = ''
  summary: str = ''
  blocks: tuple[str, ...] = ('preln', 'postln')

  def config(self, model_name: str) -> ml_collections.ConfigDict | None:
    del model_name
    return None

  def validate(self, m) -> None:
    one_of(f"model.block (with model.scheme='{self.name}')", m.block, self.blocks)

  def init_plan(self, m, dims: ModelDims, prepared: Prepared | None = None) -> InitPlan:
    raise NotImplementedError

  def needs_preparation(self, m) -> bool:
    del m
    return False

  def prepare(self, config, data_info, inputs: Iterable[Any]) -> Prepared:
    raise NotImplementedError(f'model.scheme={self.name!r} has no preparation step')

  def section(self, m):
    """This method's config section of `m` (the `model` config)."""
    return m[self.name]
