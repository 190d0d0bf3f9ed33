"""RLOO, REINFORCE++, DAPO overlong penalty, dual clip, entropy bonus and GSPO against hand-derived numbers.

Formulas from /work/shared/REFERENCES.md; every expected value is worked out by hand in a comment.
"""

import math

import pytest
import torch

from regen.algorithms.advantages import (
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from regen.algorithms.losses import grpo_loss, gspo_loss, ppo_clip_loss

NAN = float("nan")
EPS = 1e-6
F64 = torch.float64
LN2 = math.log(2)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol)


def t(x, dtype=F64, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


# ---------------------------------------------------------------- RLOO: A_i = R_i - mean_{j != i} R_j
def test_rloo_is_reward_minus_mean_of_the_other_rewards():
    adv, valid, _ = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0]), group_size=4)
    # [1,0,0,1]: 1-(0+0+1)/3 = 2/3, 0-(1+0+1)/3 = -2/3
    # [3,1,2,2]: 3-5/3 = 4/3, 1-7/3 = -4/3, 2-6/3 = 0, 2-6/3 = 0
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 4 / 3, -4 / 3, 0.0, 0.0])
    assert valid.all()


def test_rloo_missing_reward_is_left_out_of_the_other_rows_baseline():
    adv, valid, m = rloo_advantages(torch.tensor([1.0, NAN, 0.0, 0.0, 2.0, NAN, 5.0, 0.0]), group_size=4)
    # valid [1,_,0,0]: 1-(0+0)/2 = 1, 0-(1+0)/2 = -0.5
    # valid [2,_,5,0]: 2-(5+0)/2 = -0.5, 5-(2+0)/2 = 4, 0-(2+5)/2 = -3.5; NaN rows get 0
    close(adv, [1.0, 0.0, -0.5, -0.5, -0.5, 0.0, 4.0, -3.5])
    assert valid.tolist() == [True, False, True, True, True, False, True, True]
    close(m["missing_frac"], 2 / 8)


def test_rloo_single_valid_group_dropped_and_all_equal_group_zero():
    adv, valid, m = rloo_advantages(torch.tensor([NAN, 1.0, NAN, NAN, 0.7, 0.7, 0.7, 0.7]), group_size=4)
    # group 0 has one valid reward -> no leave-one-out baseline, dropped; group 1: 0.7 - 0.7 = 0
    close(adv, [0.0] * 8)
    assert valid.tolist() == [False] * 4 + [True] * 4
    close(m["dropped_group_frac"], 0.5)
    close(m["zero_std_frac"], 1.0)  # the one kept group is flat


# ---------------------------------------------------------------- REINFORCE++: whitening over the batch
STD4 = math.sqrt(14 / 3)  # values 0,1,2,5: mean 2, deviations -2,-1,0,3, sum sq 14, unbiased var 14/3


def test_reinforce_pp_whitens_over_valid_batch_with_unbiased_std_nan_rows_zero():
    # std 2.160247; groups [0,NaN] [1,2] [5,NaN]: without a baseline no group is dropped, only the NaNs
    adv, valid, _ = reinforce_pp_advantages(torch.tensor([0.0, NAN, 1.0, 2.0, 5.0, NAN]), group_size=2)
    close(adv, [-2 / (STD4 + EPS), 0.0, -1 / (STD4 + EPS), 0.0, 3 / (STD4 + EPS), 0.0])
    assert valid.tolist() == [True, False, True, True, True, False]


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0, NAN, 4.0, NAN, NAN])
    adv, valid, _ = reinforce_pp_advantages(r, group_size=4, baseline=True)
    # R' = R - group mean (0.5, 2): [.5,-.5,-.5,.5, 1,-1,0,0]; group 3 has one valid reward: dropped
    # batch mean of R' = 0; sum sq = 4*0.25 + 1 + 1 = 3; unbiased var 3/7 -> std 0.654654
    s = math.sqrt(3 / 7) + EPS
    close(adv, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 1 / s, -1 / s, 0.0, 0.0] + [0.0] * 4)
    assert valid.tolist() == [True] * 8 + [False] * 4


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_fewer_than_two_valid_is_all_zero_invalid_and_all_equal_is_zero(baseline):
    adv, valid, _ = reinforce_pp_advantages(torch.tensor([NAN, 2.0, NAN, NAN]), group_size=2, baseline=baseline)
    close(adv, [0.0] * 4)
    assert not valid.any()
    adv, valid, _ = reinforce_pp_advantages(torch.tensor([0.7, 0.7, 0.7, 0.7]), group_size=2, baseline=baseline)
    close(adv, [0.0] * 4)  # deviations 0, std 0 -> 0 / (0 + eps) = 0
    assert valid.all()


