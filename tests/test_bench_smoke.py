"""The benchmarks a GPU run or a rehearsal depends on still run: their --tiny modes, end to end, as
child processes (an import error or a renamed key is found here, not on a lent GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.extended  # child processes and Ray: the CI's second tier

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_throughput_tiny_runs_every_part_it_can_on_cpu(tmp_path):
    out = tmp_path / "gt.json"
    proc = subprocess.run([sys.executable, "bench/gpu_throughput.py", "--tiny", "--only", "lm_generate,lm,nft,nft_flux",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert [p["part"] for p in parts] == ["lm_generate", "lm", "nft", "nft_flux"]
    assert all(p.get("error") is None for p in parts), [p.get("error") for p in parts]


def test_rehearsal_tiny_kills_resumes_and_completes(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "bench/rehearsal.py", "--tiny", "--only", "lm", "--placements",
                           "one,actor_collective", "--steps", "30", "--work", str(tmp_path / "w"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["placement"] for r in runs] == ["one", "actor_collective"]
    for r in runs:
        assert r["completed"] and r["steps_logged"][-1] == 30, r
        assert r["kill"] is not None and max(p["most_checkpoint_folders"] for p in r["processes"]) <= 2, r
    one, actor = runs
    assert len(one["processes"]) == 2 and one["resume_s"] > 0  # the trainer killed: a second process resumed
    assert len(actor["processes"]) == 1 and actor["phases"]["sync/s"] > 0  # the rollout actor: replaced in the run
