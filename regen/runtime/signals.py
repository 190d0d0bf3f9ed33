"""Graceful stop: the first SIGINT/SIGTERM asks the loop to finish its step, checkpoint and
exit 0; a second one exits at once (KeyboardInterrupt, exit status 130). A Ray trainer actor,
whose loop runs outside the main thread (where signals cannot be caught), is asked the same
through request_stop."""

from __future__ import annotations

import signal
import threading

_ASKED = threading.Event()  # request_stop: process-wide, like a signal


def request_stop() -> None:
    """What a first SIGTERM does, from any thread (regen/train/ray_trainers.py's actors)."""
    _ASKED.set()


class GracefulStop:
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, echo=print):
        self._signalled = False
        self.echo = echo
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self._signalled or _ASKED.is_set()

    def _handle(self, signum, _frame):
        if self._signalled:
            raise KeyboardInterrupt  # second signal: stop now
        self._signalled = True
        self.echo(f"{signal.Signals(signum).name}: finishing this step, writing a checkpoint, then exiting "
                  "(send it again to quit at once)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        _ASKED.clear()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
