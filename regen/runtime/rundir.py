"""Run directory set-up: checks that it is writable and that we do not clobber a finished run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from regen.errors import UserError

RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "tensorboard", "checkpoints", "export", "samples",
             "run.json", "report.html")
RUN_INFO = "run.json"


def prepare(run_dir: str, overwrite: bool, resume: bool) -> tuple[Path, bool]:
    """Create/check the run directory; return it and whether to resume. A directory that
    holds checkpoints is resumed automatically unless run.overwrite is set."""
    path = Path(run_dir)
    if not overwrite and (path / "checkpoints").is_dir() and any((path / "checkpoints").glob("step_*")):
        resume = True
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"run.dir: cannot create '{run_dir}': {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"run.dir: '{run_dir}' is not writable")
    used = (path / "metrics.jsonl").exists() or (path / "checkpoints").exists()
    if used and not resume:
        if not overwrite:
            raise UserError(
                f"run.dir: '{run_dir}' already holds a run without checkpoints; pass run.overwrite=true "
                "to replace it, or choose another run.dir"
            )
        for name in RUN_FILES:
            p = path / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return path, resume


def mark_running(run_dir: Path) -> None:
    """Write run.json: which process on which host trains this run, so `regen status` can tell
    a live run from one whose process is gone (a crash or a kill leaves status 'running')."""
    _write_info(run_dir, {"pid": os.getpid(), "hostname": socket.gethostname(), "started": time.time(),
                          "status": "running"})


def mark_closed(run_dir: Path, status: str) -> None:
    """Record how the run ended ('finished' or 'stopped') in run.json."""
    info = read_run_info(run_dir) or {"pid": os.getpid(), "hostname": socket.gethostname()}
    _write_info(run_dir, {**info, "status": status, "ended": time.time()})


def end_status(run_dir: Path, steps: int) -> str:
    """'finished' when the newest checkpoint is at the configured last step, else 'stopped'
    (a graceful stop checkpoints an earlier step)."""
    done = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
    try:
        last = int(done[-1].removeprefix("step_")) if done else -1
    except ValueError:
        last = -1
    return "finished" if last >= steps else "stopped"


def read_run_info(run_dir: Path) -> dict | None:
    """run.json as a dict, or None when it is absent or unreadable (older runs have none)."""
    try:
        info = json.loads((run_dir / RUN_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _write_info(run_dir: Path, info: dict) -> None:
    tmp = run_dir / f".tmp-{RUN_INFO}"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, run_dir / RUN_INFO)  # readers never see half a file


def setup_torch(threads: int, seed: int) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


def versions(model_source: str, reward_versions: dict, config_tree: dict) -> dict:
    """What produced a checkpoint: regen version, git commit of regen's source when it is a
    checkout, model source, reward versions, and a hash of the resolved config."""
    import subprocess

    from regen import __version__
    from regen.config import config_hash

    commit = None
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"regen": __version__, "git_commit": commit, "model": model_source, "rewards": reward_versions,
            "config_hash": config_hash(config_tree)}