# ---------------------------------------------------------------- DAPO overlong penalty
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_overlong_penalty_soft_ramp_inside_cache_and_full_beyond_max(factor):
    # Lmax=8, Lcache=4 -> free up to 8-4=4; in (4,8]: (4-|y|)/4*f; beyond 8: -f
    # 3 -> 0, 4 -> 0, 5 -> -1/4, 6 -> -2/4, 7 -> -3/4, 8 -> -4/4, 9 -> -1
    out = overlong_penalty(torch.tensor([3, 4, 5, 6, 7, 8, 9]), max_len=8, cache_len=4, factor=factor)
    close(out, [factor * v for v in [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]])


@pytest.mark.parametrize("cache_len", [0, -1, 9])
def test_overlong_penalty_invalid_cache_len_raises(cache_len):
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([3]), max_len=8, cache_len=cache_len)
    # cache_len == max_len is allowed: (0 - |y|)/8 -> 0: 0, 4: -0.5, 10: -1
    close(overlong_penalty(torch.tensor([0, 4, 10]), max_len=8, cache_len=8), [0.0, -0.5, -1.0])


# ---------------------------------------------------------------- dual clip (Ye 2020)
def test_dual_clip_bounds_negative_advantage_loss_and_kills_its_gradient():
    old = t([[-1.0, -1.0]])
    logp = t([[-1.0 + math.log(10), -1.0 + LN2]], grad=True)  # ratios 10, 2
    adv = t([-1.0])
    plain, _ = ppo_clip_loss(logp.detach(), old, adv, torch.ones(1, 2), 0.2, 0.2)
    # plain: max(10, 1.2) = 10, max(2, 1.2) = 2 -> token-mean 6
    close(plain, 6.0)
    loss, _ = ppo_clip_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.2, dual_clip=3.0)
    # dual: min(10, 3*1) = 3, min(2, 3) = 2 -> (3 + 2)/2 = 2.5
    close(loss, 2.5)
    loss.backward()
    # token 0 is the constant -c*A: no gradient; token 1: d(-A*rho)/dlogp / 2 = 2/2 = 1
    close(logp.grad, [[0.0, 1.0]])
    g, _ = grpo_loss(logp.detach(), old, adv, torch.ones(1, 2), dual_clip=3.0)  # passed through grpo_loss
    close(g, 2.5)


@pytest.mark.parametrize("ratio, expected", [(10.0, -1.2), (0.5, -0.5), (1.1, -1.1)])
def test_dual_clip_changes_nothing_for_positive_advantage(ratio, expected):
    # A=+1: max(-rho, -clip(rho, 0.8, 1.2)): 10 -> -1.2, 0.5 -> max(-0.5,-0.8), 1.1 inside
    old = t([[-1.0]])
    logp = old + math.log(ratio)
    for dual in (None, 3.0):
        loss, _ = ppo_clip_loss(logp, old, t([1.0]), torch.ones(1, 1), 0.2, 0.2, dual_clip=dual)
        close(loss, expected)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_at_most_one_raises(c):
    with pytest.raises(ValueError):
        ppo_clip_loss(t([[0.0]]), t([[0.0]]), t([-1.0]), torch.ones(1, 1), dual_clip=c)


