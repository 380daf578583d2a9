"""A run never loses good work: non-finite steps, signals, kills during saves, corrupt checkpoints,
another architecture in the workdir, two runs on one workdir, and honest progress numbers."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import cli, loop
from dsjax.train import metrics as metrics_lib
from tests.helpers import REPO_ROOT, tiny_config

ROOT = str(REPO_ROOT)
# One device, in this process and in the training subprocesses, so their states compare bit for bit
# (and compile in seconds).
ONE_DEVICE = jax.devices()[:1]
SUBPROCESS_ENV = {
  **os.environ,
  'XLA_FLAGS': os.environ.get('XLA_FLAGS', '').replace('--xla_force_host_platform_device_count=8', ''),
  'JAX_PLATFORMS': 'cpu',
}


def _train(config, workdir):
  return loop.train_and_evaluate(config, str(workdir), devices=ONE_DEVICE)


def _config(**overrides):
  config = tiny_config('gpt', depth=1, width=32, num_heads=2, dropout=0.1)  # Dropout keys replay too.
  config.log_every, config.checkpoint_every, config.eval_every = 1, 2, 1000
  config.optimizer.schedule, config.optimizer.warmup_steps = 'constant', 0  # Same updates for any length.
  for key, value in overrides.items():
    section, _, name = key.rpartition('.')
    (config[section] if section else config)[name] = value
  return config


def _strict_json_rows(path):
  def reject(constant):
    raise ValueError(f'{path} holds {constant}, which is not JSON')

  with open(path) as f:
    return [json.loads(line, parse_constant=reject) for line in f]


def _saved_state(workdir, step):
  checkpointer = checkpoint_lib.Checkpointer(str(workdir), keep=100, create=False)
  state, data_state = checkpointer.restore_step(step)
  checkpointer.close()
  return state, data_state


def _assert_same_state(workdir_a, workdir_b, step):
  (state_a, data_a), (state_b, data_b) = _saved_state(workdir_a, step), _saved_state(workdir_b, step)
  assert data_a == data_b
  for a, b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _steps(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit())


def _snapshot(path):
  return {
    os.path.relpath(os.path.join(d, f), path): (
      os.path.getsize(os.path.join(d, f)),
      os.path.getmtime(os.path.join(d, f)),
    )
    for d, _, files in os.walk(path)
    for f in files
  }


# ------------------------------------------------------------------------------------------------
# Non-finite loss or gradient.
# ------------------------------------------------------------------------------------------------


def test_nonfinite_step_stops_the_run_without_saving_it(tmp_path):
  config = _config(total_steps=8, **{'optimizer.lr': 1e6, 'instrument.every': 1})
  with pytest.raises(cli.Exit) as stop:
    _train(config, tmp_path)
  message = str(stop.value)
  assert stop.value.status == 3 and '\n' not in message
  assert message.startswith('step ')
  assert 'is nan' in message or 'is inf' in message
  assert 'first non-finite statistic: ' in message  # Instrumentation on: names layer and site.
  bad_step = int(message.split(':')[0].split()[1])
  assert all(step < bad_step for step in _steps(tmp_path))
  for step in _steps(tmp_path):
    state, _ = _saved_state(tmp_path, step)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  _strict_json_rows(tmp_path / 'metrics.jsonl')
  _strict_json_rows(tmp_path / 'moments.jsonl')


def test_nonfinite_steps_are_skipped_and_counted(tmp_path):
  config = _config(total_steps=6, on_nonfinite='skip', **{'optimizer.lr': 1e6})
  _train(config, tmp_path)
  rows = _strict_json_rows(tmp_path / 'metrics.jsonl')
  assert [r['step'] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert rows[-1]['train/nonfinite_steps'] >= 1
  assert rows[-1]['train/nonfinite_steps'] == sum(r['train/nonfinite'] for r in rows)
  state, _ = _saved_state(tmp_path, 6)
  assert int(state['step']) == 6 and int(state['nonfinite_steps']) == rows[-1]['train/nonfinite_steps']
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state['params']))


# ------------------------------------------------------------------------------------------------
# Signals and kills: a real training subprocess.
# ------------------------------------------------------------------------------------------------


def _cli_args(workdir, total_steps, checkpoint_every):
  return [
    sys.executable,
    '-m',
    'dsjax.main',
    '--config=configs/gpt_preln.py',
    f'--workdir={workdir}',
    f'--config.total_steps={total_steps}',
    f'--config.checkpoint_every={checkpoint_every}',
    '--config.model.depth=1',
    '--config.model.width=32',
    '--config.model.num_heads=2',
    '--config.model.dropout=0.1',
    '--config.batch_size=8',
    '--config.data.seq_len=16',
    '--config.eval_every=100000',
    '--config.log_every=1',
    '--config.optimizer.schedule=constant',
    '--config.optimizer.warmup_steps=0',
    '--config.keep_checkpoints=100',
  ]


def _start(workdir, total_steps, checkpoint_every):
  return subprocess.Popen(
    _cli_args(workdir, total_steps, checkpoint_every),
    cwd=ROOT,
    text=True,
    env=SUBPROCESS_ENV,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
  )


def _wait_until(condition, process, timeout=120):
  deadline = time.time() + timeout
  while time.time() < deadline and process.poll() is None:
    if condition():
      return
    time.sleep(0.05)
  raise AssertionError(f'waited {timeout}s in vain; the run exited with {process.poll()}')


def _has_rows(workdir, rows):
  path = os.path.join(workdir, 'metrics.jsonl')
  return lambda: os.path.exists(path) and sum(1 for _ in open(path)) >= rows


@pytest.mark.slow  # Kept out of the default suite for its time (> 20 s).
def test_sigterm_saves_the_current_step_and_the_rerun_resumes_bit_exactly(tmp_path):
  interrupted = tmp_path / 'interrupted'
  process = _start(interrupted, total_steps=100000, checkpoint_every=100000)
  _wait_until(_has_rows(interrupted, 3), process)
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 128 + signal.SIGTERM, stderr
  last = stderr.strip().splitlines()[-1]
  assert last.startswith('dsjax.main: stopped by SIGTERM after step ') and 'Traceback' not in stderr
  stopped_at = int(last.split('after step ')[1].split(';')[0])
  assert _steps(interrupted) == [stopped_at]
  # The rerun continues from the saved step; a run that was never stopped gets the same state.
  config = _config(total_steps=stopped_at + 2, checkpoint_every=100000, keep_checkpoints=100)
  _train(config, interrupted)
  straight = tmp_path / 'straight'
  _train(config, straight)
  _assert_same_state(interrupted, straight, stopped_at + 2)
  rows = [r['step'] for r in _strict_json_rows(interrupted / 'metrics.jsonl')]
  assert rows == sorted(set(rows))  # No duplicate rows from the resumed part.


@pytest.mark.slow  # Kept out of the default suite for its time (~35 s).
@pytest.mark.parametrize('kills', [2])
def test_repeated_kill_9_during_saves_loses_nothing(tmp_path, kills):
  killed = tmp_path / 'killed'
  rng = np.random.default_rng(0)
  for _ in range(kills):
    process = _start(killed, total_steps=100000, checkpoint_every=1)
    before = max(_steps(killed), default=0) if (killed / 'checkpoints').exists() else 0
    _wait_until(
      lambda: (killed / 'checkpoints').exists() and max(_steps(killed), default=0) > before, process
    )
    time.sleep(rng.uniform(0.0, 0.5))  # Checkpoints every step: the kill lands in or between saves.
    process.kill()
    process.wait()
    assert max(_steps(killed)) > before
  final = max(_steps(killed)) + 2
  config = _config(total_steps=final, checkpoint_every=100000, keep_checkpoints=100)
  _train(config, killed)
  straight = tmp_path / 'straight'
  _train(config, straight)
  _assert_same_state(killed, straight, final)


# ------------------------------------------------------------------------------------------------
# Checkpoints: corrupt latest step, another architecture, total_steps below the checkpoint.
# ------------------------------------------------------------------------------------------------


def _truncate(path):
  with open(path, 'r+b') as f:
    f.truncate(max(os.path.getsize(path) // 2, 1))


def _zero_fill(path):
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.write(b'\0' * size)


def _largest_file(directory):
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize('damage', ['truncate', 'zero_fill', 'remove_metadata'])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_step(tmp_path, four_step_run, damage):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  latest = workdir / 'checkpoints' / '4'
  if damage == 'remove_metadata':
    os.remove(latest / '_CHECKPOINT_METADATA')
    shutil.rmtree(latest / 'state' / '_METADATA', ignore_errors=True)
    for metadata in latest.glob('state/_METADATA'):
      os.remove(metadata)
  else:
    (_truncate if damage == 'truncate' else _zero_fill)(_largest_file(latest / 'state'))
  _train(_config(total_steps=4, keep_checkpoints=5), workdir)
  assert os.listdir(workdir / 'corrupt_checkpoints')[0].startswith('4-')
  _assert_same_state(workdir, four_step_run, 4)  # Retrained from step 2 to the same step 4.


@pytest.mark.parametrize(
  'failure',
  [
    MemoryError(),
    RuntimeError('RESOURCE_EXHAUSTED: Out of memory'),
    PermissionError(errno.EACCES, 'Permission denied'),
  ],
)
def test_a_restore_that_runs_out_of_memory_moves_nothing_aside(tmp_path, four_step_run, monkeypatch, failure):
  """Out of memory or denied access is the machine's failure, not the files': the step is not set aside
  (which would drop every good checkpoint in turn), the run stops with one line naming the step."""
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  before = _snapshot(workdir)

  def fail(self, step, abstract_state=None):
    raise failure

  monkeypatch.setattr(checkpoint_lib.Checkpointer, 'restore_step', fail)
  with pytest.raises(ValueError, match='could not restore checkpoint step 4 of') as error:
    _train(_config(total_steps=6, keep_checkpoints=5), workdir)
  assert '\n' not in str(error.value) and error.value.__cause__ is failure
  after = _snapshot(workdir)
  after.pop(checkpoint_lib.LOCK_FILE)
  before.pop(checkpoint_lib.LOCK_FILE)
  assert after == before


@pytest.mark.parametrize(
  'key,value', [('model.num_heads', 4), ('model.width', 64), ('model.block', 'postln')]
)
def test_checkpoint_of_another_architecture_is_refused_before_anything_is_written(
  tmp_path, four_step_run, key, value
):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  before = _snapshot(workdir)
  with pytest.raises(ValueError, match=key.replace('.', r'\.')) as error:
    _train(_config(total_steps=6, **{key: value}), workdir)
  assert 'another architecture' in str(error.value) and '\n' not in str(error.value)
  after = _snapshot(workdir)
  after.pop(checkpoint_lib.LOCK_FILE)
  before.pop(checkpoint_lib.LOCK_FILE)
  assert after == before  # config.json included.


def test_failing_rerun_leaves_the_workdir_as_it_was(tmp_path, four_step_run):
  workdir = tmp_path / 'run'
  shutil.copytree(four_step_run, workdir)
  before = _snapshot(workdir)
  with pytest.raises(ValueError, match='total_steps'):  # Below the checkpoint's step.
    _train(_config(total_steps=3), workdir)
  with pytest.raises(ValueError, match='warmup_steps'):  # A check that needs the schedule.
    _train(_config(total_steps=6, **{'optimizer.warmup_steps': 6, 'optimizer.schedule': 'cosine'}), workdir)
  assert _snapshot(workdir) == before


def test_a_workdir_that_cannot_be_locked_is_a_one_line_error(tmp_path, monkeypatch):
  def no_flock(*args):
    raise OSError(errno.ENOSYS, 'Function not implemented')

  monkeypatch.setattr(checkpoint_lib.fcntl, 'flock', no_flock)
  with pytest.raises(ValueError, match='its file system cannot lock') as error:
    checkpoint_lib.WorkdirLock(str(tmp_path / 'run'))
  assert str(tmp_path / 'run') in str(error.value) and '\n' not in str(error.value)


def test_a_second_run_on_a_live_workdir_fails_at_once(tmp_path):
  owner = checkpoint_lib.WorkdirLock(str(tmp_path))
  owner.record_owner()
  try:
    with pytest.raises(ValueError, match='in use by a running dsjax run') as error:
      _train(_config(total_steps=2), tmp_path)
    assert f'pid {os.getpid()}' in str(error.value)
  finally:
    owner.release()
  assert not (tmp_path / 'checkpoints').exists() and not (tmp_path / 'config.json').exists()


def test_a_lock_file_removed_before_it_is_locked_is_locked_again(tmp_path, monkeypatch):
  # A run whose checks failed removes the lock file it created; a run that opened that file just before
  # must not count a lock on the removed file, which a third run could then also "hold" via a new one.
  real_flock, calls = checkpoint_lib.fcntl.flock, []

  def flock_after_removal(file, operation):
    if not calls:
      os.remove(tmp_path / checkpoint_lib.LOCK_FILE)  # the failing owner cleans up in between
    calls.append(operation)
    return real_flock(file, operation)

  monkeypatch.setattr(checkpoint_lib.fcntl, 'flock', flock_after_removal)
  lock = checkpoint_lib.WorkdirLock(str(tmp_path))
  try:
    assert len(calls) == 2  # locked, found removed, locked again
    assert os.stat(lock.path).st_ino == os.fstat(lock.file.fileno()).st_ino
    monkeypatch.setattr(checkpoint_lib.fcntl, 'flock', real_flock)
    with pytest.raises(ValueError, match='in use by a running dsjax run'):
      checkpoint_lib.WorkdirLock(str(tmp_path))
  finally:
    lock.release()


# ------------------------------------------------------------------------------------------------
# Progress numbers.
# ------------------------------------------------------------------------------------------------


def test_progress_times_training_only(monkeypatch):
  clock = iter([0.0, 10.0, 13.0, 14.0]).__next__
  monkeypatch.setattr(metrics_lib.time, 'perf_counter', clock)
  progress = metrics_lib.Progress(step=0, total_steps=100)  # t = 0
  progress.exclude(4.0)  # 4 s of evaluation / checkpointing
  steps_per_sec, eta = progress.mark(12)  # t = 10: 12 steps in 10 - 4 s
  assert steps_per_sec == pytest.approx(2.0) and eta == pytest.approx(44.0)
  assert progress.mark(15) == pytest.approx((1.0, 85.0))  # t = 13
  assert not progress.due(16, log_every=50)  # t = 14: 1 s since the last line
  monkeypatch.setattr(metrics_lib.time, 'perf_counter', lambda: 13.0 + metrics_lib.PROGRESS_SECONDS)
  assert progress.due(16, log_every=50) and progress.due(50, log_every=50)


def test_steps_per_sec_in_the_metrics_is_timed_after_each_step_arrives(tmp_path):
  config = _config(total_steps=12, checkpoint_every=4, eval_every=4)
  t0 = time.perf_counter()
  _train(config, tmp_path)
  wall = time.perf_counter() - t0
  rows = _strict_json_rows(tmp_path / 'metrics.jsonl')
  assert [r['step'] for r in rows] == list(range(1, 13))
  seconds = [1.0 / r['train/steps_per_sec'] for r in rows]
  assert all(s > 0 for s in seconds) and sum(seconds) <= wall


def test_out_of_memory_and_file_system_errors_are_one_line():
  oom = RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 70.9GiB.\nmore detail')
  message = cli.user_error_message(oom)
  assert message.startswith('out of device memory (RESOURCE_EXHAUSTED') and 'batch_size' in message
  assert '\n' not in message
  try:
    try:
      raise OSError(28, 'No space left on device', '/ckpt/7/state')
    except OSError as full:
      raise RuntimeError('async save failed') from full
  except RuntimeError as wrapped:
    assert cli.user_error_message(wrapped) == '/ckpt/7/state: No space left on device'
  assert cli.user_error_message(KeyError('a bug')) is None  # Bugs keep their traceback.


def test_a_user_error_raised_while_handling_an_os_error_keeps_its_own_message():
  try:
    try:
      raise BlockingIOError(11, 'Resource temporarily unavailable')
    except BlockingIOError:
      raise ValueError('--workdir w is in use by a running dsjax run') from None
  except ValueError as error:
    assert cli.user_error_message(error) == '--workdir w is in use by a running dsjax run'
