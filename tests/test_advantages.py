"""grpo_advantages against hand-derived numbers (GRPO, Shao 2024: A = (R - mean) / (std + eps)).

std is the unbiased (Bessel, n-1) sample std; eps = 1e-6 (the default) is kept in the arithmetic.
"""

import math

import pytest
import torch

from regen.algorithms.advantages import grpo_advantages, reinforce_pp_advantages, rloo_advantages

EPS = 1e-6
NAN = float("nan")


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol)


def test_std_normalised_matches_hand_computation_with_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv, valid, m = grpo_advantages(rewards, group_size=4)
    # group [1,0,0,1]: mean 0.5, deviations ±0.5, sum sq 1, var 1/3 -> std sqrt(1/3)=0.577350
    a1 = 0.5 / (math.sqrt(1 / 3) + EPS)  # 0.866024
    # group [3,1,2,2]: mean 2, deviations [1,-1,0,0], sum sq 2, var 2/3 -> std 0.816497
    a2 = 1.0 / (math.sqrt(2 / 3) + EPS)  # 1.224743
    close(adv, [a1, -a1, -a1, a1, a2, -a2, 0.0, 0.0])
    assert adv.dtype == torch.float32
    assert valid.tolist() == [True] * 8
    close(m["zero_std_frac"], 0.0)
    close(m["dropped_group_frac"], 0.0)
    close(m["missing_frac"], 0.0)


def test_without_std_normalisation_advantage_is_reward_minus_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv, valid, _ = grpo_advantages(rewards, group_size=4, std_normalize=False)
    # means 0.5 and 2 (Dr.GRPO: no division by std)
    close(adv, [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0])
    assert valid.all()


@pytest.mark.parametrize("std_normalize", [True, False])
def test_zero_variance_group_gets_zero_advantage_and_is_counted(std_normalize):
    rewards = torch.tensor([2.0, 2.0, 2.0, 2.0, 1.0, 0.0, 1.0, 0.0])
    adv, valid, m = grpo_advantages(rewards, group_size=4, std_normalize=std_normalize)
    # group [2,2,2,2]: deviations all 0 -> A = 0 (0/(0+eps)), still valid; 1 of 2 kept groups
    a = 0.5 / (math.sqrt(1 / 3) + EPS) if std_normalize else 0.5
    close(adv, [0.0, 0.0, 0.0, 0.0, a, -a, a, -a])
    assert torch.isfinite(adv).all()
    assert valid.tolist() == [True] * 8
    close(m["zero_std_frac"], 0.5)


def test_nan_reward_is_excluded_from_mean_and_std_and_gets_no_advantage():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.5])
    adv, valid, m = grpo_advantages(rewards, group_size=4)
    # present [1,0,0.5]: mean 0.5 (0.375 if NaN were read as 0), deviations [.5,-.5,0],
    # sum sq 0.5, unbiased var 0.5/(3-1)=0.25 -> std 0.5
    a = 0.5 / (0.5 + EPS)  # 0.999998
    close(adv, [a, 0.0, -a, 0.0])
    assert valid.tolist() == [True, False, True, True]
    close(m["missing_frac"], 1 / 4)
    close(m["dropped_group_frac"], 0.0)


def test_nan_reward_without_std_normalisation():
    rewards = torch.tensor([1.0, NAN, 0.0, 0.5])
    adv, valid, _ = grpo_advantages(rewards, group_size=4, std_normalize=False)
    # mean of present [1,0,0.5] = 0.5
    close(adv, [0.5, 0.0, -0.5, 0.0])
    assert valid.tolist() == [True, False, True, True]


def test_group_with_fewer_than_two_valid_rewards_is_dropped_whole():
    rewards = torch.tensor([NAN, 1.0, NAN, NAN, 0.0, 1.0, 1.0, 0.0, NAN, NAN, NAN, NAN])
    adv, valid, m = grpo_advantages(rewards, group_size=4)
    # group 0: one valid reward -> dropped; group 2: none -> dropped; group 1 kept:
    # [0,1,1,0] mean .5, std sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    close(adv, [0.0] * 4 + [-a, a, a, -a] + [0.0] * 4)
    assert valid.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    close(m["dropped_group_frac"], 2 / 3)
    close(m["missing_frac"], 7 / 12)
    # dropped groups (whose std reads 0) are not counted as zero-std kept groups
    close(m["zero_std_frac"], 0.0)


def test_zero_std_frac_is_over_kept_groups_only():
    rewards = torch.tensor([5.0, NAN, 3.0, 3.0])
    _, valid, m = grpo_advantages(rewards, group_size=2)
    # group [5,nan] dropped (1 valid); group [3,3] kept, zero std -> 1 of 1 kept groups
    assert valid.tolist() == [False, False, True, True]
    close(m["zero_std_frac"], 1.0)
    close(m["dropped_group_frac"], 0.5)
    close(m["missing_frac"], 0.25)


def test_zero_std_frac_counts_an_all_equal_float64_group():
    rewards = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    adv, _, m = grpo_advantages(rewards, group_size=3)
    # one kept group whose rewards are all equal -> 1/1
    close(m["zero_std_frac"], 1.0)
    assert torch.equal(adv, torch.zeros(3, dtype=torch.float64))  # exactly no signal


@pytest.mark.parametrize(
    "rewards, group_size",
    [(torch.zeros(2, 4), 4), (torch.zeros(7), 4), (torch.zeros(()), 1)],
)
def test_rewards_that_do_not_split_into_groups_raise(rewards, group_size):
    with pytest.raises(ValueError):
        grpo_advantages(rewards, group_size)


def test_an_estimator_refuses_a_keyword_it_does_not_take():
    """A misspelled or foreign setting is a TypeError, never silently the default (they took **_ before)."""
    from regen.algorithms.flow import flow_dppo_loss, flow_group_advantages, flow_grpo_loss

    r = torch.tensor([1.0, 0.0, 2.0, 0.0])
    for fn, kw in [(grpo_advantages, {"global_std": True}), (rloo_advantages, {"std_normalize": "batch"}),
                   (reinforce_pp_advantages, {"std_normalize": "none"}), (flow_group_advantages, {"global_std": True})]:
        with pytest.raises(TypeError, match="unexpected keyword"):
            fn(r, 2, **kw)
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="unexpected keyword"):
        flow_grpo_loss(x, x, torch.ones(2), m, clip_lo=0.1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        flow_dppo_loss(x, x, torch.ones(2), m, x, taus=1e-3)


def test_each_estimator_gets_exactly_the_settings_it_registered():
    from types import SimpleNamespace

    from regen.algorithms import ADVANTAGES, advantage_kwargs

    a = SimpleNamespace(std_normalize="batch", reinforce_baseline=True)
    assert {name: advantage_kwargs(fn, a) for name, fn in ADVANTAGES.items()} == {
        "grpo": {"std_normalize": "batch"}, "rloo": {}, "reinforce_pp": {"baseline": True}}
