"""Two signals in quick succession, and the noise of a failing disk: a real training subprocess."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_reliability import ROOT, SUBPROCESS_ENV


def _start(workdir, stderr_path, *overrides):
  args = [
    sys.executable,
    '-m',
    'dsjax.main',
    '--config=configs/gpt_preln.py',
    f'--workdir={workdir}',
    '--config.batch_size=8',
    '--config.data.seq_len=16',
    '--config.eval_every=100000',
    '--config.log_every=1',
    *overrides,
  ]
  return subprocess.Popen(
    args, cwd=ROOT, env=SUBPROCESS_ENV, stdout=subprocess.DEVNULL, stderr=open(stderr_path, 'w'), text=True
  )


def _wait_for(text, stderr_path, process, timeout=180):
  deadline = time.time() + timeout
  while time.time() < deadline and process.poll() is None:
    if text in stderr_path.read_text():
      return
    time.sleep(0.05)
  raise AssertionError(f'no {text!r} in {timeout}s; exit {process.poll()}: {stderr_path.read_text()[-3000:]}')


@pytest.mark.slow  # Kept out of the default suite for its time (~15 s).
def test_a_second_sigint_while_compiling_exits_at_once_with_130(tmp_path):
  stderr_path = tmp_path / 'stderr.txt'
  # A model whose compilation takes seconds: the signals arrive while XLA compiles.
  process = _start(
    tmp_path / 'run',
    stderr_path,
    '--config.model.depth=24',
    '--config.model.width=256',
    '--config.model.num_heads=4',
    '--config.model.scan_layers=False',
    '--config.instrument.every=1',
  )
  _wait_for('Compiling the train step', stderr_path, process)
  process.send_signal(signal.SIGINT)
  time.sleep(5.0)  # Well past the same-request window; still compiling (the instrumented step follows).
  process.send_signal(signal.SIGINT)
  t0 = time.time()
  process.wait(timeout=60)
  stderr = stderr_path.read_text()
  assert process.returncode == 130, stderr[-3000:]
  assert time.time() - t0 < 10, stderr[-3000:]
  assert 'Fatal Python error' not in stderr and 'Traceback' not in stderr, stderr[-3000:]
  assert stderr.strip().splitlines()[-1].startswith('dsjax.main: '), stderr[-3000:]


@pytest.fixture
def small_disk(tmp_path):
  """A 3 MiB tmpfs (root only): room for the run's logs, not for its first checkpoint."""
  mount_point = tmp_path / 'disk'
  mount_point.mkdir()
  try:
    subprocess.run(
      ['mount', '-t', 'tmpfs', '-o', 'size=3m', 'tmpfs', str(mount_point)],
      check=True,
      capture_output=True,
      timeout=30,
    )
  except (OSError, subprocess.SubprocessError):
    pytest.skip('cannot mount a tmpfs here (needs root)')
  yield mount_point
  subprocess.run(['umount', '-l', str(mount_point)], check=False, capture_output=True, timeout=30)


@pytest.mark.slow  # Kept out of the default suite for its time (~15 s).
def test_a_full_disk_is_one_line_and_the_last_line_is_dsjax_s_own(tmp_path, small_disk):
  stderr_path = tmp_path / 'stderr.txt'
  process = _start(
    small_disk / 'run',
    stderr_path,
    '--config.model.depth=4',
    '--config.model.width=128',
    '--config.model.num_heads=2',
    '--config.model.scan_layers=False',
    '--config.total_steps=6',
    '--config.checkpoint_every=2',
    '--config.optimizer.warmup_steps=1',
  )
  process.wait(timeout=300)
  stderr = stderr_path.read_text()
  assert process.returncode == 2, stderr[-3000:]
  assert 'Traceback' not in stderr and 'Event loop is closed' not in stderr, stderr[-5000:]
  last = stderr.strip().splitlines()[-1]
  assert last.startswith('dsjax.main: error: ') and 'No space left on device' in last, last
  assert not [d for d in os.listdir(small_disk / 'run' / 'checkpoints') if d.isdigit()]  # none half-written


def _largest_file(directory):
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
  return max(files, key=os.path.getsize)


@pytest.mark.slow  # Kept out of the default suite for its time (~45 s).
def test_damaged_checkpoints_print_no_tracebacks(tmp_path):
  workdir, stderr_path = tmp_path / 'run', tmp_path / 'stderr.txt'
  # Unscanned layers: many arrays, so many of Orbax's reads are in flight when one fails.
  model = [
    '--config.model.depth=4',
    '--config.model.width=128',
    '--config.model.num_heads=2',
    '--config.model.scan_layers=False',
    '--config.checkpoint_every=2',
    '--config.keep_checkpoints=5',
    '--config.optimizer.warmup_steps=1',
  ]

  def run(total_steps):
    process = _start(workdir, stderr_path, *model, f'--config.total_steps={total_steps}')
    process.wait(timeout=300)
    return process.returncode, stderr_path.read_text()

  assert run(4)[0] == 0
  with open(_largest_file(workdir / 'checkpoints' / '4' / 'state'), 'r+b') as f:
    f.truncate(1000)
  status, stderr = run(6)  # Falls back to step 2.
  assert status == 0, stderr[-3000:]
  assert 'Traceback' not in stderr and 'Exception ignored' not in stderr, stderr[-5000:]
  for step in ('4', '6'):
    with open(_largest_file(workdir / 'checkpoints' / step / 'state'), 'r+b') as f:
      f.truncate(1000)
  os.rename(workdir / 'checkpoints' / '2', tmp_path / 'step_2')  # every remaining step damaged
  status, stderr = run(8)
  assert status == 2 and 'Traceback' not in stderr and 'Exception ignored' not in stderr, stderr[-5000:]
  assert stderr.strip().splitlines()[-1].startswith('dsjax.main: error: every checkpoint in '), stderr[-3000:]
