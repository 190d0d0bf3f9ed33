"""regen.algorithms.flow against hand-derived numbers: Flow-GRPO and Flow-DPPO
(DiffusionNFT and AWM: test_flow_ode_losses.py).

Conventions: x_t = (1 - t) x0 + t eps, true velocity v* = eps - x0; per-sample reductions are means
over all non-batch dims. Every expected value below is worked out in the comment beside it.
"""

from __future__ import annotations

import math

import pytest
import torch

from regen.algorithms.flow import (
    flow_dppo_loss,
    flow_group_advantages,
    flow_grpo_loss,
    gaussian_mean_kl,
)

F64 = torch.float64
EPS = 1e-6
NAN = float("nan")
E = math.e


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol)


def logps(ratios):
    """(old_logp, logp) with exp(logp - old_logp) == ratios, old_logp = -1."""
    r = torch.tensor(ratios, dtype=F64)
    old = torch.full_like(r, -1.0)
    return old, (old + r.log()).requires_grad_()


# ---------------------------------------------------------------- flow_group_advantages
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])


def test_per_group_std_advantage_and_clip():
    adv, valid, m = flow_group_advantages(REWARDS, 4, clip=0.9)
    # group [1,0,0,1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5/0.577351 = +-0.866024 (inside 0.9)
    a1 = 0.5 / (math.sqrt(1 / 3) + EPS)
    # group [3,1,2,2]: mean 2, std sqrt(2/3) -> +-1/0.816498 = +-1.224743 -> clipped to +-0.9
    close(adv, [a1, -a1, -a1, a1, 0.9, -0.9, 0.0, 0.0])
    assert valid.all()
    close(m["adv_clip_frac"], 2 / 8)


def test_global_std_divides_by_the_std_of_the_whole_batch():
    adv, _, _ = flow_group_advantages(REWARDS, 4, std_normalize="batch")
    # batch mean 10/8 = 1.25; squared deviations .0625 1.5625 1.5625 .0625 3.0625 .0625 .5625 .5625
    # sum 7.5, unbiased var 7.5/7 -> std 1.035098; centred [.5,-.5,-.5,.5,1,-1,0,0]
    s = math.sqrt(7.5 / 7) + EPS
    close(adv, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 1 / s, -1 / s, 0.0, 0.0])


def test_global_std_clip_and_zero_std_groups():
    rewards = torch.tensor([0.0, 1.0] + [0.0, 0.0] * 7)  # 8 groups of 2, only the first varies
    adv, _, m = flow_group_advantages(rewards, 2, std_normalize="batch", clip=1.5)
    # mean 1/16; sum sq = 15 * (1/16)^2 + (15/16)^2 = 0.9375; var 0.9375/15 = 0.0625 -> std 0.25
    # first group centred +-0.5 -> +-0.5/0.250001 = +-1.999992 -> clipped to +-1.5; flat groups 0
    close(adv, [-1.5, 1.5] + [0.0] * 14)
    close(m["adv_clip_frac"], 2 / 16)
    close(m["zero_std_frac"], 7 / 8)


@pytest.mark.parametrize("global_std", [False, True])
def test_all_equal_rewards_in_a_group_give_exactly_zero_advantage(global_std):
    adv, valid, _ = flow_group_advantages(torch.tensor([0.7, 0.7, 0.7, 0.7, 1.0, 0.0, 1.0, 0.0]), 4,
                                          std_normalize="batch" if global_std else "group")
    assert adv[:4].tolist() == [0.0] * 4
    assert valid.all()
    assert (adv[4:] != 0).all()


def test_missing_reward_is_excluded_not_zero():
    rewards = torch.tensor([1.0, NAN, 0.0, 2.0, 4.0, 4.0])  # groups of 2: [1, NaN] [0, 2] [4, 4]
    adv, valid, m = flow_group_advantages(rewards, 2, std_normalize="batch")
    # [1, NaN] has one valid reward -> dropped; global std over the valid [0, 2, 4, 4]: mean 2.5,
    # sq dev 6.25 .25 2.25 2.25 = 11, var 11/3 -> std 1.914854. (A NaN read as 0 would keep the
    # first group as [1, 0] and change the std.)
    s = math.sqrt(11 / 3) + EPS
    close(adv, [0.0, 0.0, -1 / s, 1 / s, 0.0, 0.0])
    assert valid.tolist() == [False, False, True, True, True, True]
    close(m["missing_frac"], 1 / 6)
    assert torch.isfinite(adv).all()


