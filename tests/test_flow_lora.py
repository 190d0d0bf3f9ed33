"""LoRA and the weight EMA on flow models, and rollback in the flow loop: what the
checkpoints and export hold is checked against the formulas (W + alpha/r B A; the EMA
recursion) computed here from the saved tensors."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from regen.config import LoraSettings, RLConfig
from regen.config.load import load_config
from regen.errors import UserError
from regen.policies.flow import FlowPolicy
from regen.policies.flow_lora import BaseView, add_lora, load_adapter, merged, save_adapter
from regen.train.run import Run
from tests.conftest import flow_rl, read_jsonl

UNET = "unet/diffusion_pytorch_model.safetensors"
LORA = "model.lora={r: 4, alpha: 8}"


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def test_lora_checkpoint_holds_the_adapter_and_export_merges_it(flow_base, tmp_path):
    run = tmp_path / "lora"
    assert flow_rl(run, flow_base, "flow_grpo", LORA, "train.steps=2", "flow.sde_window=2", "optim.lr=1e-2",
                   "algorithm.kl_coef=0.1") == 0
    model = ckpt(run, 2) / "model"
    assert sorted(p.name for p in model.iterdir()) == ["lora.json", "lora.safetensors"]
    adapter = load_file(str(model / "lora.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    base, export = load_file(f"{flow_base}/{UNET}"), load_file(str(run / "export" / UNET))
    # an adapted linear layer exports as W + (alpha / r) B A (Hu et al. 2022, eq. 3)
    name = "down_blocks.0.resnets.0.time_emb_proj"
    a, b = adapter[f"{name}.lora_A.default.weight"], adapter[f"{name}.lora_B.default.weight"]
    assert b.abs().sum() > 0  # trained
    torch.testing.assert_close(export[f"{name}.weight"], base[f"{name}.weight"] + 2.0 * b @ a, rtol=0, atol=1e-6)
    adapted = {k.split(".lora_")[0] for k in adapter}
    assert export.keys() == base.keys()
    assert all(torch.equal(export[k], base[k]) for k in base if k.rsplit(".", 1)[0] not in adapted)
    # the KL reference is the base (adapter off): zero at the first step (B = 0), then positive
    kl = [r["kl"] for r in read_jsonl(run / "metrics.jsonl") if "kl" in r]
    assert kl[0] == 0.0 and kl[1] > 0


def test_base_view_is_the_model_before_the_adapter():
    policy = FlowPolicy.builtin(False, 0, torch.device("cpu"))
    x, t, c = torch.randn(2, 3, 16, 16), torch.tensor([500.0, 100.0]), torch.randn(2, 128)
    before = policy.unet(x, t, class_labels=c).sample
    add_lora(policy.unet, LoraSettings(r=2, alpha=4), seed=0)
    for n, p in policy.unet.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    after = policy.unet(x, t, class_labels=c).sample
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(BaseView(policy.unet)(x, t, class_labels=c).sample, before, rtol=0, atol=0)
    torch.testing.assert_close(merged(policy.unet)(x, t, class_labels=c).sample, after, rtol=1e-5, atol=1e-5)


@pytest.mark.extended  # three flow LoRA runs (8 s): second CI tier, keeps scripts/test.sh short
def test_lora_with_weight_ema_resumes_exactly(flow_base, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["nft", LORA, "flow.weight_ema=0.5", "optim.lr=1e-3", "flow.ema_rate=0.2"]
    assert flow_rl(a, flow_base, *common, "train.steps=4", "checkpoint.every=2") == 0
    assert flow_rl(b, flow_base, *common, "train.steps=2") == 0
    assert flow_rl(b, flow_base, *common, "train.steps=4", "--resume") == 0
    for sub in ("model/lora.safetensors", "nft_old.safetensors", "weight_ema.safetensors"):
        wa, wb = load_file(str(ckpt(a, 4) / sub)), load_file(str(ckpt(b, 4) / sub))
        assert wa.keys() == wb.keys() and all(".lora_" in k for k in wa), sub
        assert all(torch.equal(wa[k], wb[k]) for k in wa), sub
    ra = [r for r in read_jsonl(a / "metrics.jsonl") if "loss" in r]
    rb = [r for r in read_jsonl(b / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]


def test_weight_ema_follows_the_recursion_and_is_exported(flow_base, tmp_path):
    run, d = tmp_path / "ema", 0.5
    assert flow_rl(run, flow_base, "awm", "train.steps=2", "checkpoint.every=1", f"flow.weight_ema={d}",
                   "optim.lr=1e-2") == 0
    w0 = load_file(f"{flow_base}/{UNET}")
    w1, w2 = (load_file(str(ckpt(run, s) / "model" / UNET)) for s in (1, 2))
    ema, export = load_file(str(ckpt(run, 2) / "weight_ema.safetensors")), load_file(str(run / "export" / UNET))
    assert ema.keys() == w0.keys()
    moved = 0
    for k in w0:
        expect = d * (d * w0[k] + (1 - d) * w1[k]) + (1 - d) * w2[k]
        torch.testing.assert_close(ema[k], expect, rtol=1e-6, atol=1e-7)
        assert torch.equal(export[k], ema[k])  # export/ holds the EMA, not the last weights
        moved += int(not torch.equal(w2[k], ema[k]))
    assert moved > 0


def test_lora_is_refused_in_flow_pretraining(tmp_path, capsys):
    from regen.cli import main

    assert main(["sft", "model.init=shapes-unet", "data.train=builtin:shapes:train", f"run.dir={tmp_path}",
                 LORA, "sft.steps=1"]) == 2
    assert "model.lora" in capsys.readouterr().err


def _run(flow_base, run_dir, *extra) -> Run:
    cfg = load_config(RLConfig, None, [
        f"model.path={flow_base}", "algorithm.name=nft", f"run.dir={run_dir}", "data.train=builtin:shapes:train",
        "data.eval=null", "rollout.global_batch_size=8", "rollout.group_size=4", "flow.steps=4",
        "log.progress=none", "log.tensorboard=false", "reward=[{name: brightness, args: {target: 0.6}}]", *extra])
    return Run.start(cfg)


def test_rollback_restores_weights_optimizer_and_old_policies(flow_base, tmp_path):
    run = _run(flow_base, tmp_path / "rb", "flow.weight_ema=0.9", "health.rollback_lr_factor=0.5")
    for p in run.m.policy.unet.parameters():  # an optimizer state worth restoring
        p.grad = torch.ones_like(p)
    run.opt.step()
    run.m.after_update(1)
    saved = {k: v.clone() for k, v in run.m.policy.unet.state_dict().items()}
    saved_ema = {k: v.clone() for k, v in run.m.weight_ema.state_dict().items()}
    saved_old = {k: v.clone() for k, v in run.m.ema.state_dict().items()}
    saved_opt = {k: v.clone() for k, v in run.opt.state_dict()["state"][0].items()}
    folder = run.save(1)
    with torch.no_grad():  # the run goes bad
        for net in (run.m.policy.unet, run.m.weight_ema, run.m.ema):
            for p in net.parameters():
                p.add_(1.0)
    run.opt.step()
    run.rollback(2)
    for net, want in ((run.m.policy.unet, saved), (run.m.weight_ema, saved_ema), (run.m.ema, saved_old)):
        got = net.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(run.opt.state_dict()["state"][0][k], v) for k, v in saved_opt.items())
    assert run.health.lr_scale == 0.5 and run.health.rollbacks == 1
    run.close()
    alerts = read_jsonl(run.run_dir / "alerts.jsonl")
    assert alerts[-1]["kind"] == "rollback" and folder.name in alerts[-1]["message"]


def test_a_checkpoint_without_its_adapter_is_a_clear_error(tmp_path):
    policy = FlowPolicy.builtin(False, 0, torch.device("cpu"))
    add_lora(policy.unet, LoraSettings(r=2, alpha=4), seed=0)
    with pytest.raises(UserError, match="no lora.safetensors"):
        load_adapter(policy.unet, tmp_path)
    other = FlowPolicy.builtin(False, 0, torch.device("cpu"))
    add_lora(other.unet, LoraSettings(r=2, alpha=4, target_modules=["conv1"]), seed=0)
    save_adapter(other.unet, tmp_path, LoraSettings(r=2, alpha=4, target_modules=["conv1"]))
    with pytest.raises(UserError, match="does not fit the model"):
        load_adapter(policy.unet, tmp_path)
