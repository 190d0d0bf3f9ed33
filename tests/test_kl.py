"""kl_penalty against Schulman's estimators, with d = ref_logp - logp:
k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1 (clamped to [-10, 10])."""

import math

import pytest
import torch

from regen.algorithms.kl import kl_penalty

E = math.e


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=tol)


# columns: logp=-1,ref=-2 (d=-1) | logp=-2,ref=-1 (d=1) | logp=ref=-0.5 (d=0) | logp=-1,ref=-3 (d=-2)
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
REF = torch.tensor([[-2.0, -1.0, -0.5, -3.0]])


def test_k1_is_logp_minus_ref_and_can_be_negative():
    close(kl_penalty(LOGP, REF, "k1"), [[1.0, -1.0, 0.0, 2.0]])


def test_k2_is_half_squared_difference():
    close(kl_penalty(LOGP, REF, "k2"), [[0.5, 0.5, 0.0, 2.0]])


def test_k3_matches_exp_d_minus_d_minus_one():
    # d=-1: e^-1 + 1 - 1 = 0.367879 | d=1: e - 1 - 1 = 0.718282 | d=0: 0 | d=-2: e^-2 + 2 - 1 = 1.135335
    close(kl_penalty(LOGP, REF, "k3"), [[1 / E, E - 2, 0.0, E**-2 + 1]])


def test_default_estimator_is_k3():
    close(kl_penalty(LOGP, REF), [[1 / E, E - 2, 0.0, E**-2 + 1]])


def test_k3_is_never_negative():
    d = [-8.0, -3.0, -1.0, -0.1, -1e-3, 0.0, 1e-3, 0.1, 1.0, 2.0]
    logp = torch.zeros(1, len(d))
    ref = torch.tensor([d])
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_k3_is_clamped_at_ten_for_huge_differences():
    # d=30: e^30 - 31 ≈ 1.07e13 -> 10 | d=-30: e^-30 + 29 ≈ 29 -> 10 | d=200: exp overflows to inf -> 10
    # d=2: e^2 - 3 = 4.389056, below the bound, untouched
    logp = torch.tensor([[-30.0, 0.0, -200.0, -2.0]])
    ref = torch.tensor([[0.0, -30.0, 0.0, 0.0]])
    out = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(out).all()
    close(out, [[10.0, 10.0, 10.0, E**2 - 3]])


def test_output_keeps_the_batch_time_shape():
    assert kl_penalty(torch.zeros(3, 5), torch.zeros(3, 5), "k3").shape == (3, 5)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError):
        kl_penalty(LOGP, REF, "k4")
