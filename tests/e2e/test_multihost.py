"""Multi-process runs (`jax.distributed`): the flags that start one, and two processes of 4 CPU devices
each training, checkpointing and resuming like one process of 8 devices.

CPU processes exchange collectives through Gloo (`sharding.initialize_distributed`). The processes are
real `python -m dsjax.main` runs on localhost, with a free port for the coordinator.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from dsjax import tokenizer as tokenizer_cli
from dsjax.train import checkpoint as checkpoint_lib
from dsjax.train import loop
from dsjax.train import sharding as sharding_lib
from tests.e2e import multihost_config
from tests.helpers import REPO_ROOT, write_text_corpus

ROOT = REPO_ROOT
CONFIG = 'tests/e2e/multihost_config.py'
TIMEOUT_S = 300
RTOL = 1e-4


# ------------------------------------------------------------------------------------------------
# Flags and environment.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'flags,environ,expected',
  [
    ((None, None, None, False), {}, None),  # one process: no jax.distributed
    (
      ('10.0.0.1:1234', 2, 1, False),
      {},
      {'coordinator_address': '10.0.0.1:1234', 'num_processes': 2, 'process_id': 1},
    ),
    (
      (None, None, None, False),
      {'JAX_COORDINATOR_ADDRESS': 'host:99', 'JAX_NUM_PROCESSES': '4', 'JAX_PROCESS_ID': '3'},
      {'coordinator_address': 'host:99', 'num_processes': 4, 'process_id': 3},
    ),
    (
      (None, None, 0, False),  # a flag wins over its variable
      {'JAX_COORDINATOR_ADDRESS': '[::1]:99', 'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '1'},
      {'coordinator_address': '[::1]:99', 'num_processes': 2, 'process_id': 0},
    ),
    ((None, None, None, True), {}, {}),  # all from the cluster (TPU, SLURM, MPI)
    ((None, 8, None, True), {}, {'num_processes': 8}),
  ],
)
def test_distributed_settings_come_from_flags_then_environment(flags, environ, expected):
  assert sharding_lib.distributed_settings(*flags, environ=environ) == expected


@pytest.mark.parametrize(
  'flags,environ,message',
  [
    ((None, 2, 0, False), {}, '--coordinator_address not given: a multi-process run needs'),
    (('h:1', None, None, False), {}, '--num_processes and --process_id not given'),
    (('nohost', 2, 0, False), {}, '--coordinator_address=nohost: expected HOST:PORT'),
    (('h:0', 2, 0, False), {}, '--coordinator_address=h:0: expected HOST:PORT with a port in 1…65535'),
    (('h:1', 0, 0, False), {}, '--num_processes=0: expected an integer ≥ 1'),
    (('h:1', 2, -1, False), {}, '--process_id=-1: expected an integer ≥ 0'),
    (('h:1', 2, 2, False), {}, '--process_id=2: must be below the number of processes (--num_processes=2)'),
    (('h:1', None, 0, False), {'JAX_NUM_PROCESSES': 'two'}, 'JAX_NUM_PROCESSES=two: expected an integer'),
    (
      (None, None, None, False),
      {'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': '2'},
      '--process_id not given',
    ),
  ],
)
def test_bad_distributed_settings_name_the_flag_or_variable(flags, environ, message):
  with pytest.raises(ValueError, match=re.escape(message)) as error:
    sharding_lib.distributed_settings(*flags, environ=environ)
  assert '\n' not in str(error.value)


def _env(devices_per_process: int) -> dict[str, str]:
  """The test's environment (CPU, conftest's fast compilation) with `devices_per_process` simulated
  devices in each process instead of conftest's 8."""
  xla_flags = re.sub(r'--xla_force_host_platform_device_count=\d+', '', os.environ.get('XLA_FLAGS', ''))
  xla_flags = f'{xla_flags} --xla_force_host_platform_device_count={devices_per_process}'.strip()
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_') or k == 'JAX_PLATFORMS'}
  return {**env, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': xla_flags}


def test_a_multi_process_run_missing_a_flag_fails_in_one_line_and_writes_nothing(tmp_path):
  workdir = tmp_path / 'w'
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'dsjax.main',
      f'--config={CONFIG}',
      f'--workdir={workdir}',
      '--num_processes=2',
      '--process_id=0',
    ],
    cwd=ROOT,
    env=_env(4),
    capture_output=True,
    text=True,
    timeout=TIMEOUT_S,
  )
  assert proc.returncode == 2, proc.stderr
  assert 'Traceback' not in proc.stderr, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith('dsjax.main: error: --coordinator_address not given: '), last
  assert not workdir.exists()


# ------------------------------------------------------------------------------------------------
# Two processes × 4 devices against one process × 8 devices.
# ------------------------------------------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _process_args(workdir, port: int, process_id: int, overrides) -> list[str]:
  """The command line of process `process_id` of a two-process run coordinated on `port`."""
  return [
    sys.executable,
    '-m',
    'dsjax.main',
    f'--config={CONFIG}',
    f'--workdir={workdir}',
    f'--coordinator_address=127.0.0.1:{port}',
    '--num_processes=2',
    f'--process_id={process_id}',
    *overrides,
  ]


