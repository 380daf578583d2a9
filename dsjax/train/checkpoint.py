"""Orbax checkpoints of a run, the workdir's lock, and the checks that make a resume safe.

A checkpoint at step t holds everything a run needs to continue bit-for-bit, as three Orbax items:

  state  the train state (params, non-trainable model values, optimizer state, step, non-finite count)
  data   the JSON state of the training input pipeline
  run    JSON: the architecture it was trained with (`run_identity`) and a fingerprint of the state

Dropout keys are derived from (seed, step), so no RNG state needs saving beyond the step. Orbax writes
each step into a temporary directory and renames it when complete, so a killed save never leaves a
half-written step behind; a step that is nevertheless unreadable (a truncated or overwritten file, a
removed `_METADATA`) is reported in one line, moved to `WORKDIR/corrupt_checkpoints/`, and the run
resumes from the newest intact step; when none is intact, the run stops with one line and nothing is
moved (starting again is the user's choice, `--fresh`: `dsjax.train.history`). A checkpoint of another
architecture is an error that names the differing keys, before the workdir is touched.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from dsjax.models.config import RESUMABLE_KEYS
from dsjax.train import cli
from dsjax.train import state as state_lib

CHECKPOINT_DIR = 'checkpoints'
CORRUPT_DIR = 'corrupt_checkpoints'
EARLIER_DIR = 'earlier_runs'  # where `--fresh` keeps the history of the run it starts over
LOCK_FILE = '.dsjax.lock'
_LOCK_ATTEMPTS = 10  # of locking the file at the path (see WorkdirLock)
_FINGERPRINT_RTOL = 1e-4  # Restoring onto another mesh may sum in another order.


# ------------------------------------------------------------------------------------------------
# What a checkpoint must match, and how to tell that it is intact.
# ------------------------------------------------------------------------------------------------

# What a resumed run may change, and what it may not. The one list of it: docs/running.md states it and
# tests/e2e/test_reliability_history.py checks that it does. Every model key but `RESUMABLE_KEYS` (how a step
# is computed: regularisation, rematerialisation, precision, attention kernel, layer scan), and these:
# the dataset and sequence length (vocabulary, classes, position tables) and the optimizer (its state).
# Any other run key (learning rate, schedule, batch size, intervals, total_steps above the checkpoint's
# step) may change.
IDENTITY_KEYS = ('data.name', 'data.seq_len', 'optimizer.name')
# What a checkpoint records of tokenized text beyond the config (`DatasetInfo.checkpoint_identity`).
DATA_HASH_KEYS = ('data.corpus_sha256', 'data.tokenizer_sha256', 'data.vocab_size')


def resumable_model_keys() -> tuple[str, ...]:
  """The model keys a resumed run may change, as `model.<key>`."""
  return tuple(f'model.{key}' for key in RESUMABLE_KEYS)


def run_identity(config, data_info=None) -> dict[str, Any]:
  """The config keys a checkpoint's train state depends on: every model key but `RESUMABLE_KEYS`, and
  `IDENTITY_KEYS`; with `data_info` (a `dsjax.data.DatasetInfo`), also the hashes of tokenized text and
  of its tokenizer and the vocabulary (`DatasetInfo.checkpoint_identity`: none for byte-level TFDS text
  and images)."""
  model = {k: v for k, v in config.model.to_dict().items() if k not in RESUMABLE_KEYS}
  identity = {'model': model}
  for key in IDENTITY_KEYS:
    section, name = key.split('.')
    identity[key] = config[section].get(name)
  identity.update(data_info.checkpoint_identity() if data_info is not None else {})
  return json.loads(json.dumps(identity))


def _flatten(tree: dict, prefix: str = '') -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    name = f'{prefix}{key}'
    if isinstance(value, dict):
      flat.update(_flatten(value, f'{name}.'))
    else:
      flat[name] = value
  return flat


def identity_differences(saved: dict, current: dict) -> list[str]:
  """'key: saved → current' for every key whose value differs (missing keys included)."""
  saved, current = _flatten(saved), _flatten(current)
  return [
    f'{k}: {saved.get(k, "(absent)")!r} → {current.get(k, "(absent)")!r}'
    for k in sorted(set(saved) | set(current))
    if saved.get(k, '(absent)') != current.get(k, '(absent)')
  ]


@jax.jit
def state_fingerprint(state) -> jax.Array:
  """Σ|x| over every array of the state, in float32: restored bits that differ from the saved ones
  (a zero-filled or overwritten file that still decodes) change it."""
  return sum(jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in jax.tree.leaves(state))


# ------------------------------------------------------------------------------------------------
# The workdir's single owner.
# ------------------------------------------------------------------------------------------------


class WorkdirLock:
  """An exclusive `flock` on WORKDIR/.dsjax.lock held for the life of a run: a second run on the same
  workdir fails at once, naming the owner. The kernel drops the lock when the process dies, so a killed
  run never leaves a stale lock. A file system without `flock` (some network mounts) is a one-line
  error rather than an unprotected run."""

  def __init__(self, workdir: str):
    if os.path.exists(workdir) and not os.path.isdir(workdir):
      raise ValueError(f'--workdir {workdir} is a file, not a directory')
    self.path = os.path.join(workdir, LOCK_FILE)
    # A run whose checks fail removes the lock file it created (while holding it). A run that opened
    # that file just before gets its lock only after the removal, on a file no longer in the workdir,
    # where a third run could lock a new one: so the lock counts only if the file locked is still the
    # one at the path, else it is taken again.
    for _ in range(_LOCK_ATTEMPTS):
      self._lock(workdir)
      if self._locked_file_is_current():
        return
      self.file.close()
    raise ValueError(
      f'--workdir {workdir}: {self.path} kept being replaced while it was locked; '
      'is another program removing it?'
    )

  def _lock(self, workdir: str):
    try:
      os.makedirs(workdir, exist_ok=True)
      self.file = open(self.path, 'a+')
    except OSError as e:
      raise ValueError(f'--workdir {workdir}: cannot create {self.path} ({e.strerror})') from None
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self.file.seek(0)
      owner = self.file.read().strip() or 'another process'
      self.file.close()
      raise ValueError(
        f'--workdir {workdir} is in use by a running dsjax run ({owner}); wait for it '
        'to finish or choose another --workdir'
      ) from None
    except OSError as e:  # e.g. a file system without flock (ENOSYS, ENOLCK)
      self.file.close()
      raise ValueError(
        f'--workdir {workdir}: its file system cannot lock {self.path} ({e.strerror}); '
        'choose a --workdir on a local or flock-capable file system'
      ) from None

  def _locked_file_is_current(self) -> bool:
    try:
      return os.stat(self.path).st_ino == os.fstat(self.file.fileno()).st_ino
    except OSError:  # removed, or the workdir replaced
      return False

  def record_owner(self):
    """Writes who holds the lock (for the message of a second run); called once every check has
    passed, so that a run which fails its checks leaves the workdir as it was."""
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f'pid {os.getpid()} on {socket.gethostname()} since {time.strftime("%Y-%m-%d %H:%M:%S")}')
    self.file.flush()

  @staticmethod
  def owner_recorded(workdir: str) -> bool:
    """Whether a run on `workdir` got past its checks (`record_owner`), now or before."""
    path = os.path.join(workdir, LOCK_FILE)
    return os.path.isfile(path) and os.path.getsize(path) > 0

  @staticmethod
  def live_owner(workdir: str) -> str | None:
    """Who holds the lock of `workdir` now ('another process' if it does not say), or None if no live
    run holds it. Creates nothing."""
    try:
      with open(os.path.join(workdir, LOCK_FILE)) as f:
        try:
          fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
          return f.read().strip() or 'another process'
        except OSError:  # a file system without flock: no run can hold it there either
          return None
        fcntl.flock(f, fcntl.LOCK_UN)
        return None
    except OSError:  # no lock file
      return None

  def release(self):
    if not self.file.closed:
      fcntl.flock(self.file, fcntl.LOCK_UN)
      self.file.close()


# ------------------------------------------------------------------------------------------------
# Checkpoints.
# ------------------------------------------------------------------------------------------------


class Checkpointer:
  def __init__(self, workdir: str, *, keep: int, create: bool = True):
    self.workdir = os.path.abspath(workdir)
    self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
    self.manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.join(self.workdir, CHECKPOINT_DIR), options=self._options)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps(), reverse=True)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def _read_run_item(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))['run']

  def check_compatible(
    self, config, *, data_info=None, read_by: str | None = None, remedy: str | None = None
  ) -> int | None:
    """Before anything is written: the newest step whose run record can be read must be of this
    architecture and data (`run_identity` with `data_info`; else a ValueError naming the differing keys)
    and, for a run that resumes it, not beyond `total_steps`. Returns that step, or None for a fresh
    workdir. `read_by`: the flag of a tool that only reads the checkpoint (e.g. '--checkpoint'), for its
    message, with `remedy` (what to do) instead of the default advice."""
    for step in self.steps():
      try:
        saved = self._read_run_item(step)['identity']
      except Exception:  # pylint: disable=broad-except
        continue  # Unreadable: `restore` reports it and falls back.
      differences = identity_differences(saved, run_identity(config, data_info))
      if differences:
        where = f'{read_by}={self.workdir}' if read_by else self.workdir
        remedy = remedy or (
          'pass the --config and --config.* overrides it was trained with (its config.json lists them)'
          if read_by
          else "use a new --workdir or the checkpoint's settings"
        )
        other = (
          'another architecture'
          if not all(d.split(':')[0] in ('data.name', *DATA_HASH_KEYS) for d in differences)
          else 'other data (text or tokenizer)'
        )
        raise ValueError(
          f'{where} holds a checkpoint (step {step}) of {other}; differing '
          f'keys: {"; ".join(differences)}; {remedy}'
        )
      if read_by is None and step > config.total_steps:
        raise ValueError(
          f'total_steps ({config.total_steps}) is below the step of the checkpoint in '
          f'{self.workdir} ({step}); raise total_steps or use a new --workdir'
        )
      return step
    return None

  def restore_step(self, step: int, abstract_state: Any = None) -> tuple[Any, dict]:
    """(train state, input-pipeline state) of `step`, checked against its saved fingerprint; without
    `abstract_state` the arrays come back as saved."""
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        run=ocp.args.JsonRestore(),
      ),
    )
    fingerprint, saved = float(state_fingerprint(restored['state'])), restored['run']['fingerprint']
    if not np.isclose(fingerprint, saved, rtol=_FINGERPRINT_RTOL, atol=0.0):
      raise ValueError(
        f'restored values differ from the saved ones (fingerprint {fingerprint:.6g}, saved {saved:.6g})'
      )
    return restored['state'], restored['data']

  def move_steps(self, steps: list[int], target_dir: str, name=lambda step: str(step)) -> list[str]:
    """Moves the directories of `steps` into `target_dir` (as `name(step)`), then re-reads the list of
    steps; returns where each went."""
    os.makedirs(target_dir, exist_ok=True)
    targets = []
    for step in steps:
      targets.append(os.path.join(target_dir, name(step)))
      shutil.move(os.path.join(self.workdir, CHECKPOINT_DIR, str(step)), targets[-1])
    self.manager.reload()
    return targets

  def restore(
    self,
    abstract_state: Any,
    *,
    set_aside: bool = True,
    fresh: bool = False,
    all_ok: Callable[[bool], bool] = lambda ok: ok,
  ) -> tuple[Any, dict] | None:
    """Restores the newest intact step onto the shardings carried by `abstract_state` (a tree of
    ShapeDtypeStructs); the unreadable steps newer than it are reported in one line each and moved to
    WORKDIR/corrupt_checkpoints/ (by the chief, `set_aside`). None for a workdir without checkpoints.

    A workdir whose every step is unreadable is a ValueError naming them, and nothing is moved: starting
    again from step 0 there is the user's choice (`fresh`: then None, and the steps stay where they are
    for the caller to keep them, see `history.Start`).

    Several processes: `all_ok(ok)` is True on every process when `ok` is True on all of them (the
    loop's `max_over_processes` vote), so all restore the same step, and one that any process cannot
    read is skipped by all. The chief moves the unreadable steps aside between two votes, the second a
    barrier after which every process re-reads the list of steps. A failure of the machine rather than
    of the files (`_machine_failure`: out of memory, access denied) on any process is raised instead,
    on all of them, and moves nothing. What this covers is a failure that each process meets and
    returns from, such as a missing or corrupted file they all read; a failure of one process inside
    Orbax's own cross-process restore (its barrier) would leave the others waiting."""
    unreadable: list[tuple[int, str]] = []  # (step, why), newest first
    for step in self.steps():
      try:
        restored, error = self.restore_step(step, abstract_state), None
      except Exception as e:  # pylint: disable=broad-except
        restored, error = None, e
      if all_ok(error is None):
        self._set_aside_unreadable(unreadable, set_aside, all_ok)
        return restored
      # Out of memory or denied access says nothing about the step's files: setting it aside would drop
      # good checkpoints one after another, so every process stops instead.
      machine_failed = error is not None and _machine_failure(error)
      reason = describe_error(error) if error else 'another process could not read it'
      if not all_ok(not machine_failed):
        where = reason if machine_failed else 'on another process: see its log'
        raise ValueError(
          f'could not restore checkpoint step {step} of {self.workdir} ({where}): out of memory or '
          f'access denied, nothing was moved aside; free memory or fix the permissions and rerun, or '
          f'move {os.path.join(self.workdir, CHECKPOINT_DIR, str(step))} away to use the previous '
          f'step'
        ) from error
      unreadable.append((step, reason))
    if unreadable and not fresh:
      steps = '; '.join(f'step {step} ({reason[:160]})' for step, reason in unreadable)
      raise ValueError(
        f'every checkpoint in {os.path.join(self.workdir, CHECKPOINT_DIR)} is unreadable: {steps}; '
        'nothing was changed. Restore them from a copy and rerun, or rerun with --fresh to train '
        f'again from step 0 (the unreadable checkpoints and the logs are then moved to '
        f'{os.path.join(self.workdir, EARLIER_DIR)}/)'
      )
    return None

  def _set_aside_unreadable(
    self, unreadable: list[tuple[int, str]], set_aside: bool, all_ok: Callable[[bool], bool]
  ):
    """Moves the unreadable steps newer than the one restored to WORKDIR/corrupt_checkpoints/ (the
    chief; every process waits for it and re-reads the list of steps) and says so, one line each."""
    if not unreadable:
      return
    stamp = time.strftime('%Y%m%d-%H%M%S')
    steps = [step for step, _ in unreadable]
    targets = (
      self.move_steps(steps, os.path.join(self.workdir, CORRUPT_DIR), lambda s: f'{s}-{stamp}')
      if set_aside
      else [None] * len(steps)
    )
    all_ok(True)  # Every process waits here until the steps are moved.
    self.manager.reload()
    for (step, reason), target in zip(unreadable, targets):
      where = f'moved to {target}' if target else 'left in place by this process'
      logging.warning(
        'Checkpoint step %d of %s is unreadable (%s); %s, resumed from an earlier step',
        step,
        self.workdir,
        reason,
        where,
      )

  def save(self, step: int, state: Any, data_state: dict, identity: dict):
    """Saves step `step` asynchronously (the caller decides when: `loop.py`)."""
    run = {'identity': identity, 'fingerprint': float(state_fingerprint(state))}
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), run=ocp.args.JsonSave(run)
      ),
      force=True,
    )

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def describe_error(error: BaseException) -> str:
  """`Type: message` of a failed restore, in one line and without the object reprs (`<bound method
  ...>`) that TensorStore's messages carry; with the innermost cause when it says more."""

  def clean(e):
    text = re.sub(r'<(bound method|function|built-in method)[^>]*>?', '', str(e))
    text = re.sub(r'\s*See full TensorStore details:?\s*', ' ', text)
    return f'{type(e).__name__}: {" ".join(text.split())}'.rstrip(': ').rstrip('.')

  chain = list(cli.errors_in_chain(error))
  parts = [clean(chain[0])] + ([clean(chain[-1])] if len(chain) > 1 else [])
  return '; '.join(parts)[:300]


