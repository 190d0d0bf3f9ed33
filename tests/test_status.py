"""`regen status` and run.json: the lines printed for finished, live, crashed and remote runs,
with the reward trend and the eval values computed here from the files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from regen.cli import main
from regen.report.status import status_text
from regen.report.svg import fmt_num
from regen.runtime.rundir import end_status, mark_closed, mark_running, read_run_info
from tests.conftest import read_jsonl
from tests.test_report import rl_rows, synthetic_run


def lines(text: str) -> dict[str, str]:
    """First word of each line -> the rest (indented alert lines under 'alerts+')."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("  "):
            out["alerts+"] = out.get("alerts+", "") + line.strip() + "\n"
        else:
            key, _, rest = line.partition(" ")
            out[key] = rest.strip()
    return out


def test_status_of_a_finished_real_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "model.init=arith-char-gpt2", f"run.dir={run}", "train.steps=4", "eval.every=2",
                 "eval.num_prompts=8", "rollout.global_batch_size=8", "rollout.group_size=4",
                 "rollout.max_new_tokens=4", "checkpoint.every=2", "log.progress=none", "log.tensorboard=false"]) == 0
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    got = lines(capsys.readouterr().out)
    assert got["run"] == f"{run}  (finished)"
    assert got["step"] == "4 / 4  (100%)"
    rows = read_jsonl(run / "metrics.jsonl")
    last_eval = {k: v for r in rows if r["step"] == 4 for k, v in r.items() if k.startswith("eval/")}
    assert got["eval"] == "step 4: " + "  ".join(f"{k[5:]} {fmt_num(v)}" for k, v in sorted(last_eval.items()))
    r = [x["reward/mean"] for x in rows if "reward/mean" in x]
    expected = f"{fmt_num(sum(r[2:]) / 2)} (mean of the last 2 steps) vs {fmt_num(sum(r[:2]) / 2)} (the 2 before)"
    assert got["reward"].startswith(expected)
    assert got["alerts"] == "0"
    assert got["checkpoint"].startswith("step 4, written") and got["checkpoint"].endswith("healthy")
    assert got["alive"].startswith("no: finished, ended")
    info = read_run_info(run)
    assert info["status"] == "finished" and info["pid"] == os.getpid()


def test_trend_alerts_and_a_live_run(tmp_path):
    rows = [{"step": s, "reward/mean": s / 100} for s in range(1, 26)]
    alerts = [{"time": time.time() - 600, "step": s, "kind": f"kind{s}", "message": f"m{s}"} for s in range(1, 8)]
    run = synthetic_run(tmp_path / "live", rows, total=50, alerts=alerts, checkpoints={20: False},
                        info={"pid": os.getpid(), "hostname": os.uname().nodename, "started": time.time(),
                              "status": "running"})
    got = lines(status_text(run))
    last10, before10 = sum(range(16, 26)) / 1000, sum(range(6, 16)) / 1000
    assert got["reward"] == (f"{fmt_num(last10)} (mean of the last 10 steps) vs {fmt_num(before10)} (the 10 before)  "
                             f"↑ {last10 - before10:+.3g}")
    assert got["step"] == "25 / 50  (50%)"
    assert got["alerts"] == "7 (last 5):"
    assert [ln.split("]")[0] for ln in got["alerts+"].splitlines()] == [f"step {s}  [kind{s}" for s in range(3, 8)]
    assert "(10.0 min ago)" in got["alerts+"]
    assert got["checkpoint"].startswith("step 20, written") and got["checkpoint"].endswith("unhealthy")
    assert got["alive"].startswith(f"yes: in progress, pid {os.getpid()} runs on this host; last metrics row")


def test_falling_reward_and_sft_loss(tmp_path):
    down = synthetic_run(tmp_path / "down", [{"step": s, "reward/mean": 1 - s / 10} for s in range(1, 5)])
    assert "↓ -0.2" in lines(status_text(down))["reward"]
    sft = synthetic_run(tmp_path / "sft", [{"step": s, "loss": 2.0} for s in range(1, 3)], config=False)
    assert lines(status_text(sft))["loss"] == ("2 (mean of the last 1 step) vs 2 (the 1 before)  → +0  "
                                               "(loss: lower is better)")


def test_dead_process_other_host_and_no_run_json(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid no longer runs
    dead = synthetic_run(tmp_path / "dead", info={"pid": gone.pid, "hostname": os.uname().nodename,
                                                  "started": time.time(), "status": "running"})
    assert lines(status_text(dead))["alive"].startswith(f"no: crashed, pid {gone.pid} on this host exited")
    with (dead / "alerts.jsonl").open("a") as f:  # the loop stopped itself (no reward came back)
        f.write(json.dumps({"step": 20, "kind": "run_stopped", "message": "no reward came back"}) + "\n")
    assert lines(status_text(dead))["alive"].startswith("no: stopped, by the run itself: no reward came back")
    far = synthetic_run(tmp_path / "far", info={"pid": 1, "hostname": "elsewhere", "status": "running"})
    got = lines(status_text(far))["alive"]
    assert got.startswith("unknown: in progress, run.json says pid 1 on host 'elsewhere'") and "last metrics row" in got
    old = synthetic_run(tmp_path / "old")
    assert lines(status_text(old))["alive"].startswith("unknown: in progress, probably (no run.json); last metrics row")
    os.utime(old / "metrics.jsonl", (time.time() - 7200, time.time() - 7200))
    assert lines(status_text(old))["alive"] == ("unknown: unfinished, not recently updated (no run.json); "
                                                "last metrics row 2.0 h ago")


def test_run_json_lifecycle(tmp_path):
    mark_running(tmp_path)
    info = read_run_info(tmp_path)
    assert info["status"] == "running" and info["pid"] == os.getpid()
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)
    assert end_status(tmp_path, 5) == "stopped"  # a graceful stop checkpoints an earlier step
    (tmp_path / "checkpoints" / "step_00000005").mkdir()
    assert end_status(tmp_path, 5) == "finished"
    mark_closed(tmp_path, "stopped")
    closed = read_run_info(tmp_path)
    assert closed["status"] == "stopped" and closed["started"] == info["started"]
    assert closed["ended"] >= closed["started"]
    (tmp_path / "run.json").write_text("{broken")
    assert read_run_info(tmp_path) is None


def test_status_errors(tmp_path, capsys):
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = synthetic_run(tmp_path / "r", rl_rows(3), total=3, tail="{")
    out = status_text(run)
    assert "note        metrics.jsonl: the last line (line 5) is incomplete" in out
