"""Experiment trackers chosen by config: W&B (offline mode) and MLflow (file store) with the
real libraries, no network. W&B's offline run is read back from its .wandb file with W&B's
own protobuf schema; MLflow's through MlflowClient."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from regen.cli import main
from regen.config import RLConfig, load_config
from regen.runtime import loggers
from regen.runtime.loggers import scrub_message, scrub_url
from regen.runtime.metrics import MetricsLogger
from tests.conftest import read_jsonl

try:
    import wandb  # noqa: F401
    from mlflow.tracking import MlflowClient
    HAVE_TRACKERS = True
except ImportError:
    HAVE_TRACKERS = False
needs_trackers = pytest.mark.skipif(not HAVE_TRACKERS, reason="needs wandb and mlflow-skinny (the dev extra)")

# RL from a fresh tiny model: what is logged matters here, not what is learned
RL = ["train", "model.init=arith-char-gpt2", "data.eval=null", "log.progress=none", "log.tensorboard=false",
      "rollout.global_batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=4", "checkpoint.every=1",
      "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]"]


def trackers(uri: str) -> list[str]:
    return [f"log.mlflow={{tracking_uri: '{uri}', experiment: exp}}", "log.wandb={project: proj, mode: offline}"]


def wandb_records(run_dir: Path) -> list[tuple[Path, object]]:
    """(file, Record) of every offline W&B run under run_dir/wandb, oldest first. The .wandb
    file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each with a
    7-byte header (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime):
        data, pos, buf = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            room = 32768 - pos % 32768
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if room < 7 or kind == 0:  # block tail / zero padding
                pos += room
                continue
            buf += data[pos + 7:pos + 7 + n]
            pos += 7 + n
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(buf)
                out.append((path, rec))
                buf = b""
    return out


def wandb_history(records) -> list[dict]:
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for _, r in records if r.WhichOneof("record_type") == "history"]


def wandb_config_text(records) -> str:
    items = []
    for _, r in records:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            items += r.run.config.update
        elif kind == "config":
            items += r.config.update
    return "\n".join(f"{i.key}={i.value_json}" for i in items)


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def secret_files(root: Path, word: bytes = b"SECRET") -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and word in p.read_bytes()]


@needs_trackers
def test_both_trackers_get_the_redacted_config_every_finite_row_and_are_closed(tmp_path, offline):
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(RLConfig, None, [
        "model.path=m", "rollout.temperature=0.7", *trackers(offline), "log.wandb.tags=[nightly, arith]",
        "reward=[{name: exact_match, args: {api_key: sk-SECRET1}}]",
        "health.webhook_url=https://hooks.example.com/services/T0/SECRET2?token=SECRET3",
        "mirror.endpoint_url=https://admin:SECRET4@minio.example.com:9000/",
    ])
    log = MetricsLogger(run, cfg.log, config=cfg)
    log.log(1, {"loss": 0.5, "reward/mean": 0.25, "kl": math.nan, "grad_norm": math.inf})
    log.log(2, {"loss": 0.125, "reward/mean": 0.75})
    log.close()

    ids = json.loads((run / "loggers.json").read_text())
    run_id = ids["mlflow"]["run_id"]
    assert mlflow_history(offline, run_id, "loss") == [(1, 0.5), (2, 0.125)]
    assert mlflow_history(offline, run_id, "reward/mean") == [(1, 0.25), (2, 0.75)]
    assert mlflow_history(offline, run_id, "kl") == [] and mlflow_history(offline, run_id, "grad_norm") == []
    got = MlflowClient(offline).get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "run"
    params = got.data.params
    assert params["rollout.temperature"] == "0.7" and params["reward.0.name"] == "exact_match"
    assert params["reward.0.args.api_key"] == "<redacted>"
    assert params["rollout.max_new_tokens"] == "8"  # a number is no secret, whatever its key says
    assert params["health.webhook_url"] == "https://hooks.example.com/<redacted>?token=<redacted>"
    assert params["mirror.endpoint_url"] == "https://<redacted>@minio.example.com:9000/"

    records = wandb_records(run)
    runs = [r.run for _, r in records if r.WhichOneof("record_type") == "run"]
    assert [r.run_id for r in runs] == [ids["wandb"]["id"]] and runs[0].project == "proj"
    assert list(runs[0].tags) == ["nightly", "arith"] and runs[0].display_name == "run"
    rows = [{k: v for k, v in h.items() if not k.startswith("_")} for h in wandb_history(records)]
    assert rows == [{"step": 1, "loss": 0.5, "reward/mean": 0.25}, {"step": 2, "loss": 0.125, "reward/mean": 0.75}]
    config = wandb_config_text(records)
    assert '"temperature":0.7' in config and "<redacted>" in config
    assert any(r.WhichOneof("record_type") == "exit" for _, r in records)  # finished, not abandoned
    assert secret_files(run) == []  # nowhere in the run dir: wandb files, loggers.json, debug logs
    assert "SECRET" not in json.dumps(params) and "SECRET" not in config


