"""What the run-comparing benchmarks share: running `python -m regen ...` and reading a run's
eval points against its training wall-clock."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def regen(*args: str, stopped_ok: bool = False) -> float:
    """Run `python -m regen ARGS` from the repository root; exit with its stderr when it fails
    (stopped_ok: not when the run stopped itself, e.g. still unhealthy after health.max_rollbacks;
    its last stderr line is then printed)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "regen", *args], check=False, cwd=ROOT, capture_output=True, text=True)
    if done.returncode and stopped_ok and "stopped at step" in done.stderr:
        print("  the run stopped itself: " + done.stderr.strip().splitlines()[-1], flush=True)
    elif done.returncode:
        sys.exit(f"regen {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def load_avg() -> float:
    """The 1-min load average: a timing is worth something only on an otherwise idle machine."""
    return round(os.getloadavg()[0], 2)


def git_describe() -> str:
    git = ["git", "describe", "--always", "--dirty"]
    return subprocess.run(git, check=False, cwd=ROOT, capture_output=True, text=True).stdout.strip()


def spread(values: list) -> dict | None:
    """{"n", "mean", "std" (sample, n-1; 0 for one value), "min", "max"} of the values that are
    not None; None when there are none."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"n": len(v), "mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
            "min": min(v), "max": max(v)}


def eval_points(metrics: Path, keys: list[str]) -> dict:
    """The rows of metrics.jsonl holding keys[0], against training wall-clock = cumulative
    `time/step_s` (evaluation, loading and export not counted): {"steps", "seconds", one list per
    key (NaN where a row lacks it), "train_s", "median_step_ms", "last_step"}. The final eval
    is its own row after the last training row: a later row for the same step wins."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    step_s = {r["step"]: r["time/step_s"] for r in rows if "time/step_s" in r}
    clock, total, points = {0: 0.0}, 0.0, {}
    for step in sorted(step_s):
        total += step_s[step]
        clock[step] = total
    for r in rows:
        if keys[0] in r:
            points[r["step"]] = [r.get(k, math.nan) for k in keys]
    steps = sorted(points)
    out = {"steps": steps, "seconds": [clock[s] for s in steps], "train_s": total,
           "median_step_ms": 1000 * statistics.median(step_s.values()) if step_s else math.nan,
           "last_step": max(step_s, default=0)}
    for i, k in enumerate(keys):
        out[k] = [points[s][i] for s in steps]
    return out
