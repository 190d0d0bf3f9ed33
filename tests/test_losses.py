"""aggregate, ppo_clip_loss and grpo_loss against hand-derived numbers.

PPO clip (Schulman 2017) with asymmetric clip (DAPO): L_t = max(-A*r, -A*clip(r, 1-el, 1+eh)).
"""

import math

import pytest
import torch

from regen.algorithms.losses import aggregate, grpo_loss, ppo_clip_loss

E = math.e
F64 = torch.float64


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol)


def logps(ratios):
    """(old_logp, logp) with exp(logp - old_logp) == ratios, old_logp = -1."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=F64)
    return old, old + torch.tensor(ratios, dtype=F64).log()


# ---------------------------------------------------------------- aggregate
# row 0 valid [1, 2], row 1 valid [4], row 2 no valid token; 100s are masked out
X = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0], [7.0, 8.0, 9.0]], dtype=F64)
M = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode, norm, expected",
    [
        ("token-mean", None, (1 + 2 + 4) / 3),  # 7/3 over the 3 valid tokens
        ("seq-mean-token-mean", None, (1.5 + 4) / 2),  # row means 1.5, 4; empty row left out
        ("seq-mean-token-sum", None, (3 + 4) / 2),  # row sums 3, 4
        ("seq-mean-token-sum-norm", 3.0, (3 / 3 + 4 / 3) / 2),  # 7/6
    ],
)
def test_aggregate_modes_on_ragged_mask_leave_empty_rows_out(mode, norm, expected):
    close(aggregate(X, M, mode, norm), expected, tol=1e-12)
    # the same two rows without the empty third row give the same value
    close(aggregate(X[:2], M[:2], mode, norm), expected, tol=1e-12)


def test_aggregate_sum_norm_without_norm_raises():
    with pytest.raises(ValueError):
        aggregate(X, M, "seq-mean-token-sum-norm")


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError):
        aggregate(X, M, "sum")


# ---------------------------------------------------------------- ppo_clip_loss
# asymmetric clip el=0.2, eh=0.28 -> ratios kept in [0.8, 1.28]
@pytest.mark.parametrize(
    "adv, ratio, expected, clipped",
    [
        (1.0, 1.25, -1.25, False),  # inside [0.8,1.28] (a symmetric 0.2 clip would give -1.2)
        (1.0, 1.5, -1.28, True),  # max(-1.5, -1.28): clipped term active
        (1.0, 0.5, -0.5, False),  # max(-0.5, -0.8): unclipped wins
        (-2.0, 1.5, 3.0, False),  # max(3.0, 2.56): unclipped wins
        (-2.0, 0.5, 1.6, True),  # max(1.0, 1.6): clipped term active
        (-2.0, 0.85, 1.7, False),  # inside
    ],
)
def test_ppo_clip_single_token(adv, ratio, expected, clipped):
    old, logp = logps([[ratio]])
    loss, m = ppo_clip_loss(logp, old, torch.tensor([adv], dtype=F64), torch.ones(1, 1), 0.2, 0.28)
    close(loss, expected)
    close(m["clip_frac"], 1.0 if clipped else 0.0)
    close(m["ratio_mean"], ratio)


RATIOS = [[1.25, 1.5, 0.5, 0.85], [1.25, 1.5, 0.5, 0.85]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])


def test_ppo_clip_batch_token_mean_clip_frac_and_ratio_mean():
    old, logp = logps(RATIOS)
    loss, m = ppo_clip_loss(logp, old, torch.tensor([1.0, -2.0], dtype=F64), MASK, 0.2, 0.28)
    # row A=+1: [-1.25, -1.28, -0.5, -0.85] sum -3.88; row A=-2: [2.5, 3.0, 1.6, (masked)] sum 7.1
    close(loss, (-3.88 + 7.1) / 7)  # 0.46
    close(m["clip_frac"], 2 / 7)  # r=1.5 with A>0 and r=0.5 with A<0
    close(m["ratio_mean"], (4.1 + 1.25 + 1.5 + 0.5) / 7)  # 1.05


def test_adv_per_sequence_and_per_token_give_the_same_result():
    old, logp = logps(RATIOS)
    per_seq = torch.tensor([1.0, -2.0], dtype=F64)
    per_tok = torch.tensor([[1.0] * 4, [-2.0] * 4], dtype=F64)
    loss_s, m_s = ppo_clip_loss(logp, old, per_seq, MASK, 0.2, 0.28)
    loss_t, m_t = ppo_clip_loss(logp, old, per_tok, MASK, 0.2, 0.28)
    close(loss_s, 3.22 / 7)
    close(loss_t, 3.22 / 7)
    for k in ("clip_frac", "ratio_mean", "approx_kl"):
        torch.testing.assert_close(m_s[k], m_t[k], atol=0, rtol=0)


def test_on_policy_ratio_is_one_and_token_mean_gradient_is_minus_adv_over_count():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, m = ppo_clip_loss(logp, logp.detach().clone(), torch.tensor([1.0, -0.5]), mask)
    assert m["ratio_mean"].item() == 1.0
    assert m["clip_frac"].item() == 0.0
    assert m["approx_kl"].item() == 0.0
    close(loss, -(1 + 1 - 0.5) / 3)  # -mean(A) over the 3 valid tokens
    loss.backward()
    # d/dlogp (-A*r) = -A*r = -A at r=1, divided by the 3 valid tokens; masked tokens get 0
    close(logp.grad, [[-1 / 3, -1 / 3, 0.0], [0.5 / 3, 0.0, 0.0]])


def test_on_policy_gradient_for_seq_mean_token_mean():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -0.5])
    loss, _ = ppo_clip_loss(logp, logp.detach().clone(), adv, mask, agg="seq-mean-token-mean")
    close(loss, (-1.0 + 0.5) / 2)
    loss.backward()
    # -A / (row length * 2 rows): row 0: -1/(2*2); row 1: 0.5/(1*2)
    close(logp.grad, [[-0.25, -0.25, 0.0], [0.25, 0.0, 0.0]])


def test_log_ratio_is_clamped_at_twenty_so_nothing_overflows():
    old = torch.tensor([[-100.0, 100.0]])
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss, m = ppo_clip_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), 0.2, 0.28)
    # log-ratios 100, -100 -> clamped to 20, -20 (exp(100) is inf in fp32)
    # token 0, A=-1: max(e^20, 1.28) = e^20; token 1: max(e^-20, 0.8) = 0.8
    assert torch.isfinite(loss)
    close(loss, (E**20 + 0.8) / 2)
    close(m["ratio_mean"], (E**20 + E**-20) / 2)
    close(m["clip_frac"], 0.5)
    loss.backward()
    # saturated clamp passes no gradient
    assert torch.isfinite(logp.grad).all()
    close(logp.grad, [[0.0, 0.0]])


# ---------------------------------------------------------------- grpo_loss
# on-policy, A=+1: PPO term -1. k3 per token: d=-1 -> e^-1 = 0.367879; d=1 -> e-2 = 0.718282
GL_LOGP = torch.tensor([[-1.0, -2.0]])
GL_REF = torch.tensor([[-2.0, -1.0]])
KL_MEAN = (1 / E + (E - 2)) / 2  # 0.543081


def test_grpo_loss_adds_kl_term_times_coefficient():
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    loss, m = grpo_loss(GL_LOGP, GL_LOGP.clone(), adv, mask, ref_logp=GL_REF, kl_coef=0.1)
    close(loss, -1.0 + 0.1 * KL_MEAN)  # -0.945692
    close(m["kl"], KL_MEAN)
    close(m["loss"], -1.0 + 0.1 * KL_MEAN)
    close(m["pg_loss"], -1.0)


def test_grpo_loss_reports_kl_but_does_not_add_it_when_coef_is_zero():
    loss, m = grpo_loss(GL_LOGP, GL_LOGP.clone(), torch.tensor([1.0]), torch.ones(1, 2), ref_logp=GL_REF)
    close(loss, -1.0)
    close(m["kl"], KL_MEAN)


def test_grpo_loss_kl_uses_the_same_aggregation():
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0], [-1.5, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = grpo_loss(logp, logp.clone(), adv, mask, ref, kl_coef=0.5, agg="seq-mean-token-sum")
    # PPO: row sums -2, +1 -> -0.5; k3 row sums: e^-1 + e-2 = 1.086161, d=-0.5: e^-0.5 - 0.5 = 0.106531
    kl = (1 / E + E - 2 + E**-0.5 - 0.5) / 2  # 0.596346
    close(m["kl"], kl)
    close(loss, -0.5 + 0.5 * kl)


def test_grpo_loss_kl_coef_without_ref_logp_raises():
    with pytest.raises(ValueError):
        grpo_loss(GL_LOGP, GL_LOGP.clone(), torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1)
