"""What a new user meets in their first hour with their own files, run as they would: `regen` in a
subprocess from a folder holding their config, data and reward module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
FAST = ["log.progress=none", "log.tensorboard=false", "rollout.global_batch_size=8", "rollout.group_size=4",
        "rollout.max_new_tokens=4"]


def regen(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The `regen` command as a user runs it: from their folder, with regen installed (not on PYTHONPATH)."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (env or {})
    return subprocess.run([sys.executable, "-m", "regen", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=environ)


REWARD_MODULE = '''
def ends_even(samples):
    """1 when the completion ends in an even digit."""
    return [float(s.completion[-1:] in "02468") for s in samples]
'''


@pytest.mark.extended  # three runs in subprocesses (10 s): second CI tier, keeps scripts/test.sh short
def test_a_reward_module_beside_the_config_or_in_the_folder_imports(base_model, tmp_path):
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "configs" / "my_rewards.py").write_text(REWARD_MODULE)
    (project / "configs" / "rl.yaml").write_text(
        f"model: {{path: {base_model}}}\nreward: [{{name: 'my_rewards:ends_even'}}]\ndata: {{eval: null}}\n")
    done = regen("train", "configs/rl.yaml", *FAST, "train.steps=1", "run.dir=runs/a", cwd=project)
    assert done.returncode == 0, done.stderr  # the module next to the config
    rows = read_jsonl(project / "runs" / "a" / "metrics.jsonl")
    assert "reward/my_rewards:ends_even" in rows[0]
    (project / "my_scores.py").write_text(REWARD_MODULE)  # and one in the folder the command runs from
    done = regen("eval", str(base_model), "--reward", "my_scores:ends_even", "--num-prompts", "4", cwd=project)
    assert done.returncode == 0, done.stderr
    assert "reward/my_scores:ends_even" in done.stdout


@pytest.mark.extended  # two `regen` subprocesses (~11 s): second CI tier, keeps scripts/test.sh short
def test_each_verb_says_which_rows_it_needs(base_model, tmp_path):
    (tmp_path / "demos.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    done = regen("sft", f"model.path={base_model}", "data.train=demos.jsonl", "data.eval=null", cwd=tmp_path)
    assert done.returncode == 2
    assert "field 'completion' missing" in done.stderr and '{"prompt": "...", "completion": "..."}' in done.stderr
    helped = regen("sft", "--help-config", cwd=tmp_path).stdout
    assert '"completion"' in helped and '"chosen"' in helped and "Sample.meta" in helped


@pytest.mark.extended  # runs with a tracker that times out (9 s): second CI tier, keeps scripts/test.sh short
def test_wandb_mode_from_the_environment_and_a_failed_tracker_leaves_nothing(base_model, tmp_path, offline,
                                                                             monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from regen.cli import main

    args = ["train", f"model.path={base_model}", *FAST, "train.steps=1", "data.eval=null"]
    # WANDB_MODE set by the user wins over the config's default: no API key needed offline
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([*args, f"run.dir={tmp_path / 'a'}", "log.wandb={project: p}"]) == 0
    assert list((tmp_path / "a" / "wandb").glob("offline-run-*"))
    monkeypatch.delenv("WANDB_MODE")
    # online with a W&B server that does not answer: W&B cannot start, after MLflow did...
    mlruns = tmp_path / "mlruns"
    done = regen(*args, "run.dir=b", "log.wandb={project: p}", f"log.mlflow={{tracking_uri: 'file://{mlruns}', "
                 "experiment: e}", cwd=tmp_path, env={"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "a" * 40,
                                                      "WANDB_INIT_TIMEOUT": "1"})
    assert done.returncode == 2 and "log.wandb: cannot start" in done.stderr, done.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file://{mlruns}")
    exp = client.get_experiment_by_name("e")
    assert exp is not None and not client.search_runs([exp.experiment_id])  # ...and MLflow's run is gone again
    assert not (tmp_path / "b" / "wandb").exists() or not list((tmp_path / "b" / "wandb").glob("*run-*"))


@pytest.mark.extended  # a run watched for its lines in a subprocess (9 s): second CI tier, keeps scripts/test.sh short
def test_without_a_terminal_a_line_comes_at_least_every_few_seconds(tmp_path):
    done = regen("sft", "model.init=arith-char-gpt2", "sft.steps=60", "sft.global_batch_size=8", "data.eval=null",
                 "log.tensorboard=false", "log.every=100000", "log.every_s=0.01", "run.dir=run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("[sft] step")]
    assert len(lines) >= 3, done.stderr  # log.every alone would print only the last step


def test_the_live_bar_keeps_the_alert_kind(capsys):
    from regen.runtime.progress import StepProgress

    with StepProgress(10, 0, "bar", 1, "grpo") as bar:
        bar.print("ALERT [reward_missing] step 3: 40% of rewards missing")
    assert "ALERT [reward_missing] step 3" in capsys.readouterr().err


@pytest.mark.extended  # two `regen` subprocesses (~11 s): second CI tier, keeps scripts/test.sh short
def test_lora_keys_are_listed_and_misnamed_ones_suggested(tmp_path):
    helped = regen("train", "--help-config", cwd=tmp_path).stdout
    for key in ("model.lora.r", "model.lora.alpha", "model.lora.target_modules", "log.wandb.mode"):
        assert key in helped, key
    done = regen("train", "model.init=arith-char-gpt2", "model.lora={rank: 4}", cwd=tmp_path)
    assert done.returncode == 2 and "did you mean 'model.lora.r'" in done.stderr


def test_rewards_are_listed_with_their_arguments_and_eval_can_pass_them(base_model, tmp_path, capsys):
    from regen.cli import main

    assert main(["rewards"]) == 0
    listed = capsys.readouterr().out.splitlines()
    names = [ln for ln in listed if ln and not ln.startswith(" ") and not ln.startswith("In a config")]
    starts = {ln.index(ln.split()[1]) for ln in names}
    assert len(starts) == 1  # one column for the descriptions
    text = "\n".join(listed)
    assert "pattern='\\\\d+', require_eos=True" in text and "args: url, reward=None" in text
    common = ["eval", str(base_model), "--num-prompts", "8", "--samples-per-prompt", "1", "--json"]

    def reward(*extra) -> float:
        assert main([*common, *extra]) == 0
        return json.loads(capsys.readouterr().out)["metrics"]["reward"]

    digits, letters = reward("--reward", "format"), reward("--reward", "format", "--reward-args", "{pattern: '[a-z]+'}")
    assert digits > 0 and letters == 0.0  # the arguments reached the reward
    assert main([*common, "--reward", "format", "--reward-args", "[1, 2]"]) == 2
    assert "must be a mapping" in capsys.readouterr().err


@pytest.mark.extended  # LoRA train + export in subprocesses (10 s): second CI tier, keeps scripts/test.sh short
def test_lora_runs_and_exports_print_no_library_warnings(base_model, tmp_path):
    done = regen("train", f"model.path={base_model}", *FAST, "train.steps=1", "data.eval=null", "run.dir=r",
                 "model.lora={r: 2, alpha: 4}", cwd=tmp_path)
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr
    done = regen("export", "r", "--out", "merged", cwd=tmp_path)
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr


def test_the_demo_says_what_it_does_and_how_long_before_anything_else():
    done = subprocess.run(["bash", "scripts/demo.sh", "--plan"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    assert "about 90 s" in done.stdout and "load average here is now" in done.stdout
