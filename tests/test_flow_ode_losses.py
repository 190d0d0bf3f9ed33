"""regen.algorithms.flow, the ODE-sample methods, against hand-derived numbers: DiffusionNFT and
AWM, and micro-batch invariance of every flow loss (conventions as in test_flow_losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from regen.algorithms.flow import (
    awm_loss,
    binary_optimality,
    ema_update_,
    flow_dppo_loss,
    flow_grpo_loss,
    nft_ema_decay,
    nft_loss,
    nft_optimality,
)
from regen.algorithms.losses import batch_denominators
from tests.test_flow_losses import F64, NAN, E, close

# ---------------------------------------------------------------- DiffusionNFT
# two samples of 2 elements: x0, eps, t -> x_t = (1-t) x0 + t eps = [.5, .5] and [.5, 1.5]
X0 = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=F64)
NOISE = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=F64)
T = torch.tensor([0.5, 0.25], dtype=F64)
XT = (1 - T[:, None]) * X0 + T[:, None] * NOISE
V_THETA = torch.tensor([[0.0, 1.0], [1.0, -2.0]], dtype=F64)  # true v* = [-1, 1], [2, -2]
V_OLD = torch.tensor([[0.0, 0.0], [2.0, -1.0]], dtype=F64)


def test_nft_optimality_and_binary_labels():
    adv = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0])
    close(nft_optimality(adv), [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0])  # A/5/2 + .5, clipped to [0, 1]
    r = nft_optimality(adv[:2], valid=torch.tensor([True, False]))
    assert r[0] == 0.0 and math.isnan(r[1])
    r = binary_optimality([1, 0, None, True])
    assert r[:2].tolist() == [1.0, 0.0] and math.isnan(r[2]) and r[3] == 1.0
    assert binary_optimality(torch.tensor([True, False])).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError):
        binary_optimality([1, 2])


def test_nft_loss_beta_one_values_and_gradient():
    v = V_THETA.clone().requires_grad_()
    loss, m = nft_loss(v, V_OLD, X0, XT, T, torch.tensor([0.8, 0.3], dtype=F64), beta=1.0)
    # beta 1: v+ = v, v- = 2 v_old - v = [0,-1], [3,0]
    # s0 (t=.5): x0+ = [.5,.5] - .5[0,1] = [.5,0], err+ [-.5,0], w+ = .25, mse .125 -> l+ = .5
    #            x0- = [.5,.5] - .5[0,-1] = [.5,1], err- [-.5,1], w- = .75, mse .625 -> l- = 5/6
    # s1 (t=.25): x0+ = [.25,2], err+ [.25,0], w+ .125, mse .03125 -> l+ = .25
    #            x0- = [-.25,1.5], err- [-.25,-.5], w- .375, mse .15625 -> l- = 5/12
    # L0 = .8*.5 + .2*5/6 = 17/30; L1 = .3*.25 + .7*5/12 = 11/30; mean 14/30
    close(loss, 14 / 30)
    close(m["pos_loss"], (0.5 + 0.25) / 2)
    close(m["neg_loss"], (5 / 6 + 5 / 12) / 2)
    loss.backward()
    # dl+/dv = -2 t err+ / (n w+), dl-/dv = +2 t err- / (n w-) (w detached), n = 2, each / B = 2
    # s0: dl+ = [1, 0], dl- = [-1/3, 2/3] -> .5 (.8 dl+ + .2 dl-) = [11/30, 1/15]
    # s1: dl+ = [-.5, 0], dl- = [-1/6, -1/3] -> .5 (.3 dl+ + .7 dl-) = [-2/15, -7/60]
    close(v.grad, [[11 / 30, 1 / 15], [-2 / 15, -7 / 60]])


def test_nft_loss_general_beta_and_scale():
    # sample 0 alone, beta .5: v+ = .5 v + .5 v_old = [0,.5]; v- = 1.5 v_old - .5 v = [0,-.5]
    # x0+ = [.5,.25], err+ [-.5,.25], w+ .375, mse .15625 -> l+ = 5/12
    # x0- = [.5,.75], err- [-.5,.75], w- .625, mse .40625 -> l- = .65
    # L = (.8 * 5/12 + .2 * .65) / .5 = 0.926667; scale 5 (the public code's C) multiplies it
    args = (V_THETA[:1], V_OLD[:1], X0[:1], XT[:1], T[:1], torch.tensor([0.8], dtype=F64))
    close(nft_loss(*args, beta=0.5)[0], (0.8 * 5 / 12 + 0.2 * 0.65) / 0.5)
    close(nft_loss(*args, beta=0.5, scale=5.0)[0], 5 * (0.8 * 5 / 12 + 0.2 * 0.65) / 0.5)


def test_nft_kl_to_reference_adds_the_velocity_distance_outside_scale():
    # v_ref = [[0,0],[0,0]]: per-sample mean (v - v_ref)^2 = (0 + 1)/2 = .5 and (1 + 4)/2 = 2.5; mean 1.5
    r = torch.tensor([0.8, 0.3], dtype=F64)
    v = V_THETA.clone().requires_grad_()
    loss, m = nft_loss(v, V_OLD, X0, XT, T, r, beta=1.0, scale=5.0, v_ref=torch.zeros(2, 2, dtype=F64), kl_coef=0.1)
    close(loss, 5 * 14 / 30 + 0.1 * 1.5)  # scale multiplies the NFT term only (beta-one test: 14/30)
    close(m["kl"], 1.5)
    close(m["loss"], 5 * 14 / 30 + 0.1 * 1.5)
    loss.backward()
    # d(kl term)/dv = .1 * 2 (v - v_ref) / (2 elements * 2 samples) = .05 v; the NFT part x5 (beta-one test)
    close(v.grad, 5 * torch.tensor([[11 / 30, 1 / 15], [-2 / 15, -7 / 60]], dtype=F64) + 0.05 * V_THETA)
    # a missing reward drops the sample from the KL too: sample 0 alone, .1 * .5
    loss, m = nft_loss(V_THETA, V_OLD, X0, XT, T, torch.tensor([0.8, NAN], dtype=F64), v_ref=torch.zeros(2, 2, dtype=F64),
                       kl_coef=0.1)
    close(loss, 17 / 30 + 0.05)
    # kl_coef 0 or no v_ref: no KL term and no metric
    assert "kl" not in nft_loss(V_THETA, V_OLD, X0, XT, T, r, v_ref=torch.zeros(2, 2, dtype=F64))[1]


def test_nft_weights_scale_each_sample_and_keep_the_valid_count():
    # per-sample losses of the beta-one test: L0 = 17/30, L1 = 11/30; weights 1.5 and .5 -> (1.5 L0 + .5 L1) / 2
    r = torch.tensor([0.8, 0.3], dtype=F64)
    v = V_THETA.clone().requires_grad_()
    loss, _ = nft_loss(v, V_OLD, X0, XT, T, r, weights=torch.tensor([1.5, 0.5], dtype=F64))
    close(loss, (1.5 * 17 / 30 + 0.5 * 11 / 30) / 2)
    loss.backward()
    close(v.grad, [[1.5 * 11 / 30, 1.5 / 15], [0.5 * -2 / 15, 0.5 * -7 / 60]])  # each row's gradient x its weight
    # a zero weight silences a sample but it still counts in the mean (as a group without preference does)
    close(nft_loss(V_THETA, V_OLD, X0, XT, T, r, weights=torch.tensor([0.0, 1.0], dtype=F64))[0], 11 / 60)


@pytest.mark.parametrize("r, toward", [(1.0, True), (0.0, False)])
def test_nft_r_one_pulls_toward_true_velocity_and_r_zero_pushes_away(r, toward):
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    t = torch.rand(4, generator=g) * 0.8 + 0.1
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    v = (noise - x0 + 0.5 * torch.randn(4, 3, 4, 4, generator=g)).requires_grad_()
    loss, _ = nft_loss(v, v.detach(), x0, xt, t, torch.full((4,), r))  # on-policy old copy
    loss.backward()
    # a gradient-descent step moves v along -grad: toward v* iff -grad . (v* - v) > 0, per sample
    along = (-v.grad * (noise - x0 - v.detach())).flatten(1).sum(1)
    assert ((along > 0) if toward else (along < 0)).all()


def test_nft_missing_r_is_excluded_and_degenerate_inputs_stay_finite():
    v = V_THETA.clone().requires_grad_()
    loss, m = nft_loss(v, V_OLD, X0, XT, T, torch.tensor([0.8, NAN], dtype=F64))
    close(loss, 17 / 30)  # sample 0 alone (see the beta-one test); the NaN sample is not counted
    close(m["valid_frac"], 0.5)
    loss.backward()
    assert v.grad[1].eq(0).all() and torch.isfinite(v.grad).all()
    # exact velocities: every error is 0, w is floored at eps -> loss 0, gradient 0
    v_star = (NOISE - X0).clone().requires_grad_()
    loss, _ = nft_loss(v_star, NOISE - X0, X0, XT, T, torch.tensor([1.0, 0.0], dtype=F64))
    loss.backward()
    assert loss.item() == 0.0 and v_star.grad.eq(0).all()
    # huge errors in fp32: err^2 alone would overflow, err^2/w stays finite (about mean |err|)
    huge = torch.full((2, 2), 1e25, requires_grad=True)
    loss, _ = nft_loss(huge, torch.zeros(2, 2), X0.float(), XT.float(), T.float(), torch.tensor([0.5, 1.0]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(huge.grad).all()


def test_nft_video_shape_matches_flat_shape():
    # (B, F, C, H, W) = (2, 1, 1, 1, 2): the per-sample mean over all non-batch dims is unchanged
    shape = (2, 1, 1, 1, 2)
    loss, _ = nft_loss(V_THETA.view(shape), V_OLD.view(shape), X0.view(shape), XT.view(shape), T,
                       torch.tensor([0.8, 0.3], dtype=F64))
    close(loss, 14 / 30)


def test_nft_ema_decay_and_update_weight_the_old_copy():
    assert [nft_ema_decay(s) for s in (0, 100, 499, 500, 10_000)] == [0.0, 0.1, 0.499, 0.5, 0.5]
    old = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.tensor([[0.0]])]
    new = [torch.tensor([3.0, 6.0]), torch.tensor([[4.0]])]
    ema_update_(old, new, decay=0.25)
    # old = .25 * old + .75 * new = [.25 + 2.25, .5 + 4.5] = [2.5, 5.0]; [[0 + 3]]
    close(old[0].data, [2.5, 5.0])
    close(old[1], [[3.0]])
    assert old[0].grad is None and old[0].grad_fn is None
    ema_update_(old, new, decay=0.0)  # step 0 of the schedule: the old copy becomes the current one
    close(old[0].data, [3.0, 6.0])
    ema_update_(old, [torch.zeros(2), torch.zeros(1, 1)], decay=1.0)  # frozen
    close(old[0].data, [3.0, 6.0])
    with pytest.raises(ValueError):
        ema_update_(old, new[:1], decay=0.5)


# ---------------------------------------------------------------- AWM
# target v* = eps - x0 = [-1, 1], [2, -2]; v = [0, 1], [1, 0] -> err [1, 0], [-1, 2]; mse .5, 2.5
V_AWM = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=F64)
ADV_AWM = torch.tensor([1.0, -2.0], dtype=F64)


@pytest.mark.parametrize("weight, w", [(None, [1.0, 1.0]), ("t", [0.5, 0.25]), ("t**2", [0.25, 0.0625]),
                                       (torch.tensor([2.0, 3.0], dtype=F64), [2.0, 3.0])])
def test_awm_plain_form_values(weight, w):
    loss, m = awm_loss(V_AWM, X0, NOISE, T, ADV_AWM, weight=weight)
    # L = mean(A * w * mse) = (1 * w0 * .5 - 2 * w1 * 2.5) / 2
    close(loss, (w[0] * 0.5 - 2 * w[1] * 2.5) / 2)
    close(m["fm_loss"], (w[0] * 0.5 + w[1] * 2.5) / 2)



def test_awm_ema_anchor_adds_the_velocity_kl():
    # anchor = [[0, 0], [1, 1]]: (v - anchor)^2 = [0, 1], [0, 1] -> per-sample means .5, .5
    anchor = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=F64)
    v = V_AWM.clone().requires_grad_(True)
    loss, m = awm_loss(v, X0, NOISE, T, ADV_AWM, v_anchor=anchor, anchor_coef=0.1)
    close(loss, (0.5 - 2 * 2.5) / 2 + 0.1 * 0.5)
    close(m["anchor_kl"], 0.5)
    loss.backward()
    # d/dv of A_i * mean((v - v*)^2) / B = A_i (v - v*) / B; of .1 * mean((v - a)^2) / B = .1 (v - a) / B
    close(v.grad, torch.tensor([[1 * 1 / 2 + 0.0, 1 * 0 / 2 + 0.1 * 1 / 2],
                                [-2 * -1 / 2 + 0.0, -2 * 2 / 2 + 0.1 * -1 / 2]], dtype=F64))
    # a missing advantage drops the sample from both terms
    loss, _ = awm_loss(V_AWM, X0, NOISE, T, torch.tensor([1.0, float("nan")], dtype=F64), v_anchor=anchor,
                       anchor_coef=0.1)
    close(loss, 0.5 + 0.1 * 0.5)

def test_awm_plain_gradient_lowers_loss_of_positive_advantages():
    v = V_AWM.clone().requires_grad_()
    awm_loss(v, X0, NOISE, T, ADV_AWM)[0].backward()
    # dL/dv = A * 2 err / n / B: s0 = 1 * [1, 0] / 2; s1 = -2 * [-1, 2] / 2
    close(v.grad, [[0.5, 0.0], [1.0, -2.0]])


def test_awm_ppo_form_clips_like_ppo():
    v = V_AWM.clone().requires_grad_()
    old = torch.tensor([0.6, 2.6], dtype=F64)
    loss, m = awm_loss(v, X0, NOISE, T, ADV_AWM, old_loss=old, clip_range=0.05)
    # rho = exp(old - l) = exp(.1) = 1.105171 for both samples
    # A=1: max(-1.105171, -1.05) = -1.05 (clipped); A=-2: max(2.210342, 2.1) = 2.210342
    close(loss, (-1.05 + 2 * E**0.1) / 2)
    close(m["clip_frac"], 0.5)
    close(m["ratio_mean"], E**0.1)
    loss.backward()
    # clipped sample: 0; s1: d(-A rho)/dv = A rho dl/dv / B = -2 * 1.105171 * [-1, 2] / 2
    close(v.grad, [[0.0, 0.0], [E**0.1, -2 * E**0.1]])


def test_awm_ppo_on_policy_gradient_equals_plain_gradient():
    grads = []
    for ppo in (False, True):
        v = V_AWM.clone().requires_grad_()
        with torch.no_grad():
            l_old = torch.tensor([0.5, 2.5], dtype=F64)  # l at v itself: rho = 1 exactly
        loss, m = awm_loss(v, X0, NOISE, T, ADV_AWM, old_loss=l_old if ppo else None, clip_range=1e-5)
        loss.backward()
        grads.append(v.grad)
        if ppo:
            assert m["ratio_mean"].item() == 1.0 and m["clip_frac"].item() == 0.0
    close(grads[1], grads[0])


def test_awm_missing_advantage_excluded_and_huge_loss_ratio_finite():
    loss, _ = awm_loss(V_AWM, X0, NOISE, T, torch.tensor([1.0, NAN], dtype=F64))
    close(loss, 0.5)  # sample 0 alone: 1 * .5, mean over the one valid sample
    v = torch.full((2, 2), 1e3, requires_grad=True)  # l ~ 1e6 against old_loss 0 -> log-ratio clamped
    loss, _ = awm_loss(v, X0.float(), NOISE.float(), T.float(), ADV_AWM.float(), old_loss=torch.zeros(2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(v.grad).all()


# ---------------------------------------------------------------- micro-batch invariance
def _steps_batch():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(8, 3, generator=g, dtype=F64) * 3
    old = logp + 0.3 * torch.randn(8, 3, generator=g, dtype=F64)
    kl = torch.rand(8, 3, generator=g, dtype=F64) * 2e-5  # about half of the steps over tau 1e-5
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 0, 1]])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -2.0, 0.0, 1.5, -0.5], dtype=F64)
    return logp, old, kl, mask, adv


@pytest.mark.parametrize("which", ["grpo", "dppo"])
def test_step_losses_eight_micro_batches_of_one_equal_one_batch_of_eight(which):
    logp, old, kl, mask, adv = _steps_batch()

    def run(lp, k, sl, denoms=None):
        if which == "grpo":
            return flow_grpo_loss(lp[sl], old[sl], adv[sl], mask[sl], 0.2, kl=k[sl], kl_coef=0.5, denoms=denoms)[0]
        return flow_dppo_loss(lp[sl], old[sl], adv[sl], mask[sl], kl[sl], denoms=denoms)[0]

    lp_w, kl_w = logp.clone().requires_grad_(), kl.clone().requires_grad_()
    whole = run(lp_w, kl_w, slice(None))
    whole.backward()
    lp_a, kl_a = logp.clone().requires_grad_(), kl.clone().requires_grad_()
    total = 0.0
    for i in range(8):
        part = run(lp_a, kl_a, slice(i, i + 1), batch_denominators(mask))
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), abs=1e-12)
    close(lp_a.grad, lp_w.grad, tol=1e-12)
    if which == "grpo":
        close(kl_a.grad, kl_w.grad, tol=1e-12)


@pytest.mark.parametrize("which", ["nft", "awm_plain", "awm_ppo"])
def test_sample_losses_eight_micro_batches_of_one_equal_one_batch_of_eight(which):
    g = torch.Generator().manual_seed(1)
    x0, noise, v_old = (torch.randn(8, 2, 3, 3, generator=g, dtype=F64) for _ in range(3))
    t = torch.rand(8, generator=g, dtype=F64)
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    v0 = noise - x0 + 0.3 * torch.randn(8, 2, 3, 3, generator=g, dtype=F64)
    r = torch.rand(8, generator=g, dtype=F64)
    r[3] = NAN  # one missing sample: the denominator counts 7
    adv = (r - 0.5) * 4
    old_loss = ((v0 - (noise - x0)) ** 2).flatten(1).mean(1) + 0.05 * torch.randn(8, generator=g, dtype=F64)
    denoms = batch_denominators(torch.isfinite(r).unsqueeze(1))

    def run(v, sl, d=None):
        if which == "nft":
            return nft_loss(v[sl], v_old[sl], x0[sl], xt[sl], t[sl], r[sl], beta=0.5, denoms=d)[0]
        ol = old_loss[sl] if which == "awm_ppo" else None
        return awm_loss(v[sl], x0[sl], noise[sl], t[sl], adv[sl], weight="t", old_loss=ol, clip_range=0.02,
                        denoms=d)[0]

    v_w = v0.clone().requires_grad_()
    whole = run(v_w, slice(None))
    whole.backward()
    v_a = v0.clone().requires_grad_()
    total = 0.0
    for i in range(8):
        part = run(v_a, slice(i, i + 1), denoms)
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), abs=1e-12)
    close(v_a.grad, v_w.grad, tol=1e-12)
