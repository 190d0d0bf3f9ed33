"""Graceful stop: the first SIGINT/SIGTERM asks the loop to finish its step, checkpoint and
exit 0; a second one exits at once (KeyboardInterrupt, exit status 130)."""

from __future__ import annotations

import signal
import threading


class GracefulStop:
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, echo=print):
        self.requested = False
        self.echo = echo
        self._previous = {}

    def _handle(self, signum, _frame):
        if self.requested:
            raise KeyboardInterrupt  # second signal: stop now
        self.requested = True
        self.echo(f"{signal.Signals(signum).name}: finishing this step, writing a checkpoint, then exiting "
                  "(send it again to quit at once)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
