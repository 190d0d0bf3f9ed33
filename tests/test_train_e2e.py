"""End-to-end runs of `regen train` on the tiny SFT base (seconds each on 2 cores)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from regen.cli import main
from tests.conftest import read_jsonl

FAST = ["rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=5",
        "log.progress=none", "data.eval=null", "optim.lr=1e-4"]

REQUIRED = {"step", "reward/mean", "reward/std", "loss", "kl", "clip_frac", "entropy", "time/step_s",
            "throughput/samples_per_s", "time/sample_s", "time/score_s", "time/update_s",
            "response_length/mean", "response_length/max", "reward/exact_match", "reward/zero_std_frac"}


# a reward with variance inside most groups even for a weak base: completions ending in an even digit
ENDS_EVEN = "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]"


def train(run, base, *extra):
    return main(["train", f"model.path={base}", f"run.dir={run}", *FAST, *extra])


def test_run_directory_contract(base_model, tmp_path):
    run = tmp_path / "run"
    assert train(run, base_model, "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=5") == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
    assert (run / "config.yaml").is_file() and "group_size: 4" in (run / "config.yaml").read_text()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_00000002", "step_00000004"]
    # the export is a plain Hugging Face folder that generates text with its tokenizer
    model = AutoModelForCausalLM.from_pretrained(run / "export")
    tok = AutoTokenizer.from_pretrained(run / "export")
    out = model.generate(**tok(["12+34="], return_tensors="pt"), max_new_tokens=4, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith("12+34=") and len(text) > len("12+34=")


def test_resume_is_exact(base_model, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert train(a, base_model, "train.steps=6", "checkpoint.every=3") == 0
    assert train(b, base_model, "train.steps=3") == 0
    assert main(["train", f"model.path={base_model}", f"run.dir={b}", *FAST, "train.steps=6", "--resume"]) == 0
    wa = load_file(str(a / "export" / "model.safetensors"))
    wb = load_file(str(b / "export" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]  # noqa: E731
    assert strip(read_jsonl(a / "metrics.jsonl")) == strip(read_jsonl(b / "metrics.jsonl"))


def test_kl_to_reference(base_model, tmp_path):
    run = tmp_path / "kl"
    assert train(run, base_model, "train.steps=4", "algorithm.kl_coef=0.1", "optim.lr=1e-3", ENDS_EVEN) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert rows[0]["kl"] == 0.0  # first step: policy == reference
    assert rows[-1]["kl"] > 0.0


def test_minibatches_and_epochs(base_model, tmp_path):
    run = tmp_path / "mb"
    assert train(run, base_model, "train.steps=3", "train.ppo_epochs=2", "train.global_minibatch_size=8",
                 "optim.lr=1e-3", ENDS_EVEN) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    # 4 optimizer steps per rollout batch: after the first, the behaviour policy's log-probs
    # (computed once before the update) differ from the current ones
    assert any(r["ratio_mean"] != 1.0 and r["approx_kl"] > 0 for r in rows)


def test_grpo_raises_a_learnable_reward(base_model, tmp_path):
    # Reward: completions whose first character is not "1" (rare for this base, ~10%).
    # Any policy-gradient bug (sign, masking, advantage) keeps this flat; a working loop
    # raises it within a few dozen steps.
    run = tmp_path / "learn"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "log.progress=none", "data.eval=null",
                 "rollout.global_batch_size=32", "rollout.group_size=8", "rollout.max_new_tokens=4",
                 "train.steps=30", "optim.lr=3e-4",
                 "reward=[{name: format, args: {pattern: '[02-9].*', require_eos: false}}]"]) == 0
    rewards = [r["reward/mean"] for r in read_jsonl(run / "metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, (first, last)


def test_existing_run_resumes_or_refuses(base_model, tmp_path, capsys):
    run = tmp_path / "twice"
    assert train(run, base_model, "train.steps=1") == 0
    # checkpoints present: the same command resumes (here: already complete, nothing to do)
    assert train(run, base_model, "train.steps=1") == 0
    assert "nothing to do" in capsys.readouterr().out
    assert len(read_jsonl(run / "metrics.jsonl")) == 1
    # metrics but no checkpoint (killed before its first one): nothing to resume, so it starts again
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 1}\n')
    assert train(other, base_model, "train.steps=1") == 0
    assert "stopped before its first checkpoint: starting it again" in capsys.readouterr().out
    # a finished run whose checkpoints were deleted is not overwritten silently
    shutil.rmtree(other / "checkpoints")
    assert train(other, base_model, "train.steps=1") == 2
    assert "already holds a finished run" in capsys.readouterr().err
    assert train(other, base_model, "train.steps=1", "run.overwrite=true") == 0


@pytest.mark.parametrize("verb", ["train", "sft"])
def test_resume_without_checkpoint(tmp_path, capsys, verb, base_model):
    assert main([verb, f"model.path={base_model}", f"run.dir={tmp_path}", "--resume"]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err


def test_dapo_dynamic_sampling_keeps_only_groups_with_signal(base_model, tmp_path):
    run = tmp_path / "dapo"
    assert train(run, base_model, "train.steps=4", "algorithm.dynamic_sampling=true",
                 "algorithm.max_sampling_rounds=2", "algorithm.clip_high=0.28",
                 "algorithm.overlong={max_len: 4, cache_len: 2}") == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert all({"dynamic/extra_rounds", "dynamic/dropped_groups", "dynamic/filled_frac"} <= set(r) for r in rows)
    assert all(r["dynamic/extra_rounds"] <= 2 for r in rows)
    assert any(r["dynamic/dropped_groups"] > 0 for r in rows)  # the weak base gives many all-zero groups
    full = [r for r in rows if r["dynamic/filled_frac"] == 1.0]
    assert all(r["reward/zero_std_frac"] == 0.0 for r in full)  # every kept group carries signal
    assert all("reward/overlong_penalty" in r for r in rows)
