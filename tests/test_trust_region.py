"""flow.trust_region (regen/algorithms/trust_region.py): the bound on how far one optimizer step moves
an ODE method's velocity, checked by hand on a velocity linear in its weight and through real runs."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from regen.algorithms.trust_region import scale_step_, trust_region_scale, velocity_change
from regen.cli.main import main
from tests.conftest import flow_rl, read_jsonl

UNET = "export/unet/diffusion_pytorch_model.safetensors"


def test_a_linear_velocitys_step_is_scaled_to_the_bound_by_hand():
    """v = w x with x = (1, 2) as two one-element rows; a step w 1 -> 3: v (1, 2) -> (3, 6), squared
    changes (4, 16), D = 10. Bound 2.5: alpha = sqrt(2.5 / 10) = 1/2, w = 1 + 2/2 = 2, and then
    v = (2, 4): changes (1, 4), D = 2.5, the bound exactly (the velocity is linear in w)."""
    x = torch.tensor([[1.0], [2.0]])
    w0, w = torch.tensor(1.0), torch.tensor(3.0)
    both = torch.tensor([True, True])
    assert velocity_change(w * x, w0 * x, both) == (20.0, 2.0)
    alpha = trust_region_scale(20.0 / 2.0, 2.5)
    assert alpha == 0.5
    p = [w.clone()]
    scale_step_(p, [w0], alpha)
    assert p[0].item() == 2.0
    s, n = velocity_change(p[0] * x, w0 * x, both)
    assert s / n == pytest.approx(2.5, abs=1e-12)
    # the second row excluded (a NaN velocity there leaks nothing): D = 4, alpha = sqrt(2.5 / 4)
    first = torch.tensor([True, False])
    assert velocity_change(torch.tensor([[3.0], [math.nan]]), w0 * x, first) == (4.0, 1.0)
    assert trust_region_scale(4.0, 2.5) == pytest.approx(0.790569415, abs=1e-9)
    # within the bound the step stays; a non-finite change undoes it; the bound must be positive
    assert trust_region_scale(2.5, 2.5) == 1.0 and trust_region_scale(math.inf, 2.5) == 0.0
    with pytest.raises(ValueError, match="bound must be > 0"):
        trust_region_scale(1.0, 0.0)
    with pytest.raises(ValueError, match="shapes"):
        velocity_change(torch.zeros(2, 3), torch.zeros(2, 4), both)


@pytest.mark.parametrize("algo", ["nft", "dgpo"])
def test_a_bounded_step_is_the_free_step_scaled_toward_the_start(flow_base, tmp_path, algo):
    """One update from the base, once with a bound far above any change (it only measures D) and
    once with a bound a quarter of that D: the bounded weights are the free step scaled by
    alpha = sqrt(bound / D) = 1/2, every tensor, and the run logs that alpha."""
    free, bounded = tmp_path / "free", tmp_path / "bounded"
    one = ("train.steps=1", "optim.lr=1e-3")
    assert flow_rl(free, flow_base, algo, *one, "flow.trust_region=1e9") == 0
    row = train_row(free)
    change = row["trust/change"]
    assert change > 0 and row["trust/scale"] == 1.0
    assert flow_rl(bounded, flow_base, algo, *one, f"flow.trust_region={change / 4}") == 0
    row = train_row(bounded)
    assert row["trust/change"] == pytest.approx(change, rel=1e-6)  # the same proposed step
    assert row["trust/scale"] == pytest.approx(0.5, rel=1e-6) and row["trust/clipped"] == 1.0
    base = load_file(f"{flow_base}/unet/diffusion_pytorch_model.safetensors")
    wf, wb = load_file(str(free / UNET)), load_file(str(bounded / UNET))
    moved = [k for k in base if not torch.equal(wf[k], base[k])]
    assert moved
    for k in moved:
        torch.testing.assert_close(wb[k] - base[k], 0.5 * (wf[k] - base[k]), rtol=1e-4, atol=1e-7)


def train_row(run) -> dict:
    return next(r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r)


def test_the_bound_is_refused_where_no_method_reads_it(flow_base, tmp_path, capsys):
    """flow_grpo trains on SDE steps and has its own clipped ratio: flow.trust_region would do nothing there."""
    assert flow_rl(tmp_path / "r", flow_base, "flow_grpo", "train.steps=1", "flow.trust_region=0.01") != 0
    assert "flow.trust_region" in capsys.readouterr().err
    assert main(["train", "--help-config"]) == 0
    assert "trust_region" in capsys.readouterr().out


# step: (adherence, reward)
SCRIPT = {0: (0.50, 0.10), 1: (0.60, 0.20), 2: (0.70, 0.30), 3: (0.68, 0.29), 4: (0.50, 0.25), 5: (0.69, 0.31)}


@pytest.fixture
def scripted_eval(monkeypatch):
    """The held-out evaluation as it ran, its adherence and reward replaced from SCRIPT: a peak at
    step 2 and a fall of 0.2 at step 4 (the reward lower too: a held-out fall, not hacking)."""
    from regen.modalities.flow import FlowModality

    real = FlowModality.evaluate

    def evaluate(self, items, reward, run_dir, step, *a, **kw):
        out = real(self, items, reward, run_dir, step, *a, **kw)
        adherence, r = SCRIPT.get(step, (0.5, 0.25))
        return out | {"eval/adherence_accuracy": adherence, "eval/reward": r}

    monkeypatch.setattr(FlowModality, "evaluate", evaluate)


@pytest.mark.parametrize("rollback", [True, False])
def test_a_held_out_fall_rolls_back_to_the_peaks_checkpoint(flow_base, tmp_path, scripted_eval, rollback):
    """health.hacking_metric=adherence_accuracy: the fall at step 4 is an alert; with
    health.rollback_on_alert the weights go back to the checkpoint of step 2 (the peak, kept although
    keep_last=1 and step 3 is newer) and the learning rate halves; without it training goes on."""
    run = tmp_path / "r"
    assert flow_rl(run, flow_base, "nft", "train.steps=5", "eval.every=1", "checkpoint.every=1", "checkpoint.keep_last=1",
                   "health.hacking_metric=adherence_accuracy", f"health.rollback_on_alert={str(rollback).lower()}") == 0
    alerts = read_jsonl(run / "alerts.jsonl")
    falls = [a for a in alerts if a["kind"] == "heldout_fall"]
    assert [a["step"] for a in falls] == [4] and falls[0]["peak_step"] == 2 and "0.7 -> 0.5" in falls[0]["message"]
    backs = [a for a in alerts if a["kind"] == "rollback"]
    lr = {r["step"]: r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "lr" in r}
    if rollback:
        assert len(backs) == 1 and backs[0]["step"] == 4 and "step_00000002" in backs[0]["message"]
        assert lr[5] == pytest.approx(0.5 * lr[4])
    else:
        assert not backs and lr[5] == lr[4]
