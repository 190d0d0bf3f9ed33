"""The loop's guarantees, each tested for a language model and a flow model alike (`job`; the
first three for a joint run too, `any_job`; its rollback and kill-resume are in test_joint.py):
missing rewards, unscored steps, scorer versions, a full disk at the final checkpoint, NaN
rollback, graceful SIGTERM, SIGKILL and exact resume. Faults are real: a reward service
port nothing listens on, a tmpfs that is too small, real signals to a real process."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.cli import main
from tests.conftest import BASE_OF, Job, NaNAt, make_job, read_jsonl, same_run

ROOT = Path(__file__).resolve().parents[1]
STEPS = {"lm": 8, "flow": 4, "vlm": 6, "qwen": 6}  # of the kill / signal runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["lm", "flow", "vlm", "joint"])
def any_job(request) -> Job:
    return make_job(request.param, request)


def test_no_reward_alerts_then_stops_with_a_checkpoint(any_job, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REGEN_REWARD_TOKEN", "t0ken")
    url = f"http://127.0.0.1:{free_port()}"  # a reward service that is not there
    reward = f"reward=[{{name: remote, args: {{url: '{url}', retries: 1, backoff_s: 0.01, timeout_s: 1}}}}]"
    assert main(any_job.args(tmp_path, reward, "train.steps=20", "health.stop_after_unscored_steps=3")) == 2
    assert "no reward came back for 3 consecutive steps" in capsys.readouterr().err
    assert (tmp_path / "checkpoints" / "step_00000003").is_dir()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/missing_frac"] == 1.0 and r["reward/mean"] is None and r["update_skipped"] == 1.0
               for r in rows)  # missing, never counted as zero, and no optimizer step on nothing
    kinds = [(a["step"], a["kind"]) for a in read_jsonl(tmp_path / "alerts.jsonl")]
    assert [k for k in kinds if k[1] == "reward_missing"] == [(1, "reward_missing"), (2, "reward_missing"),
                                                              (3, "reward_missing")]
    assert (3, "run_stopped") in kinds


def test_resume_alerts_when_the_scorer_version_changed(any_job, tmp_path, monkeypatch):
    (tmp_path / "versioned.py").write_text(
        "import os\n"
        "def score(samples):  # exact match for text, brightness for images\n"
        "    return [float(s.media.mean() / 255) if s.media is not None\n"
        "            else float(s.completion.strip() == s.meta['answer']) for s in samples]\n"
        "score.version = os.environ['SCORER_VERSION']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "versioned", raising=False)  # another test's module of that name
    run = tmp_path / "run"
    reward = "reward=[{name: 'versioned:score'}]"
    monkeypatch.setenv("SCORER_VERSION", "1")
    assert main(any_job.args(run, reward, "train.steps=2")) == 0
    state = json.loads((run / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert state["reward_versions"] == {"versioned:score": "1"}
    monkeypatch.delitem(sys.modules, "versioned")
    monkeypatch.setenv("SCORER_VERSION", "2")
    assert main(any_job.args(run, reward, "train.steps=3", "--resume")) == 0
    alerts = read_jsonl(run / "alerts.jsonl")
    assert [a["kind"] for a in alerts] == ["scorer_version_changed"] and alerts[0]["step"] == 3


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB tmpfs: room for the run's logs, not for one checkpoint of any of the models."""
    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_disk_at_the_final_checkpoint_is_an_error_not_a_traceback(any_job, small_disk, capsys):
    run = small_disk / "run"
    assert main(any_job.args(run, "train.steps=2", "checkpoint.every=1")) == 2
    assert "the final checkpoint could not be written" in capsys.readouterr().err
    failed = [a for a in read_jsonl(run / "alerts.jsonl") if a["kind"] == "checkpoint_failed"]
    assert [a["step"] for a in failed] == [1, 2]  # the periodic one too: training went on after it
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert not [p for p in (run / "checkpoints").iterdir()]  # no half-written folder left behind


