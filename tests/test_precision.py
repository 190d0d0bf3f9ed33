"""train.precision: forward passes in bf16/fp16 under autocast, weights and log-probs in fp32,
on-policy ratio still exactly 1, fp16 loss scaling skips overflowing steps; and
train.gradient_checkpointing, which must not change a number."""

import pytest
import torch
from safetensors.torch import load_file

from regen.cli import main
from regen.runtime.precision import Precision
from tests.conftest import flow_rl, read_jsonl

CPU = torch.device("cpu")


def test_autocast_runs_matmuls_in_half_and_leaves_fp32_alone():
    w = torch.randn(4, 4)
    with Precision("bf16", CPU).autocast():
        assert (w @ w).dtype == torch.bfloat16
    with Precision("fp32", CPU).autocast():
        assert (w @ w).dtype == torch.float32
    with pytest.raises(ValueError, match="precision"):
        Precision("fp8", CPU)


def test_fp16_loss_scaling_unscales_before_clipping_and_skips_overflow():
    net = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    prec = Precision("fp16", CPU)
    scale = prec.scaler.get_scale()
    loss = net(torch.tensor([[3.0, 4.0]])).sum()  # d loss / d w = [3, 4], norm 5
    prec.backward(loss)
    assert torch.allclose(net.weight.grad, torch.tensor([[3.0, 4.0]]) * scale)  # scaled
    norm, ok = prec.step(opt, list(net.parameters()), grad_clip=1.0)
    assert ok and float(norm) == pytest.approx(5.0)  # the norm of the unscaled gradient
    # clipped to norm 1 -> [.6, .8]; w = 1 - .1 * [.6, .8]
    assert torch.allclose(net.weight.detach(), torch.tensor([[0.94, 0.92]]))
    opt.zero_grad()
    prec.backward(net(torch.tensor([[float("inf"), 1.0]])).sum())
    before = net.weight.detach().clone()
    _, ok = prec.step(opt, list(net.parameters()), grad_clip=1.0)
    assert not ok and torch.equal(net.weight.detach(), before) and prec.scaler.get_scale() < scale


def test_lm_run_in_bf16_keeps_fp32_weights_and_starts_on_policy(base_model, tmp_path):
    runs = {}
    for mode in ("fp32", "bf16"):
        run = tmp_path / mode
        assert main(["train", f"model.path={base_model}", f"run.dir={run}", "rollout.global_batch_size=16",
                     "rollout.group_size=4", "rollout.max_new_tokens=4", "log.progress=none", "data.eval=null",
                     "log.tensorboard=false", "train.steps=2", "algorithm.kl_coef=0.05", "train.ppo_epochs=2",
                     f"train.precision={mode}"]) == 0
        runs[mode] = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
        weights = load_file(str(run / "export" / "model.safetensors"))
        assert all(v.dtype == torch.float32 for v in weights.values())
    bf16 = runs["bf16"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in bf16)
    assert bf16[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # 2 epochs: the mean over both passes
    assert runs["fp32"][0]["kl"] == pytest.approx(bf16[0]["kl"], abs=0.05)


def test_flow_run_in_bf16_is_exactly_on_policy_at_the_first_update(flow_base, tmp_path):
    run = tmp_path / "bf16"
    assert flow_rl(run, flow_base, "flow_grpo", "train.steps=2", "flow.sde_window=2", "train.precision=bf16") == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert rows[0]["ratio_mean"] == 1.0 and all(r["nonfinite_skipped"] == 0 for r in rows if "nonfinite_skipped" in r)
    weights = load_file(str(run / "export" / "unet" / "diffusion_pytorch_model.safetensors"))
    assert all(v.dtype == torch.float32 for v in weights.values())
    assert flow_rl(tmp_path / "fp16", flow_base, "nft", "train.steps=2", "train.precision=fp16") == 0


def test_gradient_checkpointing_changes_no_number(flow_base, tmp_path, capsys):
    common = ["train.steps=2", "flow.sde_window=2", "optim.lr=1e-3"]
    assert flow_rl(tmp_path / "a", flow_base, "flow_grpo", *common) == 0
    assert flow_rl(tmp_path / "b", flow_base, "flow_grpo", *common, "train.gradient_checkpointing=true") == 0
    a, b = (read_jsonl(tmp_path / r / "metrics.jsonl") for r in "ab")
    for x, y in zip(a, b):
        if "loss" in x:
            assert y["loss"] == pytest.approx(x["loss"], abs=1e-7) and y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
    wa, wb = (load_file(str(tmp_path / r / "export" / "unet" / "diffusion_pytorch_model.safetensors")) for r in "ab")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_gradient_checkpointing_is_refused_for_language_models(base_model, tmp_path, capsys):
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path}", "train.gradient_checkpointing=true"]) == 2
    err = capsys.readouterr().err
    assert "train.gradient_checkpointing is not read by algorithm.name=grpo" in err and "KV cache" in err
