"""Metrics sinks: metrics.jsonl (one object per step), TensorBoard event files, and the
optional trackers of regen.runtime.loggers (Weights & Biases, MLflow) that every row fans
out to."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from regen.runtime.loggers import open_sinks, scrub_message


def _stderr_warning(step: int, message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class MetricsLogger:
    """`log` is a LogConfig (tensorboard + trackers) or, as before, a bool for TensorBoard
    alone. `config` is the run's config tree or model (trackers get it redacted), `resume`
    continues the trackers' runs recorded in loggers.json, and `warn(step, message)` reports a
    tracker that failed mid-run (the RL loop passes its alerts; the default prints)."""

    def __init__(self, run_dir: Path, log: Any = True, *, config: Any = None, resume: bool = False,
                 warn: Callable[[int, str], None] | None = None):
        tensorboard = log if isinstance(log, bool) else log.tensorboard
        self._warn = warn or _stderr_warning
        # trackers first: one that cannot start is an error before any file is opened
        self._sinks = [] if isinstance(log, bool) else open_sinks(run_dir, log, config, resume)
        self._last_step = 0
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("ab", buffering=0)  # unbuffered: a failed write is undone at once
        self._write_failed = False
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._append((json.dumps(row) + "\n").encode())
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in finite.items():
                self._tb.add_scalar(k, v, step)
        self._last_step = step
        for sink in list(self._sinks):
            try:
                if finite:
                    sink.log(step, finite)
            except Exception as e:  # a tracker never stops training: one warning, then without it
                self._drop(sink, step, e)

    def _append(self, data: bytes) -> None:
        """Append one whole row, or nothing: a write that fails (a full disk) is cut back to the
        end of the previous row, so the file never holds half a row; one warning, then rows
        are written again when there is room."""
        end = self._file.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[self._file.write(view):]
            if self._write_failed:
                self._write_failed = False
                self._warn(-1, "metrics.jsonl is written again")
        except OSError as e:
            try:
                self._file.truncate(end)
            except OSError:
                pass
            if not self._write_failed:
                self._write_failed = True
                self._warn(-1, f"metrics.jsonl: a row could not be written ({e.strerror or e}); rows are lost "
                               "until there is room again")

    def _drop(self, sink, step: int, error: BaseException) -> None:
        self._sinks.remove(sink)
        sink.abandon()
        self._warn(step, f"{sink.name} logging failed, continuing without it: {scrub_message(error)}")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in list(self._sinks):
            try:
                sink.close()
                self._sinks.remove(sink)
            except Exception as e:
                self._drop(sink, self._last_step, e)


def _clean(v):
    # JSON has no NaN/inf: write null so every reader can parse the file
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def nanmean(xs) -> float:
    """Mean of the values that are present (None and NaN mark missing ones); NaN if none is."""
    ok = [x for x in xs if x is not None and x == x]
    return sum(ok) / len(ok) if ok else float("nan")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_rows(path: Path) -> tuple[list[dict], int]:
    """The rows of a JSONL file and how many lines could not be read: a line torn by a full
    disk or a kill mid-write (the last, usually) is left out, never fatal."""
    rows, torn = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            torn += 1
    return rows, torn


def truncate_after(path: Path, step: int, keep_before_start: bool = False) -> int:
    """Drop the rows logged after `step` (a resumed run redoes those steps) and any line that
    cannot be read; returns how many such lines were dropped. The file is written anew and
    renamed over the old one, so a kill at any moment leaves one whole version of it.
    keep_before_start: keep rows of step -1 too (alerts raised while a run started)."""
    if not path.exists():
        return 0
    rows, torn = read_rows(path)
    keep = [r for r in rows if r["step"] <= step or (keep_before_start and r["step"] < 0)]
    if torn == 0 and len(keep) == len(rows):
        return 0
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in keep), encoding="utf-8")
    os.replace(tmp, path)
    return torn


class SilentLog:
    """The metrics logger of torchrun ranks other than 0 (rank 0 writes metrics.jsonl)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass
