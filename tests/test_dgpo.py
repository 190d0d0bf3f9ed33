"""DGPO (Luo, Hu, Tang 2025) and the native reward forms (binary labels, pairwise win rates):
the math against numbers worked by hand from the paper's equations, and the method in the loop."""

from __future__ import annotations

import json
import math

import pytest
import torch

from regen.algorithms.flow_preference import binary_advantages, dgpo_group_weights, dgpo_loss, pairwise_advantages


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


FM = [1.0, 2.0, 0.5, 0.5]  # l_theta of four samples: two groups of two
REF = [1.5, 1.0, 0.5, 1.0]
ADV = [1.0, -1.0, 2.0, -2.0]


def test_group_weights_by_hand():
    w = dgpo_group_weights(torch.tensor(FM), torch.tensor(REF), torch.tensor(ADV), group_size=2, beta=0.5)
    # group 0: beta / G * (1 * (1.0 - 1.5) + (-1) * (2.0 - 1.0)) = 0.25 * -1.5 ; group 1: 0.25 * (0 + (-2) * -0.5)
    g0, g1 = sigmoid(0.25 * -1.5), sigmoid(0.25 * 1.0)
    assert w.tolist() == pytest.approx([g0, g0, g1, g1], abs=1e-7)
    # a missing reward counts as A = 0 in its group's sum
    w = dgpo_group_weights(torch.tensor(FM), torch.tensor(REF), torch.tensor(ADV), 2, 0.5,
                           valid=torch.tensor([True, False, True, True]))
    assert w[0].item() == pytest.approx(sigmoid(0.25 * -0.5), abs=1e-7)


def test_loss_and_gradient_by_hand():
    fm = torch.tensor(FM, requires_grad=True)
    w = torch.tensor([0.2, 0.2, 0.7, 0.7])
    loss, m = dgpo_loss(fm, torch.tensor(ADV), w)
    want = (0.2 * 1 * 1.0 + 0.2 * -1 * 2.0 + 0.7 * 2 * 0.5 + 0.7 * -2 * 0.5) / 4
    assert loss.item() == pytest.approx(want, abs=1e-7)
    loss.backward()
    assert fm.grad.tolist() == pytest.approx([0.2 / 4, -0.2 / 4, 1.4 / 4, -1.4 / 4], abs=1e-7)
    assert m["weight_mean"].item() == pytest.approx(0.45, abs=1e-7)


def test_gradient_is_the_group_bradley_terry_gradient():
    """d/dl of -log sigmoid(R(G+) - R(G-)), R(G+) - R(G-) = -beta / G sum_i A_i (l_i - l_ref,i), is
    sigmoid(S) beta A_i / G: DGPO's loss has the same gradient up to the constant beta (one group)."""
    beta, G = 3.0, 4
    torch.manual_seed(0)
    fm0, ref, adv = torch.rand(G), torch.rand(G), torch.randn(G)
    a = fm0.clone().requires_grad_(True)
    s = beta / G * (adv * (a - ref)).sum()
    (-torch.nn.functional.logsigmoid(-s)).backward()
    b = fm0.clone().requires_grad_(True)
    w = dgpo_group_weights(b, ref, adv, G, beta)
    dgpo_loss(b, adv, w)[0].backward()
    assert (b.grad * beta).tolist() == pytest.approx(a.grad.tolist(), rel=1e-5, abs=1e-7)


def test_clip_holds_samples_that_moved_past_the_range():
    fm = torch.tensor([1.0, 1.0, 1.0, 1.0], requires_grad=True)
    # rho = exp(old - fm): sample 0 (A > 0) at exp(0.2) > 1.1 is held; sample 1 (A < 0) at exp(-0.2) < 0.9 is
    # held; samples 2 and 3 inside the range keep their gradient
    old = torch.tensor([1.2, 0.8, 1.05, 0.95])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, m = dgpo_loss(fm, adv, torch.ones(4), old_fm=old, clip_range=0.1)
    loss.backward()
    assert fm.grad.tolist() == pytest.approx([0.0, 0.0, 0.25, -0.25], abs=1e-7)
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_velocity_kl_term():
    v = torch.tensor([[1.0, 3.0], [0.0, 0.0]], requires_grad=True)
    v_ref = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    loss, m = dgpo_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), v=v, v_ref=v_ref, kl_coef=0.5)
    # mean over elements per sample: (1 + 4) / 2 = 2.5 and (0 + 4) / 2 = 2; mean over samples 2.25
    assert m["kl"].item() == pytest.approx(2.25)
    assert loss.item() == pytest.approx(0.5 * 2.25)


