"""What keeps a run's workdir consistent, apart from the training itself.

A run takes the workdir's lock before it writes anything (one run per workdir), removes what it created
again when one of its checks fails (so a failed check leaves the workdir as it was found), and once
every check has passed (the logs then cut back to the restored step by `history.Start.apply`) records
itself as the workdir's owner and writes config.json and the method's preparation. With several
processes, the decisions that must be the same on every process (the lock could be taken, every
checkpoint could be read, a stop signal arrived) are votes over the mesh (`all_processes`, `StopVote`),
so that every process stops at the same point, before any of them waits in a collective for the others.
"""

from __future__ import annotations

import os

import jax

from dsjax import schemes
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import interrupts
from dsjax.train import sharding as sharding_lib


class RunGuard:
  """The workdir side of one run: `with RunGuard(workdir) as guard:` around the run.

  Should the run fail while it holds the lock but before it recorded itself as the workdir's owner
  (`record_run_start`), the paths it created are removed again and the lock released: only a run that
  holds the lock removes them, never another run's.
  """

  def __init__(self, workdir: str):
    self.workdir = workdir
    # The paths the run creates before all checks have passed (the lock is taken first, Orbax creates
    # the checkpoint directory), where they are new; contents before their parent.
    self.created = [
      p
      for p in (
        os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR),
        os.path.join(workdir, checkpoint_lib.LOCK_FILE),
        workdir,
      )
      if not os.path.exists(p)
    ]
    self.lock: checkpoint_lib.WorkdirLock | None = None  # process 0's, once taken

  def __enter__(self) -> RunGuard:
    return self

  def __exit__(self, exc_type, exc, traceback) -> bool:
    if (
      exc_type is not None
      and self.lock is not None
      and not checkpoint_lib.WorkdirLock.owner_recorded(self.workdir)
    ):
      remove_if_unused(self.created)
      self.lock.release()
    return False

  def take_lock(self, is_chief: bool, mesh) -> None:
    self.lock = lock_workdir(self.workdir, is_chief, mesh)

  def record_run_start(self, config, prepared) -> None:
    """Every check has passed: process 0 records itself as the workdir's owner and writes the run's
    files (the method's preparation result, config.json). (The logs were cut back to the run's first
    step before, by `history.Start.apply`.)"""
    if self.lock is None:
      return
    self.lock.record_owner()
    if prepared is not None:
      schemes.save_preparation(config, self.workdir, prepared)
    with open(os.path.join(self.workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2))

  def release(self) -> None:
    """The run is over: the next run may take the workdir."""
    if self.lock is not None:
      self.lock.release()


def lock_workdir(workdir: str, is_chief: bool, mesh) -> checkpoint_lib.WorkdirLock | None:
  """Process 0 takes the workdir's lock; with several processes all of them learn whether it could,
  so that every process stops with the one-line error, before any of them reaches a collective."""
  lock, error = None, None
  if is_chief:
    try:
      lock = checkpoint_lib.WorkdirLock(workdir)
    except ValueError as e:
      error = e
  if not all_processes(error is None, mesh):
    raise error or ValueError(f'--workdir {workdir}: process 0 could not lock it (its error says why)')
  return lock


def all_processes(ok: bool, mesh) -> bool:
  """True on every process when `ok` is True on all of them (a vote; with one process, `ok`)."""
  if jax.process_count() == 1:
    return ok
  return not sharding_lib.read_vote(sharding_lib.max_over_processes(int(not ok), mesh))


def remove_if_unused(paths: list[str]) -> None:
  """Removes each path that is a file or an empty directory (in order: contents before their parent)."""
  for path in paths:
    if os.path.isfile(path):
      os.remove(path)
    elif os.path.isdir(path) and not os.listdir(path):
      os.rmdir(path)


class StopVote:
  """The stop signal of the run, the same on every process.

  Several processes stop together: each step the processes vote the signal they received (its number,
  0 for none; `max_over_processes`), and the vote is read one step later — the same step and signal on
  every process, without waiting for the device. With one process the signal counts at once.
  """

  def __init__(self, signals: interrupts.StopSignals, mesh):
    self.signals, self.mesh = signals, mesh
    self.several_processes = jax.process_count() > 1
    self.vote = None

  def after_step(self) -> int:
    """The signal to stop on after this step (0: go on)."""
    received = int(self.signals.received or 0)
    if not self.several_processes:
      return received
    agreed = 0 if self.vote is None else sharding_lib.read_vote(self.vote)
    self.vote = sharding_lib.max_over_processes(received, self.mesh)
    return agreed

  def received_here(self, signal_number: int) -> bool:
    """Whether this process received `signal_number` itself (rather than another process)."""
    return int(self.signals.received or 0) == signal_number
