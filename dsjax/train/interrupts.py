"""Preemption: SIGTERM (what a preempted TPU/GPU job receives) and SIGINT (Ctrl-C) end a run cleanly.

While `StopSignals` is active, the first SIGTERM or SIGINT only records itself; the training loop looks
at `received` after every step, saves a checkpoint of that step and exits (one line, status 128 +
signal number), so rerunning the command resumes bit-exactly; with several processes they agree on the
signal and the step to stop at (`dsjax.train.sharding.max_over_processes`), so a signal to any one of
them stops all. A second Ctrl-C stops the process at once, without a checkpoint (KeyboardInterrupt); so
does a second SIGTERM more than `REPEAT_GRACE_S` after the first (by SIGTERM's default action: a run
that hangs, e.g. waiting on a process that died, can still be terminated), while one sooner is taken
for the same request delivered twice (launchers that signal both a process and its group).
"""

from __future__ import annotations

import os
import signal
import threading
import time

HANDLED = (signal.SIGTERM, signal.SIGINT)
REPEAT_GRACE_S = 10.0


class StopSignals:

  def __init__(self):
    self.received: signal.Signals | None = None
    self._received_at = 0.0
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self.received is not None:  # Asked twice: stop now, without a checkpoint.
      if signum == signal.SIGINT:
        raise KeyboardInterrupt
      if time.monotonic() - self._received_at > REPEAT_GRACE_S:
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