def _machine_failure(error: BaseException) -> bool:
  """A restore failure that says nothing about the checkpoint's files: host or device memory ran out, or
  the files may not be read (also as the storage layer's status text, which Orbax passes on)."""
  return any(
    isinstance(e, (MemoryError, PermissionError)) or cli.out_of_memory(e) or 'PERMISSION_DENIED' in str(e)
    for e in cli.errors_in_chain(error)
  )


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def restore_model(
  config, data_info, workdir: str, flag: str, remedy: str | None = None, step: int | None = None
):
  """The NNX model of a training run at the latest intact checkpoint in `workdir`, or at `step` (for
  `dsjax.export --workdir`, `dsjax.moments --checkpoint`; `flag` names it in errors): the train state is
  restored onto one device and merged into a model built from `config`, with the result of its method's
  preparation step that the run saved. `remedy`: the advice of `check_compatible`'s message."""
  no_checkpoint = ValueError(f'{flag}={workdir} holds no checkpoint (looked in {workdir}/{CHECKPOINT_DIR})')
  if not os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):  # Checked first: creates nothing.
    raise no_checkpoint
  checkpointer = Checkpointer(workdir, keep=1, create=False)
  try:
    if checkpointer.latest_step() is None:
      raise no_checkpoint
    checkpointer.check_compatible(config, data_info=data_info, read_by=flag, remedy=remedy)
    prepared = state_lib.method_preparation(config, data_info, workdir)
    setup = state_lib.make_setup(config, data_info, prepared)
    # Every array onto this process's first device, whatever mesh the run saved it from (without a
    # sharding, Orbax would restore onto the saved one and refuse a different device count).
    abstract = jax.eval_shape(setup.create_state)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = abstract_with_shardings(abstract, jax.tree.map(lambda _: one_device, abstract))
    if step is None:
      restored = checkpointer.restore(target, set_aside=False)
    elif step in checkpointer.steps():
      restored = checkpointer.restore_step(step, target)
    else:
      raise ValueError(
        f'{flag}={workdir} holds no checkpoint of step {step}; it holds {checkpointer.steps()}'
      )
  finally:
    checkpointer.close()
  if restored is None:
    raise ValueError(f'{flag}={workdir} holds no intact checkpoint (see the warnings above)')
  state, _ = restored
  logging.info('Restored step %d from %s', int(state['step']), workdir)
  return nnx.merge(setup.graphdef, state['params'], state['rest'])
