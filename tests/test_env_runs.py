"""`regen train` with env: multi-turn episodes through the whole run (metrics, transcripts, PPO's
critic, resume), and the same episodes on torchrun ranks and Ray rollout actors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from regen.cli import main
from tests.conftest import read_jsonl, same_run

ROOT = Path(__file__).resolve().parents[1]
# a random-init 0.8M GPT-2 in the Echo game of tests/test_envs.py: 3 turns, observations of varied lengths
ECHO = ["model.init=calc-char-gpt2", "data.train=builtin:calc:train", "data.eval=builtin:calc:test", "task.digits=2",
        "task.test_size=40", "env.name=tests.test_envs:Echo", "env.max_turns=3", "env.max_tokens=40",
        "rollout.global_batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=6", "optim.lr=1e-3",
        "reward=[{name: env_reward}, {name: format, args: {pattern: '.*[0-4]', require_eos: false}}]",
        "eval.num_prompts=4", "eval.samples_per_prompt=2", "log.progress=none", "log.tensorboard=false",
        "run.threads=1"]


def test_episodes_run_through_training_evaluation_and_export(tmp_path, capsys):
    run = tmp_path / "echo"
    assert main(["train", *ECHO, f"run.dir={run}", "train.steps=2"]) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["episode/turns"] == 3.0 and 0 < r["episode/obs_token_frac"] < 1 and r["episode/truncated_frac"] == 0
        assert r["episode/env_reward"] == 12.0 and r["grad_norm"] > 0
    # the transcripts of the held-out episodes: turns and observations, in order
    sample = read_jsonl(run / "samples" / "step_00000002.jsonl")[0]
    assert len(sample["turns"]) == 3 and len(sample["observations"]) == 2
    assert all(o.startswith("=7") for o in sample["observations"]) and sample["completion"] == sample["turns"][-1]
    assert (run / "export" / "model.safetensors").is_file()
    # the report and `regen eval --show` show the transcripts, observations apart from the model's turns
    assert main(["report", str(run)]) == 0
    html = (run / "report.html").read_text()
    assert '<span class="lbl">model 3</span>' in html and f'<span class="lbl">env</span>{sample["observations"][0]}' in html
    capsys.readouterr()
    assert main(["eval", str(run), "--show", "1", "--num-prompts", "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("[model] ") == 3 and shown.count("[env]   \"=7") == 2, shown
    assert re.search(r"^turns +3\.0000$", shown, re.M) and re.search(r"^tool_calls +0\.0000$", shown, re.M), shown


def test_ppo_trains_on_episodes(tmp_path):
    run = tmp_path / "ppo"
    assert main(["train", *ECHO, f"run.dir={run}", "train.steps=2", "algorithm.name=ppo", "data.eval=null"]) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all(r["grad_norm"] > 0 for r in rows) and "critic/explained_var" in rows[-1]


@pytest.mark.parametrize("variant", [
    ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3", "algorithm.clip_high=0.28",
     "algorithm.overlong={max_len: 12, cache_len: 4, factor: 1.0}"],  # DAPO
    ["algorithm.name=gspo"], ["algorithm.advantage=rloo"],
    ["model.lora={r: 4, alpha: 8, target_modules: [c_attn]}", "algorithm.kl_coef=0.01"],
], ids=["dapo", "gspo", "rloo", "lora"])
def test_every_group_method_and_lora_train_on_episodes(tmp_path, variant):
    run = tmp_path / "v"
    assert main(["train", *ECHO, f"run.dir={run}", "train.steps=2", "data.eval=null", *variant]) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all(r["grad_norm"] > 0 and r["episode/turns"] == 3.0 for r in rows)


def test_env_keys_a_flow_run_does_not_read_and_bad_envs_are_refused(tmp_path, capsys):
    assert main(["train", *ECHO, f"run.dir={tmp_path / 'a'}", "env.name=tests.test_envs:Nope"]) == 2
    assert "env.name: module 'tests.test_envs' has no 'Nope'" in capsys.readouterr().err
    assert main(["train", *ECHO, f"run.dir={tmp_path / 'b'}", "env.args={turns: 2, colour: red}"]) == 2
    assert "env.args: tests.test_envs:Echo does not take these arguments" in capsys.readouterr().err
    assert main(["train", *ECHO, f"run.dir={tmp_path / 'c'}", "rollout.engine=vllm"]) == 2
    assert "env with rollout.engine=vllm" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.extended
def test_sigkill_during_a_multi_turn_run_resumes_bitwise(tmp_path):
    args = [*ECHO, "train.steps=6", "checkpoint.every=1", "checkpoint.keep_last=3", "data.eval=null"]
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert main(["train", *args, f"run.dir={ref}"]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "regen", "train", *args, f"run.dir={run}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from tests.conftest import sigkill_after_checkpoint

    sigkill_after_checkpoint(proc, run, 3, timeout_s=300)
    assert proc.returncode == -signal.SIGKILL
    assert main(["train", *args, f"run.dir={run}"]) == 0
    same_run(ref, run)


@pytest.mark.extended
def test_two_torchrun_ranks_sample_the_episodes_one_process_does(tmp_path):
    args = [*ECHO, "train.steps=2", "data.eval=null", "train.global_minibatch_size=8"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *args, f"run.dir={one}", "distributed.mode=single"]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "regen",
           "train", *args, f"run.dir={two}", "distributed.mode=torchrun"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows, ref = read_jsonl(two / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    for key in ("reward/mean", "episode/obs_token_frac", "episode/turns", "response_length/mean"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-6), key
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-4, abs=1e-6)


@pytest.mark.extended
def test_ray_rollout_actors_sample_the_episodes_one_process_does(tmp_path):
    pytest.importorskip("ray")
    args = [*ECHO, "train.steps=2", "data.eval=null"]
    one, spread = tmp_path / "one", tmp_path / "ray"
    assert main(["train", *args, f"run.dir={one}"]) == 0
    assert main(["train", *args, f"run.dir={spread}", "distributed.mode=ray", "distributed.rollout_workers=2",
                 "distributed.reward_workers=1"]) == 0
    rows, ref = read_jsonl(spread / "metrics.jsonl"), read_jsonl(one / "metrics.jsonl")
    for key in ("reward/mean", "episode/obs_token_frac", "episode/turns"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-6), key
