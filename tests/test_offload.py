"""Phase hooks, train.offload and distributed.colocate: the loop enters "sample", "update" and
"sync" every step, parking moves the optimizer moments and idle models (never AdamW's step
counters), the colocated run puts the sampler to sleep for the update and measures each phase's
peak memory, and turning either on changes no number of a CPU run (every modality)."""

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
    assert phases == ["sample", "update", "sync"] * 2
    assert flow_rl(tmp_path / "b", flow_base, "nft", "train.steps=2", "flow.weight_ema=0.5", "train.offload=true") == 0
    a, b = (read_jsonl(tmp_path / r / "metrics.jsonl") for r in "ab")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert [r.get("eval/reward") for r in a] == [r.get("eval/reward") for r in b]


def test_lm_loop_enters_the_phases(base_model, tmp_path, phases):
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path}", "rollout.global_batch_size=8",
                 "rollout.group_size=4", "rollout.max_new_tokens=4", "log.progress=none", "data.eval=null",
                 "log.tensorboard=false", "train.steps=2", "train.offload=true", "algorithm.kl_coef=0.1"]) == 0
    assert phases == ["sample", "update", "sync"] * 2


def test_phase_memory_is_each_phases_own_peak():
    """A phase that held 256 MB and freed it shows them; the next phase, which did not, does not:
    the peak is reset at each phase change (a lifetime peak would show 256 MB in both)."""
    meter = offload.PhaseMemory(torch.device("cpu"))
    if not meter.works:
        pytest.skip("no /proc/self/clear_refs (not Linux)")
    meter.hook("sample")
    big = torch.ones(64 * 2**20)  # 256 MB, written to: resident
    del big
    meter.hook("update")
    torch.ones(2**20).sum()  # 4 MB
    meter.hook("sync")
    meter.hook("sample")  # sync is not measured
    peaks = meter.pop()
    assert set(peaks) == {"memory/sample_peak_mb", "memory/update_peak_mb"}
    assert peaks["memory/sample_peak_mb"] - peaks["memory/update_peak_mb"] > 200
    assert meter.pop() == {}  # each step's figures once


def test_colocate_sleeps_the_sampler_for_the_update_measures_each_phase_and_changes_nothing(job, tmp_path,
                                                                                             monkeypatch):
    from regen.modalities.base import Modality
    from regen.modalities.lm import LMModality
    from regen.placement.local import LocalRollouts

    events: list[str] = []

    def spy(cls, name, label):
        if name not in vars(cls):
            return  # inherited: the class that defines it records the call
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, **k: (events.append(label), real(self, *a, **k))[1])

    for cls in (Modality, LMModality):
        spy(cls, "sampler_sleep", "sleep")
        spy(cls, "sampler_wake", "wake")
        spy(cls, "update", "update")
    spy(LocalRollouts, "next", "sample")
    spy(LocalRollouts, "sync", "sync")
    assert main(job.args(tmp_path / "a", "train.steps=2")) == 0
    assert "sleep" not in events and "wake" not in events
    events.clear()
    assert main(job.args(tmp_path / "b", "train.steps=2", "distributed.colocate=true")) == 0
    assert events == ["sample", "sleep", "update", "wake", "sync"] * 2
    a, b = (read_jsonl(tmp_path / r / "metrics.jsonl") for r in "ab")
    steps = [r for r in b if "loss" in r]
    assert len(steps) == 2 and all(r["memory/sample_peak_mb"] > 50 and r["memory/update_peak_mb"] > 50 for r in steps)
    plain = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))}  # noqa: E731
                          for r in rows]
    assert plain(a) == plain(b) and not any(k.startswith("memory/") for r in a for k in r)


def test_colocate_is_refused_where_the_trainer_does_not_sample(base_model, tmp_path, capsys):
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path / 'r'}", "distributed.mode=ray",
                 "distributed.colocate=true"]) == 2
    err = capsys.readouterr().err
    assert "distributed.colocate" in err and "distributed.mode single, auto or torchrun" in err
    assert not (tmp_path / "r").exists()


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