def test_binary_labels_become_balanced_sets():
    nan = float("nan")
    labels = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1, 1, 0, nan, 0])
    adv, valid = binary_advantages(labels, 4)
    # group 0: n = 4, one good (+4 / 2), three bad (-4 / 6); group 1 all good: no preference;
    # group 2: three labelled, one good (+3 / 2), two bad (-3 / 4), the missing one left out
    want = [2.0, -2 / 3, -2 / 3, -2 / 3, 0, 0, 0, 0, 1.5, -0.75, 0.0, -0.75]
    assert adv.tolist() == pytest.approx(want, abs=1e-6)
    assert valid.tolist() == [True] * 10 + [False, True]
    with pytest.raises(ValueError, match="reward_type=binary.*0.7"):
        binary_advantages(torch.tensor([1.0, 0.7]), 2)


def test_pairwise_win_rates_become_directions():
    adv, valid = pairwise_advantages(torch.tensor([1.0, 0.5, 0.0, 0.75, float("nan")]))
    assert adv.tolist()[:4] == pytest.approx([1.0, 0.0, -1.0, 0.5])
    assert valid.tolist() == [True, True, True, True, False]
    with pytest.raises(ValueError, match="reward_type=pairwise"):
        pairwise_advantages(torch.tensor([1.5]))


# ----------------------------------------------------------------- in the loop

from regen.cli import main  # noqa: E402
from tests.conftest import flow_rl, read_jsonl  # noqa: E402


def brightness_judge(first, second):
    """A pairwise judge for the tests: the brighter image wins, equal ones tie."""
    return [0.5 if a.media.mean() == b.media.mean() else float(a.media.mean() > b.media.mean())
            for a, b in zip(first, second)]


brightness_judge.reward_kind = "pairwise"
JUDGED = "reward=[{name: pairwise, args: {of: 'tests.test_dgpo:brightness_judge'}}]"


def test_micro_batches_and_the_clip_and_kl_leave_the_update_unchanged(flow_base, tmp_path):
    common = ["train.steps=2", "optim.lr=1e-3", "algorithm.clip_low=1e-3", "algorithm.kl_coef=0.01"]
    assert flow_rl(tmp_path / "a", flow_base, "dgpo", *common) == 0
    assert flow_rl(tmp_path / "b", flow_base, "dgpo", *common, "train.micro_batch_size=2") == 0
    a, b = read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")
    rows = [(x, y) for x, y in zip(a, b) if "loss" in x]
    assert len(rows) == 2 and rows[-1][0]["kl"] > 0 and 0 < rows[-1][0]["weight_mean"] < 1
    for x, y in rows:
        for k in ("loss", "kl", "weight_mean"):
            assert y[k] == pytest.approx(x[k], rel=1e-4, abs=1e-8), k
        # the gradient is summed in another order over micro-batches (and oneDNN picks convolution
        # kernels by batch size): float32 noise of ~1e-4, while a wrong micro-batch scaling is >= 2x
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3)


def test_binary_labels_are_nft_optimality_as_they_are(flow_base, tmp_path):
    labels = "reward=[{name: binary, args: {of: brightness, threshold: 0.0, args: {target: 0.6}}}]"  # all good
    assert flow_rl(tmp_path / "r", flow_base, "nft", "train.steps=1", labels, "algorithm.reward_type=binary") == 0
    row = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "r_mean" in r][0]
    # normalised as a scalar, a group of equal rewards would give r = 1/2; the label is 1. Every group
    # agrees, so no group holds a preference: every sample weighs 0 and the update is zero
    assert row["reward/mean"] == 1.0 and row["r_mean"] == pytest.approx(1.0)
    assert row["loss"] == 0.0 and row["grad_norm"] == 0.0
    assert flow_rl(tmp_path / "s", flow_base, "nft", "train.steps=1", BRIGHT_SCALAR, "algorithm.reward_type=binary") == 2