@needs_trackers
def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, offline):
    run = tmp_path / "run"
    assert main([*RL, f"run.dir={run}", "train.steps=2", *trackers(offline)]) == 0
    first = json.loads((run / "loggers.json").read_text())
    assert main([*RL, f"run.dir={run}", "train.steps=3", *trackers(offline)]) == 0  # resumes from step 2
    assert json.loads((run / "loggers.json").read_text()) == first
    want = [(r["step"], r["reward/mean"]) for r in read_jsonl(run / "metrics.jsonl")]
    assert [s for s, _ in want] == [1, 2, 3]

    client = MlflowClient(offline)
    exp = client.get_experiment_by_name("exp")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [first["mlflow"]["run_id"]]
    got = mlflow_history(offline, first["mlflow"]["run_id"], "reward/mean")
    assert [s for s, _ in got] == [1, 2, 3] and all(math.isclose(a, b) for (_, a), (_, b) in zip(got, want))
    assert client.get_run(first["mlflow"]["run_id"]).info.status == "FINISHED"

    records = wandb_records(run)
    files = sorted({p.parent.name for p, _ in records})
    assert len(files) == 2 and all(f"-{first['wandb']['id']}" in f for f in files)  # one W&B run id
    assert {r.run.run_id for _, r in records if r.WhichOneof("record_type") == "run"} == {first["wandb"]["id"]}
    logged = [(h["step"], h["reward/mean"]) for h in wandb_history(records) if "reward/mean" in h]
    assert [s for s, _ in logged] == [1, 2, 3] and all(math.isclose(a, b) for (_, a), (_, b) in zip(logged, want))


@pytest.mark.parametrize("verb, key, modules", [("train", "wandb", ["wandb"]),
                                                 ("sft", "mlflow", ["mlflow", "mlflow.tracking"])])
