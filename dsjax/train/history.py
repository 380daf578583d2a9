"""The history a run leaves in its workdir, and the checks that keep a later run from losing it.

A workdir holds one run: `config.json`, `checkpoints/`, the logs `metrics.jsonl` and `moments.jsonl`
(one JSON row per logged step, or per statistic) and `tensorboard/`. A rerun continues that run, so
before anything in the workdir changes (`Start.check`):

- Its layout is checked (`check_layout`): a file where a directory belongs or the reverse, a part
  that may not be written, or another tool's output is one line, before anything is compiled.
- The logs are cut back to the step the restored checkpoint proves, never further: the rows after it
  are logged again by the resumed run. A torn or unparsable tail (a line cut by a crash, the NUL bytes a
  host failure leaves, a `null` row) is cut back to the last complete row that step covers, with one
  log line; a damaged row followed by rows that step covers is an error naming the file and line.
- Logs without any checkpoint (a run stopped before its first checkpoint, or one whose checkpoints
  are all unreadable: `checkpoint.Checkpointer.restore`) are the history of an earlier run. Starting
  again from step 0 over it is the user's choice (`--fresh`): its checkpoints, logs, TensorBoard files
  and config are then moved to WORKDIR/earlier_runs/<time>/ first, never deleted. `--fresh` on a workdir
  with an intact checkpoint is an error, so that a launcher which keeps the flag cannot restart a
  preempted run from scratch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Callable

from absl import logging

from dsjax import instrument as instrument_lib
from dsjax import schemes
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import metrics as metrics_lib

LOGS = (metrics_lib.METRICS_FILE, instrument_lib.MOMENTS_FILE)
# The stability monitor's flags: raised/cleared events and one summary row per run segment, appended by
# a resumed run (not cut back: a flag is an event of the run that saw it, not a per-step row).
MONITOR_LOG = instrument_lib.MONITOR_FILE
CONFIG_FILE = 'config.json'
TENSORBOARD_DIR = 'tensorboard'
EXPORT_MARKER = 'export.json'  # what `dsjax.export` writes next to its checkpoint (see `check_not_a_run`)
# What each path of a workdir must be, if it exists.
FILES = (CONFIG_FILE, *LOGS, MONITOR_LOG, checkpoint_lib.LOCK_FILE)
DIRECTORIES = (
  checkpoint_lib.CHECKPOINT_DIR,
  checkpoint_lib.CORRUPT_DIR,
  checkpoint_lib.EARLIER_DIR,
  TENSORBOARD_DIR,
)


# ------------------------------------------------------------------------------------------------
# Layout.
# ------------------------------------------------------------------------------------------------


def check_layout(workdir: str, *, enabled: bool = True, all_ok: Callable[[bool], bool] = lambda ok: ok):
  """A ValueError naming the path unless the parts of `workdir` that exist are what a run needs them
  to be (files, directories, writable) and it holds no other tool's output. Reads only. With several
  processes the chief checks (`enabled`) and `all_ok` (a vote, see `Checkpointer.restore`) stops all."""
  error = None
  if enabled:
    try:
      _check_layout(workdir)
    except ValueError as e:
      error = e
  if not all_ok(error is None):
    raise error or ValueError(f'--workdir {workdir}: process 0 found it unusable (its error says why)')


def _check_layout(workdir: str):
  if os.path.exists(os.path.join(workdir, EXPORT_MARKER)):
    raise ValueError(
      f'--workdir {workdir} holds a dsjax.export output ({EXPORT_MARKER}), not a training '
      'run; choose another --workdir'
    )
  for name in FILES + DIRECTORIES:
    path = os.path.join(workdir, name)
    if not os.path.lexists(path):
      continue
    if name in FILES and not os.path.isfile(path):
      raise ValueError(
        f'--workdir {workdir}: {path} is not a file (a run writes its {name} there); move '
        'it away or choose another --workdir'
      )
    if name in DIRECTORIES and not os.path.isdir(path):
      raise ValueError(
        f'--workdir {workdir}: {path} is not a directory (a run keeps its {name} there); '
        'move it away or choose another --workdir'
      )
    if not os.access(path, os.W_OK | (os.X_OK if name in DIRECTORIES else 0)):
      raise ValueError(
        f'--workdir {workdir}: {path} cannot be written; fix its permissions or choose another --workdir'
      )
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise ValueError(
      f'--workdir {workdir} cannot be written; fix its permissions or choose another --workdir'
    )


def check_not_a_run(flag: str, path: str, own_marker: str | None = None):
  """A ValueError naming `flag` if the directory `path` holds a training run (its `config.json`,
  `checkpoints/` or lock; a live lock names its owner), unless `own_marker` (a file the calling tool
  writes there) says that it is this tool's own earlier output, with no checkpoints or lock."""
  if not os.path.isdir(path):
    return
  owner = checkpoint_lib.WorkdirLock.live_owner(path)
  if owner is not None:
    raise ValueError(f'{flag}={path} is the workdir of a running dsjax run ({owner}); name another directory')
  run_parts = [
    name
    for name in (checkpoint_lib.CHECKPOINT_DIR, checkpoint_lib.LOCK_FILE)
    if os.path.lexists(os.path.join(path, name))
  ]
  own = own_marker is not None and os.path.isfile(os.path.join(path, own_marker))
  if os.path.lexists(os.path.join(path, CONFIG_FILE)) and not own:
    run_parts.insert(0, CONFIG_FILE)
  if run_parts:
    raise ValueError(
      f'{flag}={path} holds a training run ({", ".join(run_parts)}), which this would '
      'overwrite; name another directory'
    )


