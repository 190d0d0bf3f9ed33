"""Surviving failures: kills, signals, corrupt checkpoints, NaNs, full disks, changed configs."""

import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch
from safetensors.torch import load_file

import regen.modalities.lm
from regen.cli import main
from regen.config import HealthConfig
from regen.runtime.alerts import Alerts
from regen.runtime.health import HealthMonitor
from tests.conftest import NaNAt, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
FAST = ["rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=4", "log.progress=none",
        "data.eval=null", "log.tensorboard=false", "optim.lr=1e-3"]


def args(base, run, *extra):
    return ["train", f"model.path={base}", f"run.dir={run}", *FAST, *extra]


def weights(run):
    return load_file(str(run / "export" / "model.safetensors"))


def same_run(a, b):
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]  # noqa: E731
    assert strip(read_jsonl(a / "metrics.jsonl")) == strip(read_jsonl(b / "metrics.jsonl"))


def test_corrupt_latest_checkpoint_falls_back_and_says_so(base_model, tmp_path, capsys):
    run, straight = tmp_path / "run", tmp_path / "straight"
    assert main(args(base_model, straight, "train.steps=6")) == 0
    assert main(args(base_model, run, "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=3")) == 0
    target = run / "checkpoints" / "step_00000004" / "model" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-100] ^= 0xFF
    target.write_bytes(bytes(data))
    assert main(args(base_model, run, "train.steps=6")) == 0
    out = capsys.readouterr()
    assert "step_00000004" in out.err and "does not match its checksum" in out.err
    assert "resuming from" in out.out and "step_00000002" in out.out
    same_run(straight, run)


def test_single_nan_is_skipped(base_model, tmp_path, monkeypatch):
    monkeypatch.setitem(regen.modalities.lm.POLICY_LOSSES, "grpo", NaNAt(regen.modalities.lm.POLICY_LOSSES["grpo"], {3}))
    run = tmp_path / "nan1"
    assert main(args(base_model, run, "train.steps=5")) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["nonfinite_skipped"] for r in rows] == [0, 0, 1, 0, 0]
    assert all(math.isfinite(v) for w in weights(run).values() for v in w.flatten()[:10].tolist())
    kinds = [a["kind"] for a in read_jsonl(run / "alerts.jsonl")]
    assert kinds == ["nonfinite"]


def test_incompatible_config_change_refused_unless_forced(base_model, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(args(base_model, run, "train.steps=2")) == 0
    assert main(args(base_model, run, "train.steps=4", "rollout.temperature=0.5")) == 2
    err = capsys.readouterr().err
    assert "rollout.temperature: 1.0 -> 0.5" in err and "--force" in err
    assert main(args(base_model, run, "train.steps=4", "rollout.temperature=0.5", "--force")) == 0
    assert len(read_jsonl(run / "metrics.jsonl")) == 4


def test_checkpoint_version_manifest(base_model, tmp_path):
    run = tmp_path / "run"
    assert main(args(base_model, run, "train.steps=1")) == 0
    v = json.loads((run / "checkpoints" / "step_00000001" / "state.json").read_text())["versions"]
    assert v["regen"] and v["model"] == str(base_model) and v["rewards"] == {"exact_match": "1"}
    assert len(v["config_hash"]) == 16 and "git_commit" in v


def test_health_monitor_alerts_on_collapse_and_kl(tmp_path):
    alerts = Alerts(tmp_path, echo=lambda m: None)
    mon = HealthMonitor(HealthConfig(reward_collapse_z=4.0, kl_alert=0.5), alerts)
    for step in range(1, 31):  # a steady reward around 0.5 +- 0.01
        assert mon.observe(step, {"reward/mean": 0.5 + 0.01 * (-1) ** step, "kl": 0.01}) is False
    mon.observe(31, {"reward/mean": 0.2, "kl": 0.01})  # 30 std below the running mean
    mon.observe(32, {"reward/mean": 0.5, "kl": 2.0})
    kinds = [(a["step"], a["kind"]) for a in read_jsonl(tmp_path / "alerts.jsonl")]
    assert kinds == [(31, "reward_collapse"), (32, "kl_explosion")]
    mon2 = HealthMonitor(HealthConfig(kl_alert=0.5, rollback_on_alert=True), alerts)
    assert mon2.observe(1, {"reward/mean": 0.5, "kl": 2.0}) is True


def test_alerts_reach_a_webhook(tmp_path):
    got = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            got.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        alerts = Alerts(tmp_path, echo=lambda m: None, webhook_url=f"http://127.0.0.1:{server.server_port}/hook")
        alerts.fire(7, "rollback", "rolled back", lr_scale=0.5)
        alerts.flush()
    finally:
        server.shutdown()
    assert got and got[0]["kind"] == "rollback" and got[0]["step"] == 7 and got[0]["lr_scale"] == 0.5


def test_unwritable_run_dir_and_empty_prompts(base_model, tmp_path, capsys):
    if os.geteuid() == 0:
        blocked = tmp_path / "file"
        blocked.write_text("x")  # root can write anywhere; a path through a file cannot be created
        target = blocked / "run"
    else:
        target = tmp_path / "ro" / "run"
        (tmp_path / "ro").mkdir(mode=0o500)
    assert main(args(base_model, target, "train.steps=1")) == 2
    assert "run.dir: cannot create" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(args(base_model, tmp_path / "r2", f"data.train={empty}")) == 2
    assert "holds no rows" in capsys.readouterr().err
