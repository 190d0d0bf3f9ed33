"""Metrics sinks: metrics.jsonl (one object per step) and TensorBoard event files."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _clean(v):
    # JSON has no NaN/inf: write null so every reader can parse the file
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_after(path: Path, step: int) -> None:
    """Drop rows logged after `step` (a resumed run redoes those steps)."""
    if path.exists():
        keep = [row for row in read_metrics(path) if row["step"] <= step]
        path.write_text("".join(json.dumps(row) + "\n" for row in keep))
