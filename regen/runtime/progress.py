"""Progress display: a live bar (step, reward, throughput, ETA) on a terminal, plain lines
elsewhere (CI logs, pipes), nothing when asked."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class StepProgress:
    def __init__(self, total: int, start: int, mode: str, every: int, label: str):
        self.console = Console(stderr=True)
        if mode == "auto":
            mode = "bar" if self.console.is_terminal else "lines"
        self.mode, self.every, self.total, self.label = mode, every, total, label
        self._t0, self._start = time.perf_counter(), start
        self._bar = None
        if mode == "bar":
            self._bar = Progress(
                TextColumn(f"[bold]{label}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task(label, total=total, completed=start, info="")

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, info: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif self.mode == "lines" and (step % self.every == 0 or step == self.total):
            done = step - self._start
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / max(done, 1) * (self.total - step)
            print(f"[{self.label}] step {step}/{self.total} {info} eta {eta:.0f}s", file=sys.stderr, flush=True)

    def print(self, msg: str) -> None:
        self.console.print(msg, highlight=False) if self._bar is not None else print(msg, file=sys.stderr, flush=True)