# ---------------------------------------------------------------- gaussian_mean_kl
MU_A = torch.tensor([[[1.0, 2.0], [0.0, 0.0]], [[3.0, 1.0], [2.0, -2.0]]], dtype=F64)  # (B=2, S=2, 2)
MU_B = torch.tensor([[[0.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [0.0, 0.0]]], dtype=F64)


def test_gaussian_mean_kl_per_step_std():
    # diffs: (0,0) [1,2] mean sq 2.5; (0,1) [0,-1] 0.5; (1,0) [2,0] 2; (1,1) [2,-2] 4
    # std (S,) = [0.5, 2]: 2 s^2 = [0.5, 8] -> [[2.5/.5, .5/8], [2/.5, 4/8]]
    close(gaussian_mean_kl(MU_A, MU_B, torch.tensor([0.5, 2.0], dtype=F64)), [[5.0, 0.0625], [4.0, 0.5]])
    # the same with std (B, S) and as a float; symmetric in a, b
    std_bs = torch.tensor([[0.5, 2.0], [1.0, 1.0]], dtype=F64)
    close(gaussian_mean_kl(MU_B, MU_A, std_bs), [[5.0, 0.0625], [1.0, 2.0]])
    close(gaussian_mean_kl(MU_A, MU_B, 1.0), [[1.25, 0.25], [1.0, 2.0]])


def test_gaussian_mean_kl_one_step_and_video_shapes():
    # one step (B, 2) with std (B,) = [1, 0.5]: [2.5/2, 2/0.5]
    close(gaussian_mean_kl(MU_A[:, 0], MU_B[:, 0], torch.tensor([1.0, 0.5], dtype=F64), batch_dims=1),
          [1.25, 4.0])
    # video means (B, S, F, C, H, W): the element mean runs over F, C, H, W
    a = MU_A.reshape(2, 2, 1, 2, 1, 1).expand(2, 2, 3, 2, 2, 2)
    close(gaussian_mean_kl(a, MU_B.reshape(2, 2, 1, 2, 1, 1), torch.tensor([0.5, 2.0], dtype=F64)),
          [[5.0, 0.0625], [4.0, 0.5]])


def test_gaussian_mean_kl_gradient_and_zero_std():
    mu = MU_A.clone().requires_grad_()
    gaussian_mean_kl(mu, MU_B, 2.0).sum().backward()
    # d/dmu mean((mu-nu)^2)/(2 s^2) = (mu - nu) / (n s^2) with n = 2 elements, s^2 = 4
    close(mu.grad, (MU_A - MU_B) / 8)
    # std 0 (an ODE step): floored, so equal means give 0 and different means a finite value
    kl = gaussian_mean_kl(MU_A.float(), MU_A.float(), 0.0)
    assert kl.eq(0).all()
    assert torch.isfinite(gaussian_mean_kl(MU_A.float(), MU_B.float(), 0.0)).all()


# ---------------------------------------------------------------- flow_grpo_loss
# clip 0.2 for readable arithmetic; A = [1, -2]; (1, 2) is not a trained step
RATIOS = [[1.1, 1.5, 0.5], [1.25, 0.7, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -2.0], dtype=F64)


def test_flow_grpo_values_and_gradient_of_clipped_vs_unclipped_steps():
    old, logp = logps(RATIOS)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]], dtype=F64, requires_grad=True)
    loss, m = flow_grpo_loss(logp, old, ADV, MASK, clip_range=0.2, kl=kl, kl_coef=0.5)
    # A=1:  r=1.1 inside -> -1.1; r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); r=.5 -> max(-.5, -.8) = -.5
    # A=-2: r=1.25 -> max(2.5, 2.4) = 2.5; r=.7 -> max(1.4, 1.6) = 1.6 (clipped); masked step out
    # pg = (-1.1 - 1.2 - .5 + 2.5 + 1.6) / 5 = 0.26; kl mean (.1+.2+.3+.4+.5)/5 = .3; +0.5*.3
    close(loss, 0.26 + 0.15)
    close(m["pg_loss"], 0.26)
    close(m["kl"], 0.3)
    close(m["clip_frac"], 2 / 5)
    close(m["ratio_mean"], (1.1 + 1.5 + 0.5 + 1.25 + 0.7) / 5)
    loss.backward()
    # unclipped steps: d(-A r)/dlogp = -A r, / 5 steps; clipped and masked steps: 0
    close(logp.grad, [[-1.1 / 5, 0.0, -0.5 / 5], [2 * 1.25 / 5, 0.0, 0.0]])
    close(kl.grad, [[0.1, 0.1, 0.1], [0.1, 0.1, 0.0]])  # kl_coef / 5 on trained steps


