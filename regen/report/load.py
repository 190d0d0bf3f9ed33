"""Reading a run directory for `regen report` and `regen status`, robustly.

A run may be read while it trains (the last metrics line half written), after a crash, or
from an older regen that wrote fewer files. Nothing here raises for such a run: each
problem becomes a note shown in the report. Only a path that is not a run at all (missing,
or without metrics.jsonl) is a `UserError`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from regen.config import redact
from regen.errors import UserError
from regen.runtime.rundir import read_run_info

MAX_LINE_NOTES = 5  # past this, bad lines of one file are counted, not listed


@dataclass
class Checkpoint:
    step: int
    healthy: bool | None  # None: state.json has no flag (offline loops) or cannot be read
    size_bytes: int
    mtime: float
    complete: bool  # manifest.json present: the write finished


@dataclass
class Run:
    path: Path
    name: str
    rows: list[dict]
    config: dict | None = None  # redacted
    alerts: list[dict] | None = None  # None: no alerts.jsonl
    checkpoints: list[Checkpoint] = field(default_factory=list)
    samples: dict[int, list[dict]] = field(default_factory=dict)  # eval step -> sample rows
    info: dict | None = None  # run.json
    notes: list[str] = field(default_factory=list)  # problems found while reading
    metrics_mtime: float = 0.0

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every row holding a finite number under `key`, by step; a step
        logged twice (a resume redoing it) keeps its last value."""
        by_step: dict[int, float] = {}
        for row in self.rows:
            v = row.get(key)
            if _is_number(v):
                by_step[row["step"]] = float(v)
        return sorted(by_step.items())

    def rows_at(self, step: int) -> dict[str, float]:
        """Every finite number logged at `step` (its training row and its eval row merged)."""
        out: dict[str, float] = {}
        for row in self.rows:
            if row["step"] == step:
                out |= {k: float(v) for k, v in row.items() if k != "step" and _is_number(v)}
        return out

    def keys(self) -> set[str]:
        return {k for row in self.rows for k, v in row.items() if k != "step" and _is_number(v)}

    @property
    def last_step(self) -> int | None:
        """Newest step that trained (eval-only rows at step 0 do not count)."""
        steps = [r["step"] for r in self.rows if any(not k.startswith("eval/") for k in r if k != "step")]
        return max(steps) if steps else None

    def cfg(self, *keys: str):
        """config[k1][k2]..., or None when absent."""
        node = self.config
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                return None
            node = node[k]
        return node

    @property
    def kind(self) -> str:
        if self.cfg("sft") is not None:
            return "sft"
        return str(self.cfg("algorithm", "name") or "unknown")

    @property
    def total_steps(self) -> int | None:
        v = self.cfg("sft", "steps") if self.kind == "sft" else self.cfg("train", "steps")
        return v if isinstance(v, int) else None

    @property
    def batch_size(self) -> int | None:
        """Samples consumed per step: completions (RL), demonstrations (SFT) or pairs (DPO)."""
        if self.kind == "sft":
            v = self.cfg("sft", "global_batch_size")
        elif self.kind == "dpo":
            v = self.cfg("train", "global_minibatch_size")
        else:
            v = self.cfg("rollout", "global_batch_size")
        return v if isinstance(v, int) and v > 0 else None

    def elapsed(self) -> dict[int, float]:
        """Cumulative wall-clock (sum of time/step_s) at the end of each logged step; a step
        without a time (an eval-only row) takes the time reached before it."""
        step_time = dict(self.series("time/step_s"))
        if not step_time:
            return {}
        out, total = {}, 0.0
        for s in sorted({r["step"] for r in self.rows}):
            total += step_time.get(s, 0.0)
            out[s] = total
        return out


def load_run(path: str | Path, name: str | None = None) -> Run:
    p = Path(path)
    if not p.exists():
        raise UserError(f"run directory '{p}' does not exist")
    if not p.is_dir():
        raise UserError(f"'{p}' is not a directory (expected a run directory holding metrics.jsonl)")
    metrics = p / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"'{p}' has no metrics.jsonl: not a regen run directory (or the run has not logged a step)")
    notes: list[str] = []
    rows = []
    for i, row in read_jsonl(metrics, notes):
        if isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
        else:
            notes.append(f"metrics.jsonl line {i}: no integer 'step': skipped")
    if not rows:
        notes.append("metrics.jsonl holds no usable row yet: nothing to plot")
    run = Run(p, name or p.name, rows, notes=notes, metrics_mtime=metrics.stat().st_mtime)
    run.config = _read_config(p / "config.yaml", notes)
    run.alerts = _read_alerts(p / "alerts.jsonl", notes)
    run.checkpoints = _read_checkpoints(p / "checkpoints", notes)
    run.samples = _read_samples(p / "samples", notes)
    run.info = read_run_info(p)
    if run.info is None and (p / "run.json").exists():
        notes.append("run.json is unreadable: liveness unknown")
    return run


