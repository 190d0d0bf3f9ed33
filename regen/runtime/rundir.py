"""Run directory set-up: checks that it is writable and that we do not clobber a finished run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from regen.errors import UserError

RUN_FILES = ("metrics.jsonl", "alerts.jsonl", "tensorboard", "checkpoints", "export", "samples")


def prepare(run_dir: str, overwrite: bool, resume: bool) -> Path:
    path = Path(run_dir)
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
                f"run.dir: '{run_dir}' already holds a run; pass --resume to continue it, "
                "run.overwrite=true to replace it, or choose another run.dir"
            )
        for name in RUN_FILES:
            p = path / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return path


def setup_torch(threads: int, seed: int) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