# ---------------------------------------------------------------- entropy bonus in grpo_loss
LP = t([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
ADV = t([1.0, -0.5])  # on-policy per-token pg terms: -1, -1 | 0.5


@pytest.mark.parametrize(
    "agg, expected, grad",
    [
        # pg (-1-1+0.5)/3 = -0.5; entropy (0.5+1+2)/3 = 7/6; loss -0.5 - 0.1*7/6; dH = -0.1/3
        ("token-mean", -0.5 - 0.1 * 7 / 6, [[-0.1 / 3, -0.1 / 3, 0.0], [-0.1 / 3, 0.0, 0.0]]),
        # pg (-1 + 0.5)/2 = -0.25; entropy (0.75 + 2)/2 = 1.375; dH row0 -0.1/(2*2), row1 -0.1/2
        ("seq-mean-token-mean", -0.25 - 0.1 * 1.375, [[-0.025, -0.025, 0.0], [-0.05, 0.0, 0.0]]),
    ],
)
def test_grpo_loss_entropy_bonus_is_subtracted_and_gets_gradient(agg, expected, grad):
    ent = t([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]], grad=True)  # 9s are masked out
    loss, m = grpo_loss(LP, LP.clone(), ADV, MASK, agg=agg, entropy=ent, entropy_coef=0.1)
    close(loss, expected)
    close(m["loss"], expected)
    close(m["pg_loss"], -0.5 if agg == "token-mean" else -0.25)
    loss.backward()
    close(ent.grad, grad)


def test_grpo_loss_entropy_coef_without_entropy_raises_and_zero_coef_ignores_it():
    with pytest.raises(ValueError):
        grpo_loss(LP, LP.clone(), ADV, MASK, entropy_coef=0.1)
    loss, _ = grpo_loss(LP, LP.clone(), ADV, MASK, entropy=torch.full((2, 3), 5.0, dtype=F64))
    close(loss, -0.5)


# ---------------------------------------------------------------- GSPO (Zheng 2025)
def test_gspo_sequence_ratio_clipping_for_both_signs_and_empty_row_left_out():
    old = torch.zeros(5, 3, dtype=F64)
    logp = t([[0.3, 0.1, 5.0], [-0.3, -0.1, -0.2], [0.04, 7.0, 7.0], [0.1, 0.0, -5.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0], [0, 0, 0]])
    adv = t([1.0, -2.0, 1.0, -1.0, 100.0])
    loss, m = gspo_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.1)
    # row0 A=+1: s=e^((.3+.1)/2)=e^.2=1.221403 > 1.1: max(-1.221403, -1.1) = -1.1 (clipped)
    # row1 A=-2: s=e^(-.6/3)=e^-.2=0.818731 < 0.9: max(1.637462, 1.8) = 1.8 (clipped)
    # row2 A=+1: s=e^.04=1.040811 inside: -1.040811;  row3 A=-1: s=e^.1=1.105171 > 1.1: max(1.105171, 1.1)
    # row4 has no valid token: left out -> mean over 4 sequences
    close(loss, (-1.1 + 1.8 - math.exp(0.04) + math.exp(0.1)) / 4)  # 0.191090
    close(m["clip_frac"], 2 / 4)
    close(m["ratio_mean"], (math.exp(0.2) + math.exp(-0.2) + math.exp(0.04) + math.exp(0.1)) / 4)


def test_gspo_on_policy_ratio_one_loss_and_gradient():
    logp = t([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5], [-0.1, -0.2, -0.3], [-4.0, -4.0, -4.0]], grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    adv = t([1.0, -0.5, 2.0, 7.0])
    loss, m = gspo_loss(logp, logp.detach().clone(), adv, mask)
    assert m["ratio_mean"].item() == 1.0 and m["clip_frac"].item() == 0.0
    close(loss, -(1.0 - 0.5 + 2.0) / 3)  # -mean(A) over the 3 sequences with tokens
    loss.backward()
    # dL/dlogp_t = -A_i * s_i / (|y_i| * 3): row0 -1/9, row1 0.5/3, row2 -2/(2*3), row3 none
    close(logp.grad, [[-1 / 9] * 3, [1 / 6, 0.0, 0.0], [-1 / 3, -1 / 3, 0.0], [0.0] * 3])


def test_gspo_two_dim_advantage_uses_position_zero():
    lp = t([[-1.0, -2.0], [-0.5, -1.5]])
    loss, _ = gspo_loss(lp, lp.clone(), t([[1.0, 99.0], [-0.5, -99.0]]), torch.ones(2, 2))
    close(loss, -(1.0 - 0.5) / 2)


