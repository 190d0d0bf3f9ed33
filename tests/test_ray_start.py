"""Joining a Ray cluster that is not there (its own module: the other Ray tests keep a private
Ray running on this machine, which `ray_address: auto` would find)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.extended  # waits out Ray's own connection attempts (~9 s): second CI tier
def test_joining_no_cluster_is_one_clear_error_before_the_run_directory(base_model, tmp_path):
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "regen", "train", f"model.path={base_model}", f"run.dir={run}",
                           "log.progress=none", "distributed.mode=ray", "distributed.ray_address=auto"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    if done.returncode == 0 and "Connected to Ray cluster" in done.stderr:
        pytest.skip("a Ray cluster is running on this machine")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "distributed.ray_address=auto: cannot join a Ray cluster" in done.stderr
    assert "Traceback" not in done.stderr and not run.exists()
