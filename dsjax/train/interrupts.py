"""Preemption: SIGTERM (what a preempted TPU/GPU job receives) and SIGINT (Ctrl-C) end a run cleanly.

While `StopSignals` is active, the first SIGTERM or SIGINT only records itself; the training loop looks
at `received` after every step, saves a checkpoint of that step and exits (one line, status 128 +
signal number), so rerunning the command resumes bit-exactly; with several processes they agree on the
signal and the step to stop at (`dsjax.train.sharding.max_over_processes`), so a signal to any one of
them stops all.

Two signals in quick succession. A second signal less than `SAME_REQUEST_S` after the first is the same
request delivered twice (launchers that signal both a process and its group; Python also merges
signals that arrive before the first is handled) and changes nothing. A later second Ctrl-C stops the
process at once, whatever it is doing (compiling, a step, a save, evaluation, a restore): one line, exit
status 130, without a checkpoint of the step in flight and without the interpreter's shutdown (whose
clean-up of XLA's and Orbax's threads can crash mid-compilation); the workdir is as safe as after
`kill -9`: a checkpoint being written is discarded, the earlier ones stay. A later second SIGTERM
(more than `REPEAT_GRACE_S` after the first) ends the process by SIGTERM's default action, so that a run
that hangs (e.g. waiting on a process that died) can still be terminated; one sooner is ignored.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from dsjax.train import cli

HANDLED = (signal.SIGTERM, signal.SIGINT)
SAME_REQUEST_S = 0.5
REPEAT_GRACE_S = 10.0


def exit_now(message: str, status: int):
  """Prints `<program>: <message>` and ends the process at once (no clean-up, no finalisation)."""
  try:
    sys.stdout.flush()
    print(f'{cli.program_name()}: {message}', file=sys.stderr, flush=True)
  finally:
    os._exit(status)  # pylint: disable=protected-access


class StopSignals:
  def __init__(self):
    self.received: signal.Signals | None = None
    self._received_at = 0.0
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self.received is not None:  # Asked twice: stop now, without a checkpoint.
      since = time.monotonic() - self._received_at
      if since < SAME_REQUEST_S:
        return
      if signum == signal.SIGINT:
        exit_now(
          'interrupted again: stopped at once, without saving the step in flight; rerun the same '
          'command to resume from the last checkpoint',
          status=128 + signal.SIGINT,
        )
      if since > REPEAT_GRACE_S:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
      return
    self.received, self._received_at = signal.Signals(signum), time.monotonic()

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():  # Handlers live in the main thread only.
      for signum in HANDLED:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}
