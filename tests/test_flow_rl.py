"""RL of the built-in flow-matching shapes model, end to end: every method runs through
`regen train`, per-step methods start exactly on-policy, NFT keeps its EMA in checkpoints and
resumes exactly, micro-batching leaves the update unchanged, mismatched model/method is a clear
error, and rewards go up."""

import json

import pytest
import torch
from safetensors.torch import load_file

from regen.cli import main
from tests.conftest import flow_rl, read_jsonl

rl = flow_rl


@pytest.mark.parametrize("algo", ["flow_grpo", "flow_dppo"])
def test_per_step_methods_start_exactly_on_policy(flow_base, tmp_path, algo):
    assert rl(tmp_path / algo, flow_base, algo, "train.steps=2", "flow.sde_window=2") == 0
    rows = [r for r in read_jsonl(tmp_path / algo / "metrics.jsonl") if "reward/mean" in r]
    assert rows[0]["ratio_mean"] == 1.0 and rows[0]["sde_steps"] == 2.0
    assert rows[0].get("clip_frac", 0.0) == 0.0 and rows[0].get("masked_frac", 0.0) == 0.0
    samples = read_jsonl(tmp_path / algo / "samples" / "step_00000002.jsonl")
    assert len(samples) == 4 and (tmp_path / algo / samples[0]["image"]).is_file()


def test_flow_grpo_kl_and_two_epochs(flow_base, tmp_path):
    assert rl(tmp_path / "kl", flow_base, "flow_grpo", "train.steps=2", "algorithm.kl_coef=0.1", "train.ppo_epochs=2",
              "train.global_minibatch_size=4", "optim.lr=1e-3") == 0
    rows = [r for r in read_jsonl(tmp_path / "kl" / "metrics.jsonl") if "reward/mean" in r]
    assert all(r["kl"] >= 0 for r in rows) and rows[-1]["kl"] > 0  # the policy moved away from the base


def test_flow_grpo_micro_batches_match(flow_base, tmp_path):
    common = ["train.steps=2", "flow.sde_window=2", "optim.lr=1e-3"]
    assert rl(tmp_path / "a", flow_base, "flow_grpo", *common) == 0
    assert rl(tmp_path / "b", flow_base, "flow_grpo", *common, "train.micro_batch_size=2") == 0
    for x, y in zip(read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")):
        if "loss" in x:
            assert y["loss"] == pytest.approx(x["loss"], abs=1e-6)
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_nft_checkpoints_its_ema_and_resumes_exactly(flow_base, tmp_path):
    """With a KL to the base (algorithm.kl_coef): a resumed run rebuilds the base, not its checkpoint."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ("flow.ema_rate=0.2", "algorithm.kl_coef=0.1", "optim.lr=1e-3")
    assert rl(a, flow_base, "nft", "train.steps=4", "checkpoint.every=2", *common) == 0
    assert rl(b, flow_base, "nft", "train.steps=2", *common) == 0
    assert rl(b, flow_base, "nft", "train.steps=4", *common, "--resume") == 0
    kl = [r["kl"] for r in read_jsonl(a / "metrics.jsonl") if "reward/mean" in r]
    assert len(kl) == 4 and kl[0] == 0.0 and kl[-1] > 0  # step 1 trains the base itself
    # `regen eval` takes a flow run's export/ folder itself (flow_policy.json), like the run: same weights
    flags = ["--config", str(a / "config.yaml"), "--num-prompts", "2", "--samples-per-prompt", "2"]
    assert main(["eval", str(a / "export"), *flags, "--out", str(a / "e1.json")]) == 0
    assert main(["eval", str(a), *flags, "--out", str(a / "e2.json")]) == 0
    e1, e2 = (json.loads((a / f).read_text())["metrics"] for f in ("e1.json", "e2.json"))
    assert e1 == e2 and "reward" in e1
    manifest = json.loads((a / "checkpoints" / "step_00000004" / "manifest.json").read_text())["sha256"]
    assert "nft_old.safetensors" in manifest
    for sub in ("model/unet/diffusion_pytorch_model.safetensors", "nft_old.safetensors"):
        wa = load_file(str(a / "checkpoints" / "step_00000004" / sub))
        wb = load_file(str(b / "checkpoints" / "step_00000004" / sub))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), sub
    # the EMA trails the policy: after training they differ
    w = load_file(str(a / "checkpoints" / "step_00000004" / "model" / "unet" / "diffusion_pytorch_model.safetensors"))
    e = load_file(str(a / "checkpoints" / "step_00000004" / "nft_old.safetensors"))
    assert w.keys() == e.keys() and any(not torch.equal(w[k], e[k]) for k in w)


@pytest.mark.parametrize("algo", ["nft", "awm", "dgpo"])
def test_ode_methods_raise_the_reward(flow_base, tmp_path, algo):
    run = tmp_path / algo
    assert rl(run, flow_base, algo, "train.steps=16", "optim.lr=1e-3", "rollout.global_batch_size=16") == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    first, last = (sum(r["reward/mean"] for r in rows[s]) / 4 for s in (slice(0, 4), slice(-4, None)))
    assert last > first + 0.02, (first, last)


def test_model_and_method_must_match(flow_base, base_model, tmp_path, capsys):
    assert main(["train", f"model.path={flow_base}", "algorithm.name=grpo", f"run.dir={tmp_path / 'x'}"]) == 2
    assert "is a flow-matching model" in capsys.readouterr().err
    assert main(["train", f"model.path={base_model}", "algorithm.name=nft", f"run.dir={tmp_path / 'y'}"]) == 2
    assert "language model" in capsys.readouterr().err
