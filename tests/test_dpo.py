import math

import pytest
import torch

from regen.algorithms import dpo_loss
from regen.cli import main
from regen.config import TaskConfig
from regen.data import load_pairs
from tests.conftest import read_jsonl


def test_dpo_sigmoid_loss_by_hand():
    # pair 1: h = (-1 - -3) - (-2 - -2) = 2; beta 0.5 -> beta*h = 1; -log sigma(1) = log(1 + e^-1) = 0.3132617
    # pair 2: h = (-4 - -1) - (-3 - -3) = -3 -> beta*h = -1.5; -log sigma(-1.5) = log(1 + e^1.5) = 1.7014132
    pc, pr = torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-2.0, -3.0]), torch.tensor([-2.0, -3.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(1.5))) / 2, abs=1e-6)
    # implicit rewards 0.5 * (pi - ref): chosen [0.5, -0.5], rejected [-0.5, 1.0]
    assert m["rewards/chosen"].item() == pytest.approx(0.0)
    assert m["rewards/rejected"].item() == pytest.approx(0.25)
    assert m["rewards/margin"].item() == pytest.approx(-0.25)
    assert m["rewards/accuracy"].item() == pytest.approx(0.5)


def test_dpo_label_smoothing_and_ipo_by_hand():
    one = torch.tensor([0.0])
    h2 = (torch.tensor([2.0]), one, one, one)  # h = 2
    # ls 0.1, beta 1: 0.9 * log(1 + e^-2) + 0.1 * log(1 + e^2)
    loss, _ = dpo_loss(*h2, beta=1.0, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * math.log1p(math.exp(-2)) + 0.1 * math.log1p(math.exp(2)), abs=1e-6)
    # IPO, beta 0.25: (h - 1/(2*0.25))^2 = (2 - 2)^2 = 0; beta 0.5: (2 - 1)^2 = 1
    assert dpo_loss(*h2, beta=0.25, kind="ipo")[0].item() == pytest.approx(0.0)
    assert dpo_loss(*h2, beta=0.5, kind="ipo")[0].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown DPO loss"):
        dpo_loss(*h2, kind="hinge2")


def test_dpo_gradient_direction():
    pc = torch.tensor([-2.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1)
    loss.backward()
    # at h = 0: dL/dpc = -beta * sigma(0) = -0.05, dL/dpr = +0.05
    assert pc.grad.item() == pytest.approx(-0.05) and pr.grad.item() == pytest.approx(0.05)


def test_builtin_pairs_and_jsonl(tmp_path):
    pairs = load_pairs("builtin:arithmetic:train", TaskConfig(), "data.train")
    assert all(p.chosen == p.meta["answer"] != p.rejected for p in pairs[:200])
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "2+2=", "chosen": "4"}\n')
    from regen.errors import DataError

    with pytest.raises(DataError, match="line 2: field 'rejected' missing"):
        load_pairs(str(f), TaskConfig(), "data.train")


def test_dpo_training_raises_preference_margin(base_model, tmp_path):
    run = tmp_path / "dpo"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "algorithm.name=dpo", "train.steps=30",
                 "train.global_minibatch_size=32", "optim.lr=1e-3", "log.progress=none", "log.tensorboard=false",
                 "eval.num_prompts=32"]) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "rewards/margin" in r]
    assert len(rows) == 30 and rows[0]["rewards/margin"] == 0.0  # step 1: policy == reference
    assert sum(r["rewards/margin"] for r in rows[-5:]) / 5 > 0.5
    assert (run / "export" / "config.json").is_file()
