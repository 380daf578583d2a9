"""Preemption: SIGTERM (what a preempted TPU/GPU job receives) and SIGINT (Ctrl-C) end a run cleanly.

While `StopSignals` is active, the first SIGTERM or SIGINT only records itself; the training loop looks
at `received` after every step, saves a checkpoint of that step and exits (one line, status 128 +
signal number), so rerunning the command resumes bit-exactly; with several processes they agree on the
step to stop at (`dsjax.train.sharding.any_process`), so a signal to any one of them stops all. A second
signal stops the process at once, without a checkpoint: Ctrl-C as KeyboardInterrupt, SIGTERM by its
default action (a run that hangs, e.g. waiting on a process that died, can still be terminated).
"""

from __future__ import annotations

import os
import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopSignals:

  def __init__(self):
    self.received: signal.Signals | None = None
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self.received is not None:  # Asked twice: stop now, without a checkpoint.
      if signum == signal.SIGINT:
        raise KeyboardInterrupt
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.received = signal.Signals(signum)

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():  # Handlers live in the main thread only.
      for signum in HANDLED:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  @property
  def exit_status(self) -> int:
    return 128 + int(self.received) if self.received is not None else 0
