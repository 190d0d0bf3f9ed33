"""Alerts: one JSON object per event in alerts.jsonl, echoed to the console."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class Alerts:
    def __init__(self, run_dir: Path, echo=None):
        self.path = run_dir / "alerts.jsonl"
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def fire(self, step: int, kind: str, message: str, **data) -> None:
        row = {"time": time.time(), "step": step, "kind": kind, "message": message, **data}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.echo(f"ALERT [{kind}] step {step}: {message}")
