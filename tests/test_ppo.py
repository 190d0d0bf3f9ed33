"""PPO with a critic, end to end on the tiny SFT base: learning, checkpoints, exact resume,
micro-batching, critic warm-up, rollback, config errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

import regen.modalities.lm
from regen.cli import main
from tests.conftest import read_jsonl
from tests.test_reliability import NaNAt

ENDS_EVEN = "reward=[{name: format, args: {pattern: '.*[02468]', require_eos: false}}]"
FAST = ["algorithm.name=ppo", "rollout.global_batch_size=16", "rollout.group_size=2", "rollout.max_new_tokens=5",
        "log.progress=none", "data.eval=null", "log.tensorboard=false", "optim.lr=1e-4", "critic.lr=1e-3",
        ENDS_EVEN]


def ppo(run, base, *extra):
    return main(["train", f"model.path={base}", f"run.dir={run}", *FAST, *extra])


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_ppo_learns_and_checkpoints_its_critic(base_model, tmp_path):
    run = tmp_path / "ppo"
    assert ppo(run, base_model, "train.steps=40", "optim.lr=3e-4", "checkpoint.every=20",
               "algorithm.kl_coef=0.01", "algorithm.kl_placement=reward") == 0
    rows = read_jsonl(run / "metrics.jsonl")
    first, last = (sum(r["reward/mean"] for r in rows[s]) / 10 for s in (slice(0, 10), slice(-10, None)))
    assert last > first + 0.1, (first, last)
    # the critic learns to predict the return: its loss falls and it explains some of the variance
    vl = [r["critic/value_loss"] for r in rows]
    assert sum(vl[-10:]) < sum(vl[:10])
    # (over the whole run: once the reward saturates, the returns hardly vary and explained variance,
    # 1 - Var(G - V) / Var(G), is dominated by that near-zero denominator)
    assert max(r["critic/explained_var"] for r in rows) > 0
    ck = run / "checkpoints" / "step_00000040"
    manifest = json.loads((ck / "manifest.json").read_text())["sha256"]
    assert {"critic/model.safetensors", "critic/config.json", "critic_optimizer.safetensors",
            "critic_optimizer.json"} <= set(manifest)
    conf = json.loads((ck / "critic" / "config.json").read_text())
    assert conf["architectures"] == ["GPT2ForTokenClassification"] and len(conf["id2label"]) == 1
    # the export is the policy alone: a causal LM without any value head
    assert not any("score" in k or "classifier" in k for k in weights(run / "export"))


def test_ppo_resume_is_exact_for_policy_and_critic(base_model, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert ppo(a, base_model, "train.steps=6", "checkpoint.every=3") == 0
    assert ppo(b, base_model, "train.steps=3") == 0
    assert ppo(b, base_model, "train.steps=6", "--resume") == 0
    for sub in ("model", "critic"):
        wa = weights(a / "checkpoints" / "step_00000006" / sub)
        wb = weights(b / "checkpoints" / "step_00000006" / sub)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), sub
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]  # noqa: E731
    assert strip(read_jsonl(a / "metrics.jsonl")) == strip(read_jsonl(b / "metrics.jsonl"))


def test_ppo_micro_batches_match_the_whole_minibatch(base_model, tmp_path):
    common = ["train.steps=2", "train.global_minibatch_size=8", "train.ppo_epochs=2"]
    assert ppo(tmp_path / "a", base_model, *common) == 0
    assert ppo(tmp_path / "b", base_model, *common, "train.micro_batch_size=2") == 0
    ra, rb = read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")
    for x, y in zip(ra, rb):
        for k in ("loss", "grad_norm", "critic/value_loss", "critic/grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-6), k


def test_critic_warmup_holds_the_policy(base_model, tmp_path):
    run = tmp_path / "warm"
    assert ppo(run, base_model, "train.steps=3", "critic.warmup_steps=3", "optim.lr=1e-2") == 0
    start, end = weights(base_model), weights(run / "export")
    assert all(torch.equal(start[k], end[k]) for k in start)
    critic = weights(run / "checkpoints" / "step_00000003" / "critic")
    assert any(r.get("critic/value_loss", 0) > 0 for r in read_jsonl(run / "metrics.jsonl"))
    base = {k.removeprefix("transformer."): v for k, v in start.items()}
    moved = [k for k, v in critic.items() if k.startswith("transformer.") and not torch.equal(
        v, base.get(k.removeprefix("transformer."), v))]
    assert moved, "the critic's backbone did not train during warm-up"


def test_critic_from_a_causal_lm_folder_and_bad_paths(base_model, tmp_path, capsys):
    assert ppo(tmp_path / "p", base_model, "train.steps=1", f"critic.path={base_model}") == 0
    assert ppo(tmp_path / "q", base_model, "train.steps=1", f"critic.path={tmp_path}") == 2
    assert "critic.path" in capsys.readouterr().err


def test_ppo_rollback_restores_policy_and_critic(base_model, tmp_path, monkeypatch):
    monkeypatch.setitem(regen.modalities.lm.POLICY_LOSSES, "ppo", NaNAt(regen.modalities.lm.POLICY_LOSSES["ppo"], {5, 6, 7}))
    run = tmp_path / "rb"
    restored = []
    real = regen.modalities.lm.load_critic

    def spy(cfg, device, state, alerts, *rest):
        out = real(cfg, device, state, alerts, *rest)
        restored.append(None if state is None else state["folder"].name)
        return out

    monkeypatch.setattr(regen.modalities.lm, "load_critic", spy)
    assert ppo(run, base_model, "train.steps=8", "checkpoint.every=2", "health.rollback_after_nonfinite=3") == 0
    kinds = [a["kind"] for a in read_jsonl(run / "alerts.jsonl")]
    assert "rollback" in kinds
    assert restored == [None, "step_00000004"]  # start, then the rollback to the last healthy checkpoint


@pytest.mark.parametrize("extra,msg", [
    (["algorithm.advantage=grpo"], "go together"),
    (["algorithm.name=grpo", "algorithm.advantage=gae"], "go together"),
    (["algorithm.name=grpo", "algorithm.advantage=grpo", "algorithm.kl_placement=reward"], "per-token"),
])
def test_ppo_config_errors(base_model, tmp_path, capsys, extra, msg):
    assert ppo(tmp_path / "x", base_model, *extra) == 2
    assert msg in capsys.readouterr().err


