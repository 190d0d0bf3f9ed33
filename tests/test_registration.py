"""A method and a modality are each declared once (regen/config/registry.py), and that one
registration is all regen needs: this file adds a flow method and a whole modality from here,
with no file under regen/ changed, and trains both through the real loop (`regen train`).

- `rwr`: a reward-weighted flow-matching loss on ODE samples, its code a FlowMethod subclass
  below and its declaration one `register_method` call. Config validation, the unread-key
  check and `--help-config` know it from that call.
- `toy`: a "policy" that samples numbers from a Gaussian, rewarded for landing near 3. Its
  adapter implements the protocol of regen/modalities/base.py; it trains, checkpoints, resumes
  bitwise and exports through the same Run as every other run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from regen.algorithms.advantages import grpo_advantages
from regen.cli import main
from regen.config.flow_methods import ODE
from regen.config.registry import METHODS, MODALITIES, Method, Modality, always, register_method, register_modality
from regen.modalities.base import Advantages
from regen.modalities.base import Modality as Adapter
from regen.modalities.flow_methods import ODEMethod
from regen.rewards import Sample
from tests.conftest import FLOW_FAST, read_jsonl

# ----------------------------------------------------------------------------- a flow method


class RWR(ODEMethod):
    """Reward-weighted regression: the flow-matching loss at each sample's point, weighted by its
    advantage (mean over the minibatch's valid rows)."""

    calls = 0

    def point_loss(self, mini, pos, rows, x0, xt, eps, t, cond, v):
        RWR.calls += 1
        valid = mini.adv.valid[rows].float()
        fm = (v - (eps - x0)).pow(2).flatten(1).mean(1)
        loss = (mini.adv.adv[rows] * fm * valid).sum() / max(float(mini.adv.valid[mini.idx].sum()), 1.0)
        return loss, {"rwr_fm": float((fm.detach() * valid).sum() / valid.sum().clamp(min=1))}


@pytest.fixture
def rwr():
    m = register_method(Method("rwr", "flow", "reward-weighted flow matching (a test's method)", reads=ODE,
                               impl=f"{__name__}:RWR"))
    yield m
    METHODS.pop("rwr")


def test_a_flow_method_registered_from_outside_trains_through_the_loop(rwr, tmp_path, capsys):
    run = tmp_path / "rwr"
    RWR.calls = 0
    args = ["train", "model.init=shapes-unet", f"run.dir={run}", *FLOW_FAST, "algorithm.name=rwr", "train.steps=2"]
    assert main(args) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2 and all(r["rwr_fm"] > 0 for r in rows) and RWR.calls == 2
    assert (run / "export" / "flow_policy.json").is_file()
    # the declaration is what the reads check consults: an SDE key is refused for this ODE method
    capsys.readouterr()
    assert main([*args[:-1], f"run.dir={tmp_path / 'x'}", "flow.noise_level=0.5"]) == 2
    assert "flow.noise_level is not read by algorithm.name=rwr (flow-matching models)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["train", "--help-config"]) == 0
    assert "'rwr' (reward-weighted flow matching (a test's method))" in capsys.readouterr().out


def test_an_unknown_method_names_the_registered_ones(tmp_path, capsys):
    assert main(["train", "model.init=shapes-unet", f"run.dir={tmp_path / 'r'}", "algorithm.name=rwr"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'rwr'" in err and "nft" in err and "grpo" in err


def test_a_registration_is_refused_twice_and_needs_its_modality(rwr):
    with pytest.raises(ValueError, match="already registered"):
        register_method(Method("rwr", "flow", "another", impl="x:Y"))
    with pytest.raises(ValueError, match="modality 'sound' is not registered"):
        register_method(Method("hum", "sound", "a method of a modality nobody registered"))


# ----------------------------------------------------------------------------- a modality


class ToyPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = torch.nn.Parameter(torch.zeros(1))
        self.log_std = torch.nn.Parameter(torch.zeros(1))


@dataclass
class ToyPlan:
    z: torch.Tensor  # (B,) standard normal draws, the step's randomness for the whole batch

    def select(self, rows: torch.Tensor) -> ToyPlan:
        return ToyPlan(self.z[rows])


@dataclass
class ToyBatch:
    x: torch.Tensor  # (B,) the sampled numbers

    def to(self, device) -> ToyBatch:
        return ToyBatch(self.x.to(device))

    def select(self, rows) -> ToyBatch:
        return ToyBatch(self.x[rows])


class ToyModality(Adapter):
    kind = "toy"

    def __init__(self, cfg, device, dist, state=None, alerts=None, sampler_only=False):
        self.cfg, self.device, self.dist, self.gen_device = cfg, device, dist, torch.device("cpu")
        self.policy = ToyPolicy()
        if state is not None:
            self.policy.load_state_dict(load_file(str(Path(state["model_dir"]) / "toy.safetensors")))

    @property
    def trained(self):
        return self.policy

    def plan(self, gen, step, again=False):
        return ToyPlan(torch.randn(self.cfg.rollout.global_batch_size, generator=gen))

    @torch.no_grad()
    def sample(self, prompts, n, plan, behaviour=False):
        return ToyBatch(self.policy.mu + self.policy.log_std.exp() * plan.z)

    def concat(self, parts):
        return ToyBatch(torch.cat([p.x for p in parts]))

    def sync_state(self):
        return {k: v.detach().cpu() for k, v in self.policy.state_dict().items()}

    def reward_samples(self, items, batch):
        n = self.cfg.rollout.group_size
        return [Sample(items[i // n].prompt, f"{float(x):.6f}", dict(items[i // n].meta)) for i, x in enumerate(batch.x)]

    def advantages(self, rewards, batch, fixed):
        adv, valid, m = grpo_advantages(rewards, self.cfg.rollout.group_size)  # regen's own, missing_frac included
        return Advantages(adv.float(), valid, valid[:, None].float(), m)

    def minibatch(self, batch, idx, adv, fixed, gen):
        return batch, idx, adv

    def micro_loss(self, mini, pos):
        batch, idx, adv = mini
        rows = idx[pos]
        p = self.policy
        logp = torch.distributions.Normal(p.mu, p.log_std.exp()).log_prob(batch.x[rows])
        loss = -(adv.adv[rows] * logp).sum() / len(idx)  # REINFORCE with the group baseline
        return loss, {"toy_mu": float(p.mu.detach())}

    def save(self, folder, gathered):
        (folder / "model").mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().clone() for k, v in self.policy.state_dict().items()},
                  str(folder / "model" / "toy.safetensors"))

    def restore(self, folder):
        fresh = ToyPolicy().state_dict()
        self.policy.load_state_dict(fresh if folder is None else load_file(str(folder / "model" / "toy.safetensors")))

    def export(self, folder, gathered):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().clone() for k, v in self.policy.state_dict().items()}, str(folder / "toy.safetensors"))

    def evaluate(self, items, reward, run_dir, step, quality=None, task=None):
        x = float(self.policy.mu.detach())  # the policy's mode
        total, _ = reward([Sample(it.prompt, f"{x:.6f}", dict(it.meta)) for it in items])
        return {"eval/reward": sum(total) / len(total)}


def near_three(samples, **_):
    return [-((float(s.completion) - 3.0) ** 2) for s in samples]


@pytest.fixture
def toy():
    register_modality(Modality("toy", "toy numbers", f"{__name__}:ToyModality", reads=always("run.seed")))
    register_method(Method("toy_pg", "toy", "REINFORCE on numbers (a test's modality)"))
    yield
    METHODS.pop("toy_pg")
    MODALITIES.pop("toy")


def _toy(run: Path, data: Path, *extra: str) -> int:
    return main(["train", "model.init=toy", "algorithm.name=toy_pg", f"run.dir={run}", f"data.train={data}",
                 f"data.eval={data}", "eval.every=0", "rollout.global_batch_size=16", "rollout.group_size=8",
                 f"reward=[{{name: '{__name__}:near_three'}}]", "optim.lr=0.1", "log.progress=none",
                 "log.tensorboard=false", *extra])


def test_a_modality_registered_from_outside_trains_resumes_and_exports(toy, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"number {i}"}) + "\n" for i in range(4)))
    a, b = tmp_path / "a", tmp_path / "b"
    assert _toy(a, data, "train.steps=30", "checkpoint.every=15") == 0
    rows = [r for r in read_jsonl(a / "metrics.jsonl") if "toy_mu" in r]
    assert len(rows) == 30 and rows[-1]["toy_mu"] > 1.0  # moved from 0 toward the rewarded 3
    evals = [r["eval/reward"] for r in read_jsonl(a / "metrics.jsonl") if "eval/reward" in r]
    assert evals[-1] > evals[0] + 1.0  # held-out reward before and after training
    # the same run in two parts: the checkpoint holds everything (weights, optimizer, RNG, data order)
    assert _toy(b, data, "train.steps=15") == 0
    assert _toy(b, data, "train.steps=30", "--resume") == 0
    wa, wb = load_file(str(a / "export" / "toy.safetensors")), load_file(str(b / "export" / "toy.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the modality's declared reads: a language-model key is refused for it, naming the modality
    capsys.readouterr()
    assert _toy(tmp_path / "c", data, "rollout.temperature=0.5") == 2
    assert "rollout.temperature is not read by algorithm.name=toy_pg (toy numbers)" in capsys.readouterr().err