def test_persistent_nan_rolls_back_lowers_lr_and_alerts(job, tmp_path, monkeypatch):
    if job.kind in ("lm", "vlm"):
        from regen.modalities.lm import LMModality as cls
    else:
        from regen.modalities.flow import FlowModality as cls
    nan = NaNAt(cls.micro_loss, {5, 6, 7})  # one micro-batch per step: steps 5-7 go non-finite
    monkeypatch.setattr(cls, "micro_loss", lambda self, mini, pos: nan(self, mini, pos))
    run = tmp_path / "nan"
    assert main(job.args(run, "train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=1",
                         "health.rollback_after_nonfinite=3", "health.rollback_lr_factor=0.5")) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["lr"] for r in rows] == [1e-3] * 7 + [5e-4]
    assert [r["nonfinite_skipped"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 0]
    alerts = read_jsonl(run / "alerts.jsonl")
    rollback = [a for a in alerts if a["kind"] == "rollback"]
    # steps 5-7 were unhealthy: the step-6 checkpoint is not a rollback target, step 4 was kept for it
    assert len(rollback) == 1 and rollback[0]["step"] == 7 and "step_00000004" in rollback[0]["message"]
    state = json.loads((run / "checkpoints" / "step_00000008" / "state.json").read_text())
    assert state["health"]["rollbacks"] == 1 and state["health"]["lr_scale"] == 0.5


# ------------------------------------------------------------------ real signals to a real process


@pytest.fixture(scope="module", params=["lm", "flow", "vlm", "qwen"])
def signalled(request, tmp_path_factory):
    """(job, its uninterrupted reference run) of the kill and signal tests."""
    job = Job(request.param, request.getfixturevalue(BASE_OF[request.param]))
    run = tmp_path_factory.mktemp(f"ref-{job.kind}") / "run"
    assert main(_kill_args(job, run)) == 0
    return job, run


def _kill_args(job: Job, run) -> list[str]:
    return job.args(run, f"train.steps={STEPS[job.kind]}", "checkpoint.every=1", "checkpoint.keep_last=3")


def _wait_rows(path: Path, n: int, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.02)


def test_sigkill_mid_run_then_resume_is_bitwise_identical(signalled, tmp_path):
    job, reference = signalled
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "regen", *_kill_args(job, run)]
    steps = STEPS[job.kind]
    for kill_at in (steps // 2,):  # the same command then resumes where the last checkpoint left it
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        _wait_rows(run / "metrics.jsonl", kill_at, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert main(_kill_args(job, run)) == 0  # the same command resumes (in this process: no second start-up)
    same_run(reference, run)


def test_sigterm_finishes_the_step_checkpoints_and_exits_0(signalled, tmp_path):
    job, reference = signalled
    run = tmp_path / "termed"
    cmd = [sys.executable, "-m", "regen", *_kill_args(job, run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    _wait_rows(run / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "finishing this step" in out and "run the same command to resume" in out
    stopped = len(read_jsonl(run / "metrics.jsonl"))
    assert stopped < STEPS[job.kind] and (run / "checkpoints" / f"step_{stopped:08d}").is_dir()
    assert json.loads((run / "run.json").read_text())["status"] == "stopped"
    assert main(_kill_args(job, run)) == 0
    same_run(reference, run)
    rows = read_jsonl(run / "metrics.jsonl")
    # the books' own times: each checkpoint's write on the row after it (none before the first), the
    # resume's on the first row of the second process, and only there
    assert "time/checkpoint_s" not in rows[0] and all(r["time/checkpoint_s"] > 0 for r in rows[1:stopped])
    assert [i for i, r in enumerate(rows) if "time/resume_s" in r] == [stopped] and rows[stopped]["time/resume_s"] > 0


def test_dynamic_sampling_keeps_only_groups_with_signal(job, tmp_path):
    # rewards with ties: 0/1 for an answer ending in an even digit, for an image brighter than average
    reward = {"lm": "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]",
              "vlm": "reward=[{name: exact_match}]",
              "flow": "reward=[{name: 'tests.reward_fixtures:bright_or_not'}]"}[job.kind]
    run = tmp_path / "dapo"
    assert main(job.args(run, reward, "train.steps=6", "algorithm.dynamic_sampling=true",
                         "algorithm.max_sampling_rounds=2")) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(r["dynamic/extra_rounds"] <= 2 for r in rows)
    assert any(r["dynamic/dropped_groups"] > 0 for r in rows)  # groups without signal were met...
    full = [r for r in rows if r["dynamic/filled_frac"] == 1.0]
    assert full and all(r["reward/zero_std_frac"] == 0.0 for r in full)  # ...and replaced by ones with it