def test_flow_grpo_first_on_policy_update_has_ratio_exactly_one():
    logp = torch.tensor([[-1.3, -0.2, -5.0], [-0.7, -2.2, -0.1]], requires_grad=True)
    loss, m = flow_grpo_loss(logp, logp.detach().clone(), torch.tensor([1.0, -0.5]), MASK)  # default eps 1e-4
    assert m["ratio_mean"].item() == 1.0
    assert m["clip_frac"].item() == 0.0
    close(loss, -(1 + 1 + 1 - 0.5 - 0.5) / 5)  # -mean(A) over the 5 trained steps
    loss.backward()
    close(logp.grad, [[-0.2, -0.2, -0.2], [0.1, 0.1, 0.0]])


def test_flow_grpo_kl_coef_without_kl_raises_and_extreme_log_ratios_stay_finite():
    old, logp = logps(RATIOS)
    with pytest.raises(ValueError):
        flow_grpo_loss(logp, old, ADV, MASK, kl_coef=0.1)
    logp = torch.tensor([[100.0, -100.0]], requires_grad=True)
    loss, m = flow_grpo_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    # log-ratios clamped to +-20: A=-1 -> max(e^20, 1+1e-4) and max(e^-20, 1-1e-4)
    close(loss, (E**20 + 1 - 1e-4) / 2, tol=1e-5)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


# ---------------------------------------------------------------- flow_dppo_loss
DPPO_RATIOS = [[1.5, 0.5, 1.2], [1.5, 0.5, 0.8]]
DPPO_ADV = torch.tensor([2.0, -1.0], dtype=F64)
KL_OLD = torch.tensor([[1e-3, 1e-3, 1e-6], [1e-3, 1e-3, 1e-3]], dtype=F64)


def test_flow_dppo_masks_only_far_steps_pushing_in_the_advantage_direction():
    old, logp = logps(DPPO_RATIOS)
    loss, m = flow_dppo_loss(logp, old, DPPO_ADV, MASK, KL_OLD, tau=1e-5)
    # A=2:  r=1.5, KL>=tau, r>1 & A>0 -> dropped; r=.5 far but corrective -> -2*.5 = -1;
    #       r=1.2 with KL 1e-6 < tau -> kept: -2.4
    # A=-1: r=1.5 far but corrective -> 1.5; r=.5 far, r<1 & A<0 -> dropped; (1,2) not trained
    close(loss, (0 - 1 - 2.4 + 1.5 + 0) / 5)  # -0.38
    close(m["masked_frac"], 2 / 5)
    close(m["kl_over_tau_frac"], 4 / 5)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.2 + 1.5 + 0.5) / 5)
    close(m["kl_mean"], (4e-3 + 1e-6) / 5)
    loss.backward()
    # kept steps: -A r / 5; dropped and untrained steps: 0
    close(logp.grad, [[0.0, -2 * 0.5 / 5, -2 * 1.2 / 5], [1.5 / 5, 0.0, 0.0]])


def test_flow_dppo_kl_equal_to_tau_drops_and_on_policy_keeps_everything():
    old, logp = logps([[1.5]])
    loss, m = flow_dppo_loss(logp, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 1),
                             torch.tensor([[1e-5]], dtype=F64))
    close(loss, 0.0)  # KL >= tau (equal) with r > 1 and A > 0
    close(m["masked_frac"], 1.0)
    # on-policy: r = 1 exactly, never "pushing", so nothing is dropped however large the KL
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])
    loss, m = flow_dppo_loss(logp, logp.clone(), torch.tensor([1.0, -0.5]), MASK, torch.full((2, 3), 5.0))
    assert m["ratio_mean"].item() == 1.0
    assert m["masked_frac"].item() == 0.0
    close(loss, -(3 * 1.0 - 2 * 0.5) / 5)


def test_flow_dppo_extreme_log_ratios_stay_finite():
    logp = torch.tensor([[100.0, -100.0], [100.0, -100.0]], requires_grad=True)
    loss, _ = flow_dppo_loss(logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                             torch.zeros(2, 2))
    # KL 0 < tau: nothing dropped; log-ratios clamped to +-20: (-e^20 - e^-20 + e^20 + e^-20) / 4 = 0
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
