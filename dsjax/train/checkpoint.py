"""Orbax checkpoints of the train state plus the input pipeline's position.

A checkpoint at step t holds everything a run needs to continue bit-for-bit: the train state (params,
non-trainable model values, optimizer state, step) and the JSON state of the training input pipeline.
Dropout keys are derived from (seed, step), so no RNG state needs saving beyond the step.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from dsjax import schemes
from dsjax.train import state as state_lib
from dsjax.train import step as step_lib


class Checkpointer:

  def __init__(self, workdir: str, *, save_every: int, keep: int):
    self.manager = ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), 'checkpoints'),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                             create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
    """Restores onto the shardings carried by `abstract_state` (a tree of ShapeDtypeStructs)."""
    step = self.latest_step() if step is None else step
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return restored['state'], restored['data']

  def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
    """Saves asynchronously when `step` is on the interval (or `force`); returns whether it saved."""
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def restore_model(config, data_info, workdir: str):
  """The NNX model of a training run at the latest checkpoint in `workdir` (for `dsjax.export`,
  `dsjax.moments --checkpoint`): the train state is restored onto one device and merged into a model
  built from `config`, with the result of its method's preparation step that the run saved."""
  no_checkpoint = ValueError(f'{workdir} holds no checkpoint (looked in {workdir}/checkpoints)')
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):  # Checked first: creates nothing.
    raise no_checkpoint
  prepared = schemes.preparation_for_run(config, data_info, lambda: step_lib.first_model_inputs(config), workdir,
                                          write=False)
  setup = state_lib.make_setup(config, data_info, prepared)
  checkpointer = Checkpointer(workdir, save_every=1, keep=1)
  if checkpointer.latest_step() is None:
    checkpointer.close()
    raise no_checkpoint
  state, _ = checkpointer.restore(jax.eval_shape(setup.create_state))
  checkpointer.close()
  logging.info('Restored step %d from %s', int(state['step']), workdir)
  return nnx.merge(setup.graphdef, state['params'], state['rest'])