def test_a_missing_tracker_package_is_one_clear_error_before_anything_runs(tmp_path, monkeypatch, capsys,
                                                                           verb, key, modules):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # what `import` does for a package not installed
    value = "{project: p, mode: offline}" if key == "wandb" else "{experiment: e}"
    run = tmp_path / "run"
    assert main([verb, "model.init=arith-char-gpt2", f"run.dir={run}", f"log.{key}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"pip install 'regen[{key}]'" in err and f"log.{key}" in err and err.count("\n") == 1
    assert not run.exists()  # stopped before the run directory was touched


@needs_trackers
def test_a_tracker_failing_mid_run_gives_one_alert_and_training_goes_on(tmp_path, offline, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "sk-ENVSECRET6")
    calls = []
    real_log = loggers.MlflowSink.log

    def flaky(self, step, metrics):  # the server goes away after the first row
        calls.append(step)
        if len(calls) > 1:
            raise ConnectionError("POST http://admin:SECRET7@tracker.example.com/api failed; token sk-ENVSECRET6")
        real_log(self, step, metrics)

    monkeypatch.setattr(loggers.MlflowSink, "log", flaky)
    run = tmp_path / "run"
    assert main([*RL, f"run.dir={run}", "train.steps=4", *trackers(offline)]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert calls == [1, 2]  # dropped after its failure: not called again
    alerts = [a for a in read_jsonl(run / "alerts.jsonl") if a["kind"] == "logger_failed"]
    assert len(alerts) == 1 and "mlflow" in alerts[0]["message"] and "ConnectionError" in alerts[0]["message"]
    err = capsys.readouterr().err
    assert err.count("ALERT [logger_failed]") == 1
    assert "SECRET" not in err and secret_files(run) == []
    run_id = json.loads((run / "loggers.json").read_text())["mlflow"]["run_id"]
    assert [s for s, _ in mlflow_history(offline, run_id, "reward/mean")] == [1]
    # the other tracker was not affected
    assert [h["step"] for h in wandb_history(wandb_records(run)) if "reward/mean" in h] == [1, 2, 3, 4]


@needs_trackers
def test_without_alerts_a_failing_tracker_is_one_printed_warning(tmp_path, offline, monkeypatch, capsys):
    def broken(self, step, metrics):
        raise OSError("network is unreachable")

    monkeypatch.setattr(loggers.WandbSink, "log", broken)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(RLConfig, None, ["model.path=m", "log.wandb={project: p, mode: offline}"])
    log = MetricsLogger(run, cfg.log, config=cfg)  # as SFT and DPO build it: no alerts.jsonl there
    for step in range(1, 4):
        log.log(step, {"loss": float(step)})
    log.close()
    err = capsys.readouterr().err
    assert err.count("warning: wandb logging failed, continuing without it: OSError") == 1
    assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [1.0, 2.0, 3.0]


@needs_trackers
def test_a_tracker_that_cannot_start_is_one_clear_error(tmp_path, offline, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # MLflow 3 then refuses its file store
    assert main([*RL, f"run.dir={tmp_path / 'run'}", "train.steps=1", *trackers(offline)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: log.mlflow: cannot start the mlflow run: MlflowException") and err.count("\n") == 1
    assert "MLFLOW_ALLOW_FILE_STORE" in err  # MLflow's own hint survives
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_credentials_in_urls_and_messages_are_scrubbed(monkeypatch):
    assert scrub_url("https://bob:pw@host.example.com:8443/a/b?token=t0k&x=1#frag") == \
        "https://<redacted>@host.example.com:8443/a/b?token=<redacted>&x=<redacted>"
    assert scrub_url("https://hooks.example.com/services/T0/B0/XYZ", hide_path=True) == \
        "https://hooks.example.com/<redacted>"
    assert scrub_url("file:///tmp/mlruns") == "file:///tmp/mlruns"
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    msg = scrub_message(RuntimeError("key 0123456789abcdef rejected by https://u:p@api.example.com/x\nmore"))
    assert msg == "RuntimeError: key <redacted> rejected by https://<redacted>@api.example.com/x"


def test_a_tracking_uri_holding_credentials_is_refused_without_repeating_it(tmp_path, capsys):
    uri = "https://admin:SECRET8@mlflow.example.com"
    assert main(["train", "model.init=arith-char-gpt2", f"run.dir={tmp_path / 'r'}",
                 f"log.mlflow={{tracking_uri: '{uri}'}}"]) == 2
    err = capsys.readouterr().err
    assert "tracking_uri must not hold credentials" in err and "MLFLOW_TRACKING_PASSWORD" in err
    assert "SECRET" not in err


def test_trackers_off_import_nothing(tmp_path):
    code = (
        "import sys; from pathlib import Path; from regen.config import LogConfig; "
        "from regen.runtime.metrics import MetricsLogger; "
        f"log = MetricsLogger(Path({str(tmp_path)!r}), LogConfig(tensorboard=False), config={{'a': 1}}); "
        "log.log(1, {'loss': 1.0}); log.close(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
    assert not (tmp_path / "loggers.json").exists()


def test_help_config_describes_the_trackers(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "log.wandb" in out and "regen[wandb]" in out and "log.mlflow" in out and "regen[mlflow]" in out