def test_gspo_adds_kl_times_coefficient_and_needs_ref_for_it():
    lp = t([[-1.0, -2.0], [-0.5, -1.5]])
    ref = lp + t([[LN2, 0.0], [-LN2, 0.0]])  # d = ref - logp
    mask = torch.tensor([[1, 1], [1, 0]])
    # k3 = e^d - d - 1: d=ln2 -> 1 - ln2; d=0 -> 0; d=-ln2 -> ln2 - 0.5
    # seq-mean-token-mean: ((1 - ln2)/2 + (ln2 - 0.5)) / 2 = ln2/4 = 0.173287
    loss, m = gspo_loss(lp, lp.clone(), t([1.0, -0.5]), mask, ref_logp=ref, kl_coef=0.5)
    close(m["kl"], LN2 / 4)
    close(loss, -(1.0 - 0.5) / 2 + 0.5 * LN2 / 4)
    with pytest.raises(ValueError):
        gspo_loss(lp, lp.clone(), t([1.0, -0.5]), mask, kl_coef=0.5)


def test_gspo_extreme_log_ratios_give_finite_loss():
    old = torch.tensor([[-100.0], [100.0]])
    logp = torch.zeros(2, 1, requires_grad=True)  # log-ratios +100, -100 -> clamped to ±20
    loss, _ = gspo_loss(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1), clip_low=0.1, clip_high=0.1)
    # A=+1, s=e^20: max(-e^20, -1.1) = -1.1;  A=-1, s=e^-20: max(e^-20, 0.9) = 0.9 -> (-1.1+0.9)/2
    close(loss, -0.1)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_gspo_extreme_log_ratios_give_finite_metrics():
    old = torch.tensor([[-100.0], [100.0]])
    _, m = gspo_loss(torch.zeros(2, 1), old, torch.tensor([1.0, -1.0]), torch.ones(2, 1))
    assert all(torch.isfinite(v).all() for v in m.values()), m


# ---------------------------------------------------------------- fully masked batches
@pytest.mark.parametrize("loss_fn", [grpo_loss, gspo_loss])
def test_fully_masked_batch_gives_zero_loss_and_gradient_no_nan(loss_fn):
    logp = t([[-1.0, -2.0], [-0.5, 3.0]], grad=True)
    ent = t([[1.0, 1.0], [1.0, 1.0]], grad=True)
    kw = {"entropy": ent, "entropy_coef": 0.1} if loss_fn is grpo_loss else {}
    loss, m = loss_fn(logp, t([[0.0, 0.0], [0.0, 0.0]]), t([1.0, -1.0]), torch.zeros(2, 2), **kw)
    close(loss, 0.0)
    assert all(torch.isfinite(v).all() for v in m.values())
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [0.0, 0.0]])


def test_gspo_entropy_bonus_is_subtracted_with_the_token_aggregation():
    # ratio 1 (logp = old): the policy term is mean_i(-A_i) = (-1 + 2) / 2 = 0.5; the entropy
    # token-mean over the 3 valid tokens is (0.5 + 1.5 + 2.0) / 3 = 4/3, so L = 0.5 - 0.1 * 4/3
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    entropy = torch.tensor([[0.5, 1.5, 9.0], [2.0, 9.0, 9.0]], requires_grad=True)
    loss, _ = gspo_loss(logp, logp, torch.tensor([1.0, -2.0]), mask, agg="token-mean", entropy=entropy,
                        entropy_coef=0.1)
    close(loss, 0.5 - 0.1 * 4 / 3)
    loss.backward()
    close(entropy.grad, -0.1 / 3 * mask)
    with pytest.raises(ValueError, match="dual_clip"):
        gspo_loss(logp, logp, torch.tensor([1.0, -2.0]), mask, dual_clip=3.0)


def test_grpo_advantages_with_the_batch_std():
    # groups [1, 2] and [3, 5]: centred [-0.5, 0.5, -1, 1]; the batch's rewards 1, 2, 3, 5 have
    # mean 2.75, squared deviations 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75, unbiased var 8.75 / 3
    from regen.algorithms.advantages import grpo_advantages

    adv, valid, _ = grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0]), 2, std_normalize="batch")
    s = math.sqrt(8.75 / 3) + 1e-6
    close(adv, [-0.5 / s, 0.5 / s, -1 / s, 1 / s])
    assert valid.all()
    with pytest.raises(ValueError, match="std_normalize"):
        grpo_advantages(torch.tensor([1.0, 2.0]), 2, std_normalize="per-token")
