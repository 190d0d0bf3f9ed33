"""Progress display: a live bar (step, reward, throughput, ETA) on a terminal, plain lines
elsewhere (CI logs, pipes), nothing when asked."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def run_label(cfg) -> str:
    """What the progress line calls a run: its method, or each joint model's ([enhancer:grpo+painter:nft])."""
    if getattr(cfg, "models", None):
        return "+".join(f"{n}:{c.algorithm.name}" for n, c in cfg.members.items())
    return cfg.algorithm.name


class StepProgress:
    def __init__(self, total: int, start: int, mode: str, every: int, label: str, every_s: float = 30.0):
        """lines mode: a line every `every` steps, and whenever `every_s` seconds passed since the last."""
        self.console = Console(stderr=True)
        if mode == "auto":
            mode = "bar" if self.console.is_terminal else "lines"
        self.mode, self.every, self.total, self.label, self.every_s = mode, every, total, label, every_s
        self._t0, self._start = time.perf_counter(), start
        self._last = self._t0
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
        elif self.mode == "lines":
            now = time.perf_counter()
            if step % self.every and step != self.total and now - self._last < self.every_s:
                return
            self._last = now
            eta = (now - self._t0) / max(step - self._start, 1) * (self.total - step)
            print(f"[{self.label}] step {step}/{self.total} {info} eta {eta:.0f}s", file=sys.stderr, flush=True)

    def print(self, msg: str) -> None:
        if self._bar is not None:  # as written: "[reward_missing]" is text, not rich markup
            self.console.print(msg, highlight=False, markup=False)
        else:
            print(msg, file=sys.stderr, flush=True)
