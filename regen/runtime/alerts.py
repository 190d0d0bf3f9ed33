"""Alerts: one JSON object per event in alerts.jsonl, echoed to the console, and optionally
POSTed as JSON to a webhook in the background (a slow or dead webhook never stalls training)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


class Alerts:
    def __init__(self, run_dir: Path, echo=None, webhook_url: str | None = None, timeout_s: float = 5.0):
        self.path = run_dir / "alerts.jsonl"
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.webhook_url, self.timeout_s = webhook_url, timeout_s
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # fired from the loop and from background uploads

    def fire(self, step: int, kind: str, message: str, **data) -> None:
        from regen.runtime import dist

        if not dist.current().main:  # torchrun: rank 0 speaks for the run (the ranks see the same numbers)
            return
        row = {"time": time.time(), "step": step, "kind": kind, "message": message, **data}
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.echo(f"ALERT [{kind}] step {step}: {message}")
        if self.webhook_url:
            t = threading.Thread(target=self._post, args=(row,), daemon=True)
            t.start()
            self._threads.append(t)

    def _post(self, row: dict) -> None:
        import httpx

        try:
            httpx.post(self.webhook_url, json=row, timeout=self.timeout_s).raise_for_status()
        except httpx.HTTPError as e:
            self.echo(f"warning: alert webhook failed: {type(e).__name__}")

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (boundedly) for webhook posts still in flight."""
        for t in self._threads:
            t.join(timeout_s)
        self._threads.clear()