# ------------------------------------------------------------------------------------------------
# Logs.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Log:
  """What a resumed run keeps of one log file: its rows up to `step` (`kept`, the lines as read)."""

  path: str
  step: int
  kept: list[bytes]
  beyond: int = 0  # rows after `step`, which the run logs again
  damaged_from: int = 0  # the first damaged line of a damaged tail (1-based), 0 if none
  damaged_lines: int = 0
  content: bool = False  # anything but blank lines

  @property
  def changes(self) -> bool:
    return bool(self.beyond or self.damaged_lines)


def _row_step(line: bytes) -> int | None:
  """The step of a complete log row, or None if the line is not one (torn, unparsable, not an object
  with an integer 'step': e.g. `null`, NUL bytes)."""
  if not line.endswith(b'\n'):
    return None  # cut short
  try:
    row = json.loads(line)
  except ValueError:  # also UnicodeDecodeError
    return None
  step = row.get('step') if isinstance(row, dict) else None
  return step if isinstance(step, int) and not isinstance(step, bool) else None


def read_log(path: str, step: int) -> Log:
  """The rows of the log at `path` that a run resumed at `step` keeps; a ValueError naming the file and
  line for a damaged row with a kept row after it (the damage is not a torn tail)."""
  log = Log(path, step, [])
  if not os.path.exists(path):
    return log
  with open(path, 'rb') as f:
    lines = f.read().splitlines(keepends=True)
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    log.content = True
    row_step = _row_step(line)
    if row_step is None:
      log.damaged_from = log.damaged_from or number
      log.damaged_lines += 1
    elif row_step > step:
      log.beyond += 1
    elif log.damaged_from:
      raise ValueError(
        f'{path}, line {log.damaged_from}: not a complete JSON row, but rows follow it '
        f'(line {number}, step {row_step}); repair or remove that line and rerun'
      )
    else:
      log.kept.append(line)
  return log


def _cut(log: Log):
  """Replaces the file by its kept rows, atomically."""
  with open(log.path + '.tmp', 'wb') as f:
    f.writelines(log.kept)
  os.replace(log.path + '.tmp', log.path)
  if log.damaged_lines:
    logging.warning(
      '%s: cut back to its last complete row of step <= %d (from line %d on, %d damaged '
      'line(s): cut short or unparsable, e.g. by a crash)',
      log.path,
      log.step,
      log.damaged_from,
      log.damaged_lines,
    )


# ------------------------------------------------------------------------------------------------
# The start of a run: resume, or start again over an earlier history.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Start:
  """How a run starts in its workdir, from the step it restored: `check` reads everything and raises
  before anything is written; `apply` then cuts the logs (or, with `fresh`, keeps the earlier history
  under WORKDIR/earlier_runs/)."""

  workdir: str
  logs: list[Log]
  fresh_steps: list[int]  # the unreadable checkpoint steps that `fresh` moves with the logs

  @classmethod
  def check(
    cls,
    workdir: str,
    step: int,
    checkpointer: checkpoint_lib.Checkpointer,
    *,
    fresh: bool = False,
    enabled: bool = True,
    all_ok: Callable[[bool], bool] = lambda ok: ok,
  ) -> Start:
    """`step`: the restored step (0 for none). With several processes the chief reads the logs
    (`enabled`) and `all_ok` (a vote) stops every process if it fails."""
    start, error = cls(workdir, [], []), None
    try:
      if fresh and step:
        raise ValueError(
          f'--fresh: {workdir} holds an intact checkpoint (step {step}); rerun without '
          '--fresh to resume it, or choose another --workdir'
        )
      start.fresh_steps = checkpointer.steps() if fresh else []
      if enabled:
        start.logs = [read_log(os.path.join(workdir, name), step) for name in LOGS]
        earlier = [log for log in start.logs if log.content]
        if not step and earlier and not fresh:
          names = ', '.join(os.path.basename(log.path) for log in earlier)
          raise ValueError(
            f'--workdir {workdir} holds the history of an earlier run ({names}) but no checkpoint to '
            'resume it from; rerun with --fresh to train again from step 0 (that history is then '
            f'moved to {os.path.join(workdir, checkpoint_lib.EARLIER_DIR)}/), or choose another '
            '--workdir'
          )
    except ValueError as e:
      error = e
    if not all_ok(error is None):
      raise error or ValueError(
        f'--workdir {workdir}: process 0 could not resume its history (its error says why)'
      )
    return start

  def apply(
    self,
    checkpointer: checkpoint_lib.Checkpointer,
    *,
    enabled: bool = True,
    barrier: Callable[[bool], bool] = lambda ok: ok,
  ):
    """Changes the workdir (every check has passed): cuts the logs back to the restored step, or moves
    the earlier history aside (`fresh`). Runs on every process; the chief writes (`enabled`)."""
    if self.fresh_steps or any(log.content and not log.step for log in self.logs):
      target = os.path.join(self.workdir, checkpoint_lib.EARLIER_DIR, time.strftime('%Y%m%d-%H%M%S'))
      if enabled:
        if self.fresh_steps:
          checkpointer.move_steps(self.fresh_steps, os.path.join(target, checkpoint_lib.CHECKPOINT_DIR))
        for name in (*LOGS, MONITOR_LOG, TENSORBOARD_DIR, CONFIG_FILE, schemes.PREPARATION_FILE):
          if os.path.lexists(os.path.join(self.workdir, name)):
            os.makedirs(target, exist_ok=True)
            shutil.move(os.path.join(self.workdir, name), os.path.join(target, name))
        logging.warning('Started again from step 0 (--fresh); the earlier history is in %s', target)
    else:
      for log in self.logs:
        if log.changes:
          _cut(log)
    barrier(True)  # Every process waits for the chief, then re-reads the list of steps.
    checkpointer.manager.reload()
