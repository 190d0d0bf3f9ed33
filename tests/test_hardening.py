"""Runs and checkpoints under real faults: a full disk (a small tmpfs), SIGKILL at named moments
(tests/fault_entry.py kills its own process there), a second trainer on the same run
directory, torn files, moved run directories. Each test reproduces a failure seen on main."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.cli import main
from regen.runtime import checkpoint as ckpt
from regen.runtime.metrics import MetricsLogger
from tests.conftest import LM_FAST, nan_at_steps, read_jsonl, same_run

ROOT = Path(__file__).resolve().parents[1]


def lm(base, run, *extra) -> list[str]:
    return ["train", f"model.path={base}", f"run.dir={run}", *LM_FAST, *extra]


def faulty(args: list[str], **env) -> subprocess.CompletedProcess:
    """`regen ARGS` in a process that tests/fault_entry.py breaks as `env` says."""
    return subprocess.run([sys.executable, "tests/fault_entry.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=300)


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a real tmpfs of that size (a full disk on demand)."""
    mounted = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# ------------------------------------------------------------------ a full disk


def test_full_disk_mid_run_alerts_keeps_the_older_checkpoint_and_reruns_cleanly(base_model, tmpfs, capsys):
    run = tmpfs("8m") / "run"  # one checkpoint (~5 MB) fits, a second one beside it does not
    args = lm(base_model, run, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=1")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the final checkpoint could not be written" in err and "Traceback" not in err
    failed = [a["step"] for a in read_jsonl(run / "alerts.jsonl") if a["kind"] == "checkpoint_failed"]
    assert failed == [2, 3]  # training went on after the step-2 failure
    assert "No space left on device" in read_jsonl(run / "alerts.jsonl")[-1]["message"]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]
    ckpt.verify(run / "checkpoints" / "step_00000001")  # intact
    assert main(args) == 2  # the same command again: resumes from step 1, the same clear end
    out = capsys.readouterr()
    assert "resuming from" in out.out and "step_00000001" in out.out and "Traceback" not in out.err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(base_model, tmp_path, tmpfs, capsys):
    run = tmp_path / "run"
    assert main(lm(base_model, run, "train.steps=1")) == 0
    disk = tmpfs("1m")  # the model's weights (~1.6 MB) do not fit
    assert main(["export", str(run), "--out", str(disk / "out")]) == 2
    err = capsys.readouterr().err
    assert "export: writing" in err and "No space left on device" in err and "Traceback" not in err
    assert list(disk.iterdir()) == []  # no truncated folder that looks like a model, no temporary one
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0  # elsewhere, the same command works
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (run / "export" / "model.safetensors").read_bytes()


def test_metrics_rows_on_a_full_disk_are_whole_or_absent(tmpfs):
    disk = tmpfs("64k")
    warnings = []
    log = MetricsLogger(disk, False, warn=lambda step, m: warnings.append(m))
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:  # fill the disk up
        try:
            while True:
                f.write(b"x" * 256)
        except OSError:
            pass
    written = 0
    for step in range(1, 40):
        log.log(step, {"loss": 0.5, "reward/mean": 0.25, **{f"m/{i}": float(i) for i in range(20)}})
        written = step
    filler.unlink()  # room again: rows are written again
    log.log(written + 1, {"loss": 1.0})
    log.close()
    lines = (disk / "metrics.jsonl").read_bytes().decode().splitlines(keepends=True)
    assert lines and all(line.endswith("\n") for line in lines)
    rows = [json.loads(line) for line in lines]  # every row whole
    assert rows[-1]["step"] == written + 1 and len(rows) < written + 1  # some were lost, none half-written
    assert any("could not be written" in w for w in warnings) and any("written again" in w for w in warnings)