def test_nft_binary_labels_weigh_each_groups_good_and_bad_sets_alike(flow_base, tmp_path, monkeypatch):
    """A batch of two groups of 4 whose labels are 1,1,1,0 and 0,0,0,0: weights n / 2|G+-| = 2/3 for the
    good samples, 2 for the bad one of group 0, 0 in group 1 (nft_loss's weights are checked by hand in
    test_flow_ode_losses.py)."""
    import regen.modalities.flow_methods as fm

    labels = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    seen = {}
    real = fm.nft_loss

    def spy(*args, **kw):
        seen.setdefault("weights", []).append(kw["weights"].clone())
        seen.setdefault("r", []).append(args[5].clone())
        return real(*args, **kw)

    monkeypatch.setattr(fm, "nft_loss", spy)
    import regen.train.loop as loop

    monkeypatch.setattr(loop, "score", lambda run, items, batch: (labels.clone(), {}))
    assert flow_rl(tmp_path / "b", flow_base, "nft", "train.steps=1", "algorithm.reward_type=binary",
                   "reward=[{name: binary, args: {of: brightness, threshold: 0.5, args: {target: 0.6}}}]") == 0
    w, r = torch.cat(seen["weights"]), torch.cat(seen["r"])
    assert w.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0, 0.0, 0.0, 0.0, 0.0])
    assert r.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


BRIGHT_SCALAR = "reward=[{name: brightness, args: {target: 0.6}}]"


def test_pairwise_judge_trains_and_evaluates_against_the_base(flow_base, tmp_path, capsys):
    run = tmp_path / "p"
    assert flow_rl(run, flow_base, "dgpo", "train.steps=3", "optim.lr=3e-3", JUDGED, "algorithm.reward_type=pairwise",
                   "eval.every=3") == 0
    rows = read_jsonl(run / "metrics.jsonl")
    train = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert all(w == pytest.approx(0.5) for w in train)  # the mean win rate inside a group is 1/2 by symmetry
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    assert evals[0] == 0.5 and evals[-1] != 0.5  # against the starting model: a tie at step 0, then not
    # `regen eval` judges the same way, so it gives the run's own last evaluation
    out = run / "eval" / "offline.json"
    assert main(["eval", str(run), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["metrics"]["reward"] == pytest.approx(evals[-1], rel=1e-9)
    # a judge alone is not a reward
    assert flow_rl(tmp_path / "q", flow_base, "dgpo", "reward=[{name: 'tests.test_dgpo:brightness_judge'}]") == 2
    assert "is a pairwise judge" in capsys.readouterr().err


@pytest.mark.parametrize("algo, setting, says", [
    ("nft", "flow.sampler=sde", "flow.sampler must be ode"),
    ("flow_grpo", "flow.sampler=ode", "flow.sampler must be sde or cps"),
    ("flow_grpo", "flow.solver=heun", "flow.solver is not read by algorithm.name=flow_grpo"),
    ("flow_grpo", "algorithm.reward_type=binary", "algorithm.reward_type is not read"),
    ("dgpo", "train.global_minibatch_size=2", "must hold whole groups"),
    ("dgpo", "algorithm.clip_high=0.1", "algorithm.clip_high is read only with algorithm.clip_low set"),
])
def test_settings_a_method_cannot_take_are_one_line(flow_base, tmp_path, capsys, algo, setting, says):
    assert flow_rl(tmp_path / "x", flow_base, algo, setting) == 2
    assert says in capsys.readouterr().err


def test_the_seed_vocabulary_is_accepted(flow_base, tmp_path):
    assert main(["train", "--print-config", f"model.path={flow_base}", "algorithm.name=nft", "flow.sampler=ode",
                 "flow.solver=heun"]) == 0


def test_heun_rollouts_are_closer_to_the_ode_than_euler_at_the_same_steps(flow_base):
    from regen.policies.flow import FlowPolicy

    policy = FlowPolicy.load(flow_base, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    x_T = torch.randn((2, *policy.sample_shape), generator=gen)

    def run(steps, solver):
        return policy.rollout(["red circle left"], 2, (x_T, [None] * steps), steps, torch.zeros(steps, dtype=torch.bool),
                              0.0, keep_states=False, solver=solver).x0

    exact = run(32, "euler")
    err = {s: (run(4, s) - exact).abs().mean().item() for s in ("euler", "heun")}
    assert err["heun"] < 0.7 * err["euler"], err  # 0.018 against 0.035 here: the last step is Euler in both


def test_a_judge_is_not_served_alone():
    from regen.errors import ConfigError
    from regen.rewards.server import ServerConfig, create_app

    with pytest.raises(ConfigError, match="pairwise judge"):
        create_app(ServerConfig(rewards=["adherence_judge"], token=None))
