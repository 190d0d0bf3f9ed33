"""PPO's critic math and REINFORCE++ with the KL in the reward, against values worked out by
hand from the formulas (REFERENCES.md: GAE row; Ouyang 2022 eq. 2; Hu 2025)."""

import math

import pytest
import torch

from regen.algorithms.gae import gae, kl_shaped_rewards, masked_whiten, token_advantages, value_loss
from regen.algorithms.losses import batch_denominators

NAN = float("nan")


def test_kl_shaped_rewards_put_R_on_the_last_token_and_k1_on_every_token():
    rewards = torch.tensor([1.0, NAN, 2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -5.0, -5.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-1.2, -1.0, -1.0], [-3.0, -3.0, -3.0]])
    out = kl_shaped_rewards(rewards, mask, logp, ref, kl_coef=0.1)
    # row 0: logp - ref = [0.5, -1]: r = [-0.05, 0.1 + 1.0]; masked token 0
    # row 1: missing reward counts 0; logp - ref = 0.2 -> -0.02; row 2: no tokens
    expected = torch.tensor([[-0.05, 1.1, 0.0], [-0.02, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="needs logp"):
        kl_shaped_rewards(rewards, mask, kl_coef=0.1)


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0], [0.0, 0.0, 0.0]])
    v = torch.tensor([[0.5, 0.6, 0.8], [1.0, 1.0, 5.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, ret = gae(r, v, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - 0.8 = 0.2; d1 = 0.9*0.8 - 0.6 = 0.12, A1 = 0.12 + 0.72*0.2 = 0.264;
    #        d0 = 0.9*0.6 - 0.5 = 0.04, A0 = 0.04 + 0.72*0.264 = 0.23008
    # row 1: the last valid token is 1, V after it is 0: d1 = 2 - 1 = 1; d0 = 0.9*1 - 1 = -0.1,
    #        A0 = -0.1 + 0.72*1 = 0.62; position 2 (and its reward 7, value 5) is outside the mask
    # row 2: empty response: all zero, no NaN
    torch.testing.assert_close(adv, torch.tensor([[0.23008, 0.264, 0.2], [0.62, 1.0, 0.0], [0.0, 0.0, 0.0]]),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[0.73008, 0.864, 1.0], [1.62, 2.0, 0.0], [0.0, 0.0, 0.0]]),
                               atol=1e-6, rtol=0)


def test_gae_with_unit_gamma_lambda_and_zero_values_is_reward_to_go():
    r = torch.tensor([[0.1, 0.2, 0.3]])
    adv, _ = gae(r, torch.zeros_like(r), torch.ones_like(r), 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.6, 0.5, 0.3]]), atol=1e-6, rtol=0)


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # valid 1,2,3,4: mean 2.5, unbiased var (2.25+0.25+0.25+2.25)/3 = 5/3
    s = math.sqrt(5 / 3)
    expected = torch.tensor([[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(x, mask), expected, atol=1e-6, rtol=0)
    one = masked_whiten(torch.tensor([[5.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    assert one.tolist() == [[0.0, 0.0]]  # a single valid token: centred only, no 0/0


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.1]])
    returns = torch.tensor([[2.0, 0.3]])
    mask = torch.ones(1, 2)
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    # t0: (1-2)^2 = 1; V_clip = 0.5 + 0.2 = 0.7, (0.7-2)^2 = 1.69 -> 0.5*1.69 = 0.845 (clipped term)
    # t1: (0-0.3)^2 = 0.09; V_clip = 0.1 - 0.1 = 0.0 -> 0.09 as well (tie, unclipped) -> 0.045
    assert loss.item() == pytest.approx((0.845 + 0.045) / 2, abs=1e-6)
    assert m["vf_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # the clipped term of t0 does not depend on V (it moved past the clip): no gradient there;
    # t1: d/dV 0.5 (V - 0.3)^2 / 2 tokens = (0 - 0.3) / 2
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.15]]), atol=1e-6, rtol=0)
    plain, _ = value_loss(values.detach(), old, returns, mask, clip=None)
    assert plain.item() == pytest.approx((0.5 * 1.0 + 0.5 * 0.09) / 2, abs=1e-6)


def test_value_loss_micro_batches_add_up_to_the_batch():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(8, 5, generator=g)
    old, returns = values + 0.3 * torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])[:, None]).float()
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = values.clone().requires_grad_()
        loss, _ = value_loss(whole, old, returns, mask, 0.2, mode, norm=5.0)
        loss.backward()
        acc, total = values.clone().requires_grad_(), 0.0
        denoms = batch_denominators(mask)
        for i in range(8):
            part, _ = value_loss(acc[i:i + 1], old[i:i + 1], returns[i:i + 1], mask[i:i + 1], 0.2, mode, 5.0, denoms)
            part.backward()
            total += part.item()
        assert total == pytest.approx(loss.item(), abs=1e-6)
        torch.testing.assert_close(acc.grad, whole.grad, atol=1e-6, rtol=1e-5)


def test_token_advantages_gae_drops_missing_rewards():
    rewards = torch.tensor([1.0, NAN])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    values = torch.tensor([[0.25, 0.5], [9.0, 9.0]])
    adv, ret, valid, m = token_advantages(rewards, mask, 1, "gae", values=values, gamma=1.0, lam=1.0, whiten=False)
    # row 0: d1 = 1 - 0.5 = 0.5, d0 = 0.5 - 0.25 = 0.25 -> A0 = 0.75; returns = A + V = [1, 1]
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.5], [0.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), atol=1e-6, rtol=0)
    assert valid.tolist() == [True, False] and m["missing_frac"].item() == pytest.approx(0.5)


def test_reinforce_pp_token_level_with_group_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.ones(2, 2)
    adv, ret, valid, _ = token_advantages(rewards, mask, 2, "reinforce_pp", baseline=True)
    # centred rewards +-0.5 on the last token -> reward-to-go [[.5, .5], [-.5, -.5]]; whitened over
    # 4 tokens: mean 0, unbiased var 4*0.25/3 = 1/3 -> +-0.5 * sqrt(3)
    s = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([[s, s], [-s, -s]]), atol=1e-6, rtol=0)
    assert ret is None and valid.all()


def test_extreme_log_ratios_and_values_stay_finite():
    rewards = torch.tensor([1e4, -1e4, 0.0, 1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    logp = torch.tensor([[-80.0, -0.0, -50.0]] * 4)
    ref = torch.tensor([[-0.0, -90.0, -0.0]] * 4)
    values = torch.tensor([[1e3, -1e3, 0.0]] * 4)
    adv, ret, _, _ = token_advantages(rewards, mask, 1, "gae", values=values, logp=logp, ref_logp=ref, kl_coef=0.1)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    loss, _ = value_loss(values, values * 0, ret, mask, 0.2)
    assert math.isfinite(loss.item())