def test_a_torn_last_metrics_line_is_dropped_on_resume(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(lm(base_model, run, "train.steps=2")) == 0
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/mea')  # what a full disk leaves of a row
    assert main(lm(base_model, run, "train.steps=3")) == 0
    assert "dropped 1 unreadable line" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


# ------------------------------------------------------------------ SIGKILL at named moments


@pytest.mark.extended  # a SIGKILL and a rerun in subprocesses (7 s): second CI tier, keeps scripts/test.sh short
def test_a_kill_after_the_final_checkpoint_is_completed_by_the_rerun(base_model, tmp_path, capsys):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    extra = ("train.steps=3", "data.eval=builtin:arithmetic:test", "eval.num_prompts=8")
    assert main(lm(base_model, straight, *extra)) == 0
    done = faulty(lm(base_model, killed, *extra), REGEN_FAULT_KILL="after_save:3")  # the final checkpoint
    assert done.returncode == -signal.SIGKILL
    assert (killed / "checkpoints" / "step_00000003").is_dir() and not (killed / "export").exists()
    assert main(lm(base_model, killed, *extra)) == 0
    assert "completed its final evaluation and export" in capsys.readouterr().out
    same_run(straight, killed)  # the same weights in export/, and the final eval row now logged
    assert json.loads((killed / "run.json").read_text())["status"] == "finished"


@pytest.mark.extended  # a SIGKILL and a resume in subprocesses (7 s): second CI tier, keeps scripts/test.sh short
def test_a_kill_in_a_nonfinite_streak_still_rolls_back_after_resume(base_model, tmp_path, monkeypatch):
    nan = {"REGEN_FAULT_NAN_STEPS": "3,4,5"}
    extra = ("train.steps=6", "checkpoint.every=1", "checkpoint.keep_last=3", "health.rollback_after_nonfinite=3")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert faulty(lm(base_model, killed, *extra), **nan, REGEN_FAULT_KILL="after_save:4").returncode == -signal.SIGKILL
    nan_at_steps(monkeypatch, {3, 4, 5})  # the same NaNs in this process
    assert main(lm(base_model, straight, *extra)) == 0
    assert main(lm(base_model, killed, *extra)) == 0  # resumes mid-streak at step 4
    rollback = [a for a in read_jsonl(killed / "alerts.jsonl") if a["kind"] == "rollback"]
    assert [(a["step"], "step_00000002" in a["message"]) for a in rollback] == [(5, True)]
    same_run(straight, killed)


@pytest.mark.extended  # a SIGKILL mid-rewrite and a rerun in subprocesses (7 s): second CI tier, keeps scripts/test.sh short
def test_a_kill_while_resume_rewrites_the_metrics_loses_no_row(base_model, tmp_path):
    run = tmp_path / "run"
    assert main(lm(base_model, run, "train.steps=4", "checkpoint.every=2")) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # so the resume starts at step 2 and cuts rows 3-4
    (run / "export").rename(tmp_path / "old-export")
    done = faulty(lm(base_model, run, "train.steps=4", "checkpoint.every=2"), REGEN_FAULT_KILL="before_replace")
    assert done.returncode == -signal.SIGKILL
    assert read_jsonl(run / "metrics.jsonl") == rows  # the old file, whole, until the new one replaces it
    assert main(lm(base_model, run, "train.steps=4", "checkpoint.every=2")) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.extended  # a SIGKILL in retention and a rerun in subprocesses (7 s): second CI tier, keeps scripts/test.sh short
def test_a_kill_during_retention_leaves_nothing_behind(base_model, tmp_path):
    run = tmp_path / "run"
    args = lm(base_model, run, "train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=1")
    assert faulty(args, REGEN_FAULT_KILL="in_retention").returncode == -signal.SIGKILL
    names = {p.name for p in (run / "checkpoints").iterdir()}
    assert names == {"step_00000002", ".del-step_00000001"}  # killed half-way through deleting step 1
    assert main(args) == 0
    assert {p.name for p in (run / "checkpoints").iterdir()} == {"step_00000004"}


@pytest.mark.extended  # a killed run redone in subprocesses (7 s): second CI tier, keeps scripts/test.sh short
def test_alerts_of_redone_steps_are_not_repeated(base_model, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = lm(base_model, run, "train.steps=4", "checkpoint.every=2")
    nan = {"REGEN_FAULT_NAN_STEPS": "3"}
    assert faulty(args, **nan, REGEN_FAULT_KILL="after_log:4").returncode == -signal.SIGKILL  # before step 4's checkpoint
    assert [(a["step"], a["kind"]) for a in read_jsonl(run / "alerts.jsonl")] == [(3, "nonfinite")]
    nan_at_steps(monkeypatch, {3})
    assert main(args) == 0  # resumes at step 2: step 3 is redone, its alert too
    assert [(a["step"], a["kind"]) for a in read_jsonl(run / "alerts.jsonl")] == [(3, "nonfinite")]


# ------------------------------------------------------------------ the run directory


@pytest.mark.extended  # two trainers in subprocesses (6 s): second CI tier, keeps scripts/test.sh short
def test_a_second_trainer_on_a_run_directory_is_refused_until_the_first_is_gone(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "regen", *lm(base_model, run, "train.steps=100000")], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "metrics.jsonl").exists():
            time.sleep(0.05)
        assert main(lm(base_model, run, "train.steps=2")) == 2
        err = capsys.readouterr().err
        assert f"is in use by process {first.pid}" in err and "run.lock" in err
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert main(lm(base_model, run, "train.steps=2", "run.overwrite=true")) == 0  # the holder is gone


@pytest.mark.extended  # SIGTERM in the first eval, then a fresh start (9 s): second CI tier, keeps scripts/test.sh short
def test_a_run_killed_before_its_first_checkpoint_starts_again(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    args = lm(base_model, run, "train.steps=2", "data.eval=builtin:arithmetic:test", "eval.num_prompts=256")
    proc = subprocess.Popen([sys.executable, "-m", "regen", *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "run.json").exists():
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # during the evaluation before training
    proc.wait()
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").glob("step_*"))
    assert main(args) == 0  # no run.overwrite needed: nothing of it could be resumed
    assert "stopped before its first checkpoint: starting it again" in capsys.readouterr().out


def test_a_run_directory_named_differently_or_moved_resumes(base_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(lm(base_model, "runs/a", "train.steps=2")) == 0
    assert main(lm(base_model, "./runs/a", "train.steps=3")) == 0  # the same folder, spelled otherwise
    shutil.move("runs/a", "moved")
    assert main(lm(base_model, str(tmp_path / "moved"), "train.steps=4")) == 0
    out = capsys.readouterr()
    assert "cannot resume" not in out.err
    assert [r["step"] for r in read_jsonl(tmp_path / "moved" / "metrics.jsonl")] == [1, 2, 3, 4]


# ------------------------------------------------------------------ the rest of the list


@pytest.mark.extended  # an SFT run SIGTERMed and resumed in subprocesses (9 s): second CI tier, keeps scripts/test.sh short
def test_sft_stops_gracefully_on_sigterm_and_resumes(tmp_path):
    run = tmp_path / "sft"
    args = ["sft", "model.init=arith-char-gpt2", f"run.dir={run}", "sft.steps=3000", "log.progress=none",
            "data.eval=null", "log.tensorboard=false", "checkpoint.every=0"]
    proc = subprocess.Popen([sys.executable, "-m", "regen", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "metrics.jsonl").exists():
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "run the same command to resume" in out
    stopped = max(r["step"] for r in read_jsonl(run / "metrics.jsonl"))
    assert 0 < stopped < 3000 and (run / "checkpoints" / f"step_{stopped:08d}").is_dir()
    assert json.loads((run / "run.json").read_text())["status"] == "stopped" and not (run / "export").exists()
    assert main([*args[:3], f"sft.steps={stopped + 5}", *args[4:]]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")][-1] == stopped + 5


def test_export_of_a_run_stopped_unhealthy_takes_its_newest_healthy_checkpoint(base_model, tmp_path, capsys,
                                                                               monkeypatch):
    run = tmp_path / "run"
    args = lm(base_model, run, "train.steps=8", "checkpoint.every=2", "health.rollback_after_nonfinite=2",
              "health.max_rollbacks=0")
    nan_at_steps(monkeypatch, {3, 4, 5, 6, 7, 8})
    assert main(args) == 2 and "still unhealthy" in capsys.readouterr().err
    latest = ckpt.list_checkpoints(run)[-1]
    assert latest.name == "step_00000004" and not json.loads((latest / "state.json").read_text())["healthy"]
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "step_00000004 is marked unhealthy" in err and "step_00000002" in err
    exported = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert exported == (run / "checkpoints" / "step_00000002" / "model" / "model.safetensors").read_bytes()


def test_a_corrupt_file_with_a_matching_manifest_is_one_line(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(lm(base_model, run, "train.steps=2")) == 0
    folder = run / "checkpoints" / "step_00000002"
    weights = folder / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a broken file...
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"]["model/model.safetensors"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))  # ...whose checksum was recomputed
    assert main(lm(base_model, run, "train.steps=3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step_00000002" in err[0] and "cannot be loaded" in err[0], err
