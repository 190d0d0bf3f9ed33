"""Trainers without sampling or rewards: supervised fine-tuning of language models (sft.py) and
flow models (flow_sft.py), and offline preference optimisation (dpo.py)."""

from __future__ import annotations

from pathlib import Path

from regen.runtime.rundir import mark_closed, write_folder


def close_offline(run_dir: Path, log, step: int, steps: int, last: Path, export, summary: dict) -> dict:
    """The end of an offline run: stopped early by a signal (a checkpoint at `step` was written;
    the same command resumes), or finished: export/ written (export(folder), into a temporary
    folder renamed when complete), then run.json marked finished."""
    log.close()
    if step < steps:
        mark_closed(run_dir, "stopped")
        print(f"stopped at step {step}: checkpoint {last}; run the same command to resume")
        return {**summary, "checkpoint": str(last), "stopped_early": True}
    write_folder(run_dir / "export", export)
    mark_closed(run_dir, "finished")
    return {**summary, "checkpoint": str(last), "export": str(run_dir / "export")}
