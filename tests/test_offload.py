"""Phase hooks and train.offload: both loops enter "sample" then "update" every step, parking
moves the optimizer moments and idle models (never AdamW's step counters), and turning it on
changes no number of a CPU run."""

import pytest
import torch

from regen.cli import main
from regen.runtime import offload
from tests.conftest import flow_rl, read_jsonl


def adam_with_state():
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    return net, opt


def test_optimizer_to_moves_the_moments_not_the_step_counter():
    _, opt = adam_with_state()
    offload.optimizer_to(opt, torch.device("meta"))
    for state in opt.state.values():
        assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"


def test_parking_brings_state_to_the_device_for_the_update_and_leaves_cpu_runs_alone():
    net, opt = adam_with_state()
    idle = torch.nn.Linear(2, 2)
    offload.parking(torch.device("meta"), [opt, None], [idle, None, "not a module"])("update")
    assert idle.weight.device.type == "meta"
    assert all(s["exp_avg"].device.type == "meta" for s in opt.state.values())
    net, opt = adam_with_state()
    before = [s["exp_avg"] for s in opt.state.values()]
    offload.parking(torch.device("cpu"), [opt], [])("sample")
    assert all(a is b for a, b in zip(before, [s["exp_avg"] for s in opt.state.values()]))


def test_hooks_reject_unknown_phases():
    with pytest.raises(ValueError, match="phase"):
        offload.PhaseHooks().on("score", print)


@pytest.fixture
def phases(monkeypatch):
    seen: list[str] = []
    real = offload.PhaseHooks.enter
    monkeypatch.setattr(offload.PhaseHooks, "enter", lambda self, phase: (seen.append(phase), real(self, phase)))
    return seen


def test_flow_loop_enters_the_phases_and_offload_changes_nothing_on_cpu(flow_base, tmp_path, phases):
    assert flow_rl(tmp_path / "a", flow_base, "nft", "train.steps=2", "flow.weight_ema=0.5") == 0
    assert phases == ["sample", "update"] * 2
    assert flow_rl(tmp_path / "b", flow_base, "nft", "train.steps=2", "flow.weight_ema=0.5", "train.offload=true") == 0
    a, b = (read_jsonl(tmp_path / r / "metrics.jsonl") for r in "ab")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert [r.get("eval/reward") for r in a] == [r.get("eval/reward") for r in b]


def test_lm_loop_enters_the_phases(base_model, tmp_path, phases):
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path}", "rollout.global_batch_size=8",
                 "rollout.group_size=4", "rollout.max_new_tokens=4", "log.progress=none", "data.eval=null",
                 "log.tensorboard=false", "train.steps=2", "train.offload=true", "algorithm.kl_coef=0.1"]) == 0
    assert phases == ["sample", "update"] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parking_on_cuda_round_trip():
    net = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 64, device="cuda")).sum().backward()
    opt.step()
    ref = torch.nn.Linear(64, 64).cuda()
    park = offload.parking(torch.device("cuda"), [opt], [ref])
    park("sample")
    assert ref.weight.device.type == "cpu" and all(s["exp_avg"].is_cpu for s in opt.state.values())
    park("update")
    assert ref.weight.is_cuda and all(s["exp_avg"].is_cuda for s in opt.state.values())
    opt.step()  # the optimizer still works with its state back on the device