def read_jsonl(path: Path, notes: list[str]) -> list[tuple[int, dict]]:
    """(line number, object) of each parseable line. A last line without its newline that
    does not parse is a write in progress (or cut off by a crash), noted as such."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        notes.append(f"{path.name}: cannot read ({e.strerror or e})")
        return []
    lines = text.split("\n")
    out, bad = [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            if i == len(lines):  # no newline after it: written only in part
                notes.append(f"{path.name}: the last line (line {i}) is incomplete (run still writing, or "
                             "interrupted): ignored")
            else:
                bad.append(i)
            continue
        if isinstance(obj, dict):
            out.append((i, obj))
        else:
            bad.append(i)
    if bad:
        listed = ", ".join(map(str, bad[:MAX_LINE_NOTES])) + (f" and {len(bad) - MAX_LINE_NOTES} more"
                                                              if len(bad) > MAX_LINE_NOTES else "")
        notes.append(f"{path.name}: line{'s' if len(bad) > 1 else ''} {listed} not a JSON object: skipped")
    return out


def _read_config(path: Path, notes: list[str]) -> dict | None:
    if not path.is_file():
        notes.append("config.yaml missing: model, algorithm and batch size unknown (no samples axis)")
        return None
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, yaml.YAMLError) as e:
        notes.append(f"config.yaml unreadable ({type(e).__name__}): model, algorithm and batch size unknown")
        return None
    if not isinstance(tree, dict):
        notes.append("config.yaml is not a mapping: ignored")
        return None
    return redact(tree)  # config.yaml is written redacted; a hand-made one may not be


def _read_alerts(path: Path, notes: list[str]) -> list[dict] | None:
    if not path.is_file():
        return None
    alerts = []
    for _, row in read_jsonl(path, notes):
        step = row.get("step")
        row["step"] = step if isinstance(step, int) and not isinstance(step, bool) else -1
        alerts.append(row)
    return alerts


def _read_checkpoints(root: Path, notes: list[str]) -> list[Checkpoint]:
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith((".tmp-", ".old-")):
            notes.append(f"checkpoints/{folder.name}: a checkpoint being written (or an interrupted write)")
            continue
        if not (folder.is_dir() and folder.name.startswith("step_")):
            continue
        try:
            step = int(folder.name.removeprefix("step_"))
        except ValueError:
            continue
        healthy = None
        try:
            flag = json.loads((folder / "state.json").read_text()).get("healthy")
            healthy = flag if isinstance(flag, bool) else None
        except (OSError, ValueError, AttributeError):
            pass
        size = 0
        for f in folder.rglob("*"):
            try:
                size += f.stat().st_size if f.is_file() else 0
            except OSError:
                pass  # deleted by retention while we looked
        manifest = folder / "manifest.json"
        mtime = (manifest if manifest.is_file() else folder).stat().st_mtime
        out.append(Checkpoint(step, healthy, size, mtime, manifest.is_file()))
        if not manifest.is_file():
            notes.append(f"checkpoints/{folder.name} has no manifest.json: incomplete")
    return sorted(out, key=lambda c: c.step)


def _read_samples(root: Path, notes: list[str]) -> dict[int, list[dict]]:
    if not root.is_dir():
        return {}
    out = {}
    for f in sorted(root.glob("step_*.jsonl")):
        try:
            step = int(f.stem.removeprefix("step_"))
        except ValueError:
            notes.append(f"samples/{f.name}: not named step_NNNNNNNN.jsonl: ignored")
            continue
        sub: list[str] = []
        out[step] = [row for _, row in read_jsonl(f, sub)]
        notes.extend(f"samples/{n}" for n in sub)
    return out


def age(seconds_ago: float) -> str:
    """'42 s', '3.5 min', '2.0 h', '4.1 days': how long ago, for people."""
    s = max(0.0, seconds_ago)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def since(t: float) -> str:
    return age(time.time() - t)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