def _run_two_processes(workdir, *overrides) -> list[subprocess.CompletedProcess]:
  """`python -m dsjax.main` as processes 0 and 1 of one run; both must finish within TIMEOUT_S."""
  port = _free_port()
  procs = [
    subprocess.Popen(
      _process_args(workdir, port, i, overrides),
      cwd=ROOT,
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  results = []
  try:
    for proc in procs:
      _, stderr = proc.communicate(timeout=TIMEOUT_S)
      results.append(subprocess.CompletedProcess(proc.args, proc.returncode, '', stderr))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for i, result in enumerate(results):
    assert result.returncode == 0, f'process {i}:\n{result.stderr[-3000:]}'
  return results + [procs[0].pid]


def _metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _subword_text(tmp_path) -> dict[str, str]:
  """`data` overrides for a tiny text corpus read with a 300-token BPE tokenizer trained on it (the
  processes tokenize it into one shared cache, once)."""
  corpus = write_text_corpus(tmp_path / 'corpus')
  tokenizer_cli.train(f'text:{corpus}/*.txt', 300, str(tmp_path / 'tokenizer'))
  return {
    'name': f'text:{corpus}/*.txt',
    'tokenizer': str(tmp_path / 'tokenizer' / 'tokenizer.json'),
    'data_dir': str(tmp_path / 'cache'),
    'seq_len': 16,
  }


@pytest.mark.slow  # About 2 minutes on 2 cores each: two runs of two fresh processes, and the reference.
@pytest.mark.parametrize('text', ['bytes', 'subword'])
def test_two_processes_train_checkpoint_and_resume_like_one(tmp_path, text):
  data = _subword_text(tmp_path) if text == 'subword' else {}
  overrides = [f'--config.data.{key}={value}' for key, value in data.items()]
  # One process, 8 devices: 4 steps, then a second invocation resumes from the checkpoint to step 6.
  config = multihost_config.get_config()
  config.data.update(data)
  one = str(tmp_path / 'one_process')
  loop.train_and_evaluate(config, one)
  config.total_steps = 6
  loop.train_and_evaluate(config, one)

  two = tmp_path / 'two_processes'
  first = _run_two_processes(two, *overrides)
  second = _run_two_processes(two, '--config.total_steps=6', *overrides)
  assert 'Resumed from step 4' in second[0].stderr

  expected, got = _metrics(one), _metrics(two)
  assert [r['step'] for r in expected] == [1, 2, 3, 4, 5, 6]
  assert [r['step'] for r in got] == [1, 2, 3, 4, 5, 6]  # Each step once: process 0 alone writes.
  for row, reference in zip(got, expected):
    for key in ('train/loss', 'train/grad_norm', 'eval/loss', 'eval/bits_per_byte'):
      if key in reference:
        np.testing.assert_allclose(row[key], reference[key], rtol=RTOL, err_msg=f'step {row["step"]} {key}')
  assert 'eval/loss' in got[3] and 'eval/loss' in got[5]

  # Only process 0 writes the files and logs progress; the checkpoints are the processes' together.
  assert sorted(os.listdir(two / 'checkpoints')) == ['4', '6']
  assert len(os.listdir(two / 'tensorboard')) == 2  # one event file per invocation
  assert (two / 'config.json').exists()
  assert (two / '.dsjax.lock').read_text().startswith(f'pid {second[2]} ')
  for run in (first, second):
    assert re.search(r'step \d/\d \| loss', run[0].stderr)
    assert not re.search(r'step \d/\d \| loss', run[1].stderr), run[1].stderr[-2000:]


def _start_two_processes(
  workdir, *overrides, stderr_files=None, extra_env=({}, {})
) -> list[subprocess.Popen]:
  port = _free_port()
  return [
    subprocess.Popen(
      _process_args(workdir, port, i, overrides),
      cwd=ROOT,
      env={**_env(4), **extra_env[i]},
      stdout=subprocess.DEVNULL,
      stderr=stderr_files[i],
      text=True,
    )
    for i in range(2)
  ]


@contextlib.contextmanager
def _two_logged_processes(tmp_path, workdir, *overrides, extra_env=({}, {})):
  """Processes 0 and 1 of one run, with their stderr in tmp_path/process_{0,1}.log; yields (processes,
  log paths) and kills a process still running on leaving."""
  logs = [tmp_path / f'process_{i}.log' for i in range(2)]
  with open(logs[0], 'w') as log_0, open(logs[1], 'w') as log_1:
    procs = _start_two_processes(workdir, *overrides, stderr_files=[log_0, log_1], extra_env=extra_env)
    try:
      yield procs, logs
    finally:
      for proc in procs:
        if proc.poll() is None:
          proc.kill()
          proc.wait()


# Slow (34 s): the two-process path runs by default in the locked-workdir test, and a signal to a one-process
# run in tests/e2e/test_reliability.py.
@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_the_same_saved_step(tmp_path):
  """Preemption reaches hosts at different moments: SIGTERM to process 1 alone makes both processes
  save the same step and exit (not hang in a collective the other never joins)."""
  with _two_logged_processes(tmp_path, tmp_path / 'run', '--config.total_steps=100000') as (procs, logs):
    deadline = time.time() + TIMEOUT_S
    while not re.search(r'step 3/', logs[0].read_text()):
      assert time.time() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
      time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
  stderr = [log.read_text() for log in logs]
  assert codes == [143, 143], [s[-2000:] for s in stderr]
  stopped = [re.search(r'stopped by (.+) after step (\d+); saved checkpoint \2', s) for s in stderr]
  assert stopped[0] and stopped[1], [s[-2000:] for s in stderr]
  assert stopped[1].group(1) == 'SIGTERM' and stopped[0].group(1) == 'SIGTERM to another process'
  step = stopped[0].group(2)
  assert stopped[1].group(2) == step and step in os.listdir(tmp_path / 'run' / 'checkpoints')


def test_a_locked_workdir_stops_every_process_in_one_line(tmp_path):
  """Only process 0 takes the workdir's lock; when it cannot, process 1 must not run into a collective
  process 0 never joins: both exit with the one-line error."""
  workdir = tmp_path / 'run'
  owner = checkpoint_lib.WorkdirLock(str(workdir))
  owner.record_owner()
  try:
    with _two_logged_processes(tmp_path, workdir) as (procs, logs):
      codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
  finally:
    owner.release()
  for i, log in enumerate(logs):
    stderr = log.read_text()
    assert codes[i] == 2 and 'Traceback' not in stderr, f'process {i}:\n{stderr[-3000:]}'
    assert stderr.strip().splitlines()[-1].startswith('dsjax.main: error: --workdir '), stderr[-2000:]
  assert sorted(os.listdir(workdir)) == ['.dsjax.lock']


def _restore_with_oom_on_process_1(tmp_path, workdir):
  """Resumes the run in `workdir` to step 6 with process 1's restores running out of memory once Orbax
  has read the step (Orbax's own cross-process restore must still be entered by every process); the
  processes' exit codes and stderr. The hook runs before the working directory is on the path: it
  imports dsjax from ROOT, as `-m dsjax.main` will."""
  hook = tmp_path / 'hook'
  hook.mkdir()
  (hook / 'sitecustomize.py').write_text(
    f'import sys\nsys.path.insert(0, {str(ROOT)!r})\n'
    'from dsjax.train import checkpoint\n'
    'read = checkpoint.Checkpointer.restore_step\n'
    'def restore_step(self, step, abstract_state=None):\n'
    '  read(self, step, abstract_state)\n'
    '  raise MemoryError()\n'
    'checkpoint.Checkpointer.restore_step = restore_step\n'
  )
  path = os.pathsep.join(filter(None, [str(hook), os.environ.get('PYTHONPATH')]))
  with _two_logged_processes(
    tmp_path, workdir, '--config.total_steps=6', extra_env=({}, {'PYTHONPATH': path})
  ) as (procs, logs):
    codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
  return codes, [log.read_text() for log in logs]


# Slow (~70 s on 2 cores: one two-process run and two two-process restores). The one-process restore
# paths are in tests/e2e/test_reliability*.py; the default suite keeps two-process runs through the
# signal and locked-workdir tests.
@pytest.mark.slow
def test_two_processes_restore_together_an_oom_moves_nothing_a_corrupted_step_is_set_aside(tmp_path):
  """Two restores of one two-process run (checkpoints at steps 2 and 4), each agreed by both processes
  (not in a vote the other never joins):
  - process 1 alone runs out of memory restoring step 4: the files are fine, so neither process sets
    the step aside; both stop with the one-line error;
  - then step 4 loses a file: both find it unreadable, process 0 moves it aside, and both resume from
    step 2."""
  workdir = tmp_path / 'run'
  _run_two_processes(workdir, '--config.checkpoint_every=2')
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2', '4']

  codes, stderr = _restore_with_oom_on_process_1(tmp_path, workdir)
  assert codes == [2, 2], [s[-2000:] for s in stderr]
  last = [s.strip().splitlines()[-1] for s in stderr]
  assert all(line.startswith('dsjax.main: error: could not restore checkpoint step 4 of') for line in last)
  assert 'on another process' in last[0] and 'MemoryError' in last[1], last  # (the hook ran)
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2', '4']
  assert not (workdir / 'corrupt_checkpoints').exists()

  os.remove(workdir / 'checkpoints' / '4' / 'run' / 'metadata')
  second = _run_two_processes(workdir, '--config.total_steps=6')
  assert 'Checkpoint step 4 of' in second[0].stderr and 'Resumed from step 2' in second[0].stderr
  assert [r['step'] for r in _metrics(workdir)] == [1, 2, 3, 4, 5, 6]
  assert len(os.listdir(workdir / 'corrupt_checkpoints')) == 1
