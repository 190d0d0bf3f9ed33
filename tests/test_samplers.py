"""Flow-matching samplers against hand-derived numbers.

x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0, dt = sigma_next - sigma < 0.
Hand examples use x = [1, -2], v = [0.5, 2], noise eps = [1, -0.5] (one sample, two elements).
"""

from __future__ import annotations

import math

import pytest
import torch

from regen.samplers import (
    cps_step,
    euler_step,
    gaussian_log_prob,
    heun_step,
    sde_step,
    sde_steps,
    sigma_schedule,
    window_start,
)

F64 = torch.float64
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)  # 0.9189385332...
X = torch.tensor([[1.0, -2.0]], dtype=F64)
V = torch.tensor([[0.5, 2.0]], dtype=F64)
EPS = torch.tensor([[1.0, -0.5]], dtype=F64)
# -eps^2/2 averaged over the two elements: (-0.5 - 0.125) / 2
MEAN_HALF_EPS2 = -0.3125


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected.expand_as(actual), atol=tol, rtol=tol)


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- schedule and ODE steps


def test_sigma_schedule_linear_and_shifted():
    close(sigma_schedule(4), [1.0, 0.75, 0.5, 0.25, 0.0])
    # shift 3: 3s / (1 + 2s): 0.75 -> 2.25/2.5 = 0.9, 0.5 -> 1.5/2 = 0.75, 0.25 -> 0.75/1.5 = 0.5
    s = sigma_schedule(4, shift=3.0)
    close(s, [1.0, 0.9, 0.75, 0.5, 0.0])
    assert s.dtype == torch.float32 and s[0].item() == 1.0 and s[-1].item() == 0.0
    with pytest.raises(ValueError):
        sigma_schedule(0)


def test_euler_two_elements():
    # dt = 0.25 - 0.5 = -0.25: [1 - 0.5*0.25, -2 - 2*0.25] = [0.875, -2.5]
    close(euler_step(X, V, 0.5, 0.25), [[0.875, -2.5]], tol=1e-12)


def test_step_rejects_bad_sigmas():
    for s, sn in [(0.5, 0.5), (0.25, 0.5), (1.5, 0.5), (0.5, -0.1)]:
        with pytest.raises(ValueError, match="sigma_next"):
            euler_step(X, V, s, sn)


def test_sigma_as_zero_dim_tensor_equals_float():
    sig = sigma_schedule(10, shift=3.0)
    x, v = rand(2, 3, 4, 4), rand(2, 3, 4, 4, seed=1)
    assert torch.equal(euler_step(x, v, sig[3], sig[4]), euler_step(x, v, float(sig[3]), float(sig[4])))
    a = sde_step(x, v, sig[0], sig[1], 0.7, float(sig[1]), noise=x)
    b = sde_step(x, v, float(sig[0]), float(sig[1]), 0.7, float(sig[1]), noise=x)
    assert torch.equal(a.next, b.next) and torch.equal(a.log_prob, b.log_prob)


def test_heun_exact_on_straight_line_field_linear_in_x():
    # one data point x0: v(x, s) = (x - x0) / s, linear in x; trajectories are straight lines to
    # x0, so x(sn) = x0 + (x - x0) * sn / s. Here x0 = 3, x = [1, -2], s = 0.8, sn = 0.2:
    # [3 + (-2)(0.25), 3 + (-5)(0.25)] = [2.5, 1.75]. The corrector sees the same velocity.
    x0 = 3.0

    def vf(x, s):
        return (x - x0) / float(s)

    close(heun_step(X, vf(X, 0.8), vf, 0.8, 0.2), [[2.5, 1.75]], tol=1e-12)


def test_heun_exact_where_euler_is_not_velocity_affine_in_sigma():
    # v = 1 + 4s: x(sn) = x + (sn - s) + 2(sn^2 - s^2); s = 0.75, sn = 0.25: x - 0.5 - 1 = x - 1.5.
    # Euler: x + 4 * (-0.5) = x - 2, off by beta dt^2 / 2 = 4 * 0.25 / 2 = 0.5.
    def vf(x, s):
        return torch.ones_like(x) + 4.0 * float(s)

    close(heun_step(X, vf(X, 0.75), vf, 0.75, 0.25), [[-0.5, -3.5]], tol=1e-12)
    close(euler_step(X, vf(X, 0.75), 0.75, 0.25), [[-1.0, -4.0]], tol=1e-12)


def test_heun_second_order_on_linear_and_nonlinear_fields():
    # v = 2x, s = 1 -> 0.5, lam dt = -1: Heun gives x (1 + lam dt + (lam dt)^2 / 2) = 0.5 x,
    # Euler 0, exact exp(-1) x = 0.3679 x.
    def lin(x, s):
        return 2.0 * x

    close(heun_step(X, lin(X, 1.0), lin, 1.0, 0.5), 0.5 * X, tol=1e-12)
    # v = x^2 from x = 0.5, s = 1 -> 0.8 (dt = -0.2): exact 1 / (1/x - dt) = 1 / 2.2.
    # Euler 0.5 + 0.25(-0.2) = 0.45; Heun: x~ = 0.45, v~ = 0.2025, 0.5 - 0.2 (0.25 + 0.2025) / 2 = 0.45475
    def sq(x, s):
        return x * x

    x = torch.tensor([[0.5]], dtype=F64)
    heun, euler = heun_step(x, sq(x, 1.0), sq, 1.0, 0.8), euler_step(x, sq(x, 1.0), 1.0, 0.8)
    close(heun, 0.45475, tol=1e-12)
    assert abs(heun.item() - 1 / 2.2) < abs(euler.item() - 1 / 2.2) / 20  # 2.0e-4 vs 4.5e-3


def test_heun_last_step_is_euler_without_calling_the_model():
    def boom(x, s):
        raise AssertionError("velocity_fn must not be called at sigma_next = 0")

    x, v = rand(2, 3, 4, 4), rand(2, 3, 4, 4, seed=1)
    assert torch.equal(heun_step(x, v, boom, 0.1, 0.0), euler_step(x, v, 0.1, 0.0))


# ---------------------------------------------------------------- Flow-GRPO SDE


def test_sde_hand_example_at_half():
    # a = 0.5, s = 0.5, sn = 0.25, dt = -0.25: s_t = 0.5 sqrt(0.5 / 0.5) = 0.5, s_t^2 = 0.25
    # mean = x (1 + 0.25(-0.25)/1) + v (1 + 0.25 * 0.5 / 1)(-0.25) = 0.9375 x - 0.28125 v
    #      = [0.9375 - 0.140625, -1.875 - 0.5625] = [0.796875, -2.4375]
    # std = 0.5 sqrt(0.25) = 0.25; next = mean + 0.25 eps = [1.046875, -2.5625]
    out = sde_step(X, V, 0.5, 0.25, 0.5, 0.9, noise=EPS)
    close(out.mean, [[0.796875, -2.4375]])
    assert out.std == pytest.approx(0.25, abs=1e-12)
    close(out.next, [[1.046875, -2.5625]])
    close(out.log_prob, [MEAN_HALF_EPS2 - math.log(0.25) - HALF_LOG_2PI])  # -0.3125 + 1.3863 - 0.9189


def test_sde_hand_example_at_one_uses_sigma_max():
    # s = 1, sigma_max = 0.9, sn = 0.9, a = 0.7: s_t = 0.7 sqrt(1 / 0.1), s_t^2 = 4.9
    # mean = x (1 + 4.9(-0.1)/2) + v (1 + 0)(-0.1) = 0.755 x - 0.1 v = [0.705, -1.71]
    # std = 0.7 sqrt(10) sqrt(0.1) = 0.7; next = [1.405, -2.06]
    out = sde_step(X, V, 1.0, 0.9, 0.7, 0.9, noise=EPS)
    close(out.mean, [[0.705, -1.71]])
    assert out.std == pytest.approx(0.7, abs=1e-12)
    close(out.next, [[1.405, -2.06]])
    close(out.log_prob, [MEAN_HALF_EPS2 - math.log(0.7) - HALF_LOG_2PI])


def test_sde_std_matches_findings():
    # measured before: sigma_max 0.99 gives a first-step std of 0.7 * sqrt(1/0.01) * sqrt(0.1) = 2.21;
    # the last step of 10 has std 0.7 sqrt(0.1/0.9) sqrt(0.1) = 0.0738
    assert sde_step(X, V, 1.0, 0.9, 0.7, 0.99, noise=EPS).std == pytest.approx(7 * math.sqrt(0.1), abs=1e-12)
    assert sde_step(X, V, 0.1, 0.0, 0.7, 0.9, noise=EPS).std == pytest.approx(0.7 / 3 * math.sqrt(0.1), abs=1e-12)


def test_sde_log_prob_gradient_reaches_v():
    # d logp / d mean_i = (x'_i - mean_i) / (std^2 N) = 0.25 eps / 0.0625 / 2 = [2, -1];
    # d mean / d v = (1 + 0.125)(-0.25) = -0.28125  ->  [-0.5625, 0.28125]
    nxt = sde_step(X, V, 0.5, 0.25, 0.5, 0.9, noise=EPS).next.requires_grad_()
    v = V.clone().requires_grad_()
    sde_step(X, v, 0.5, 0.25, 0.5, 0.9, prev_sample=nxt).log_prob.sum().backward()
    close(v.grad, [[-0.5625, 0.28125]], tol=1e-12)
    assert nxt.grad is None  # the stored sample is data: score-function gradient only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("step", ["sde", "cps"])
def test_noise_level_zero_is_euler_bit_for_bit(dtype, step):
    x, v = rand(2, 3, 4, 4, dtype=dtype), rand(2, 3, 4, 4, dtype=dtype, seed=1)
    sig = sigma_schedule(10, shift=3.0).tolist()
    for s, sn in zip(sig[:-1], sig[1:]):  # includes sigma = 1 and sigma_next = 0
        out = sde_step(x, v, s, sn, 0.0, sig[1]) if step == "sde" else cps_step(x, v, s, sn, 0.0)
        assert torch.equal(out.next, euler_step(x, v, s, sn)) and out.next.dtype == dtype
        assert out.std == 0.0 and torch.equal(out.log_prob, torch.zeros(2))


def test_log_prob_of_prev_sample_is_the_normal_density_averaged():
    x, v, prev = rand(2, 3, 4, 4), rand(2, 3, 4, 4, seed=1), rand(2, 3, 4, 4, seed=2)
    out = sde_step(x, v, 0.6, 0.5, 0.7, 0.9, prev_sample=prev)
    assert out.next is prev
    ref = torch.distributions.Normal(out.mean, out.std).log_prob(prev).mean(dim=(1, 2, 3))
    close(out.log_prob, ref)
    mean, std = rand(2, 3, 4, 4, seed=3), 0.3
    close(gaussian_log_prob(prev, mean, std), torch.distributions.Normal(mean, std).log_prob(prev).mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", ["sde", "cps"])
def test_rescoring_the_sampled_transition_gives_the_same_log_prob(dtype, step):
    # the first on-policy update must see ratio exp(logp - old_logp) == 1 exactly
    def run(x, v, **kw):
        if step == "sde":
            return sde_step(x, v, 0.7, 0.6, 0.7, 0.9, **kw)
        return cps_step(x, v, 0.7, 0.6, 0.7, **kw)

    x, v = rand(2, 3, 4, 4, dtype=dtype), rand(2, 3, 4, 4, dtype=dtype, seed=1)
    sampled = run(x, v, generator=torch.Generator().manual_seed(5))
    again = run(x, v, prev_sample=sampled.next)
    assert torch.equal(sampled.log_prob, again.log_prob) and torch.equal(sampled.mean, again.mean)
    moved = run(x, (v.float() + 0.01).to(dtype), prev_sample=sampled.next)
    assert not torch.equal(moved.log_prob, sampled.log_prob)


def test_same_seed_same_sample():
    x, v = rand(2, 3, 4, 4), rand(2, 3, 4, 4, seed=1)

    def draw(seed):
        return sde_step(x, v, 0.7, 0.6, 0.7, 0.9, generator=torch.Generator().manual_seed(seed)).next

    assert torch.equal(draw(1), draw(1)) and not torch.equal(draw(1), draw(2))
    with pytest.raises(ValueError, match="not both"):
        sde_step(x, v, 0.7, 0.6, 0.7, 0.9, noise=x, prev_sample=x)


def test_video_shapes_reduce_per_sample():
    x, v, eps = rand(2, 3, 2, 4, 4), rand(2, 3, 2, 4, 4, seed=1), rand(2, 3, 2, 4, 4, seed=2)  # (B, F, C, H, W)
    out = sde_step(x, v, 0.7, 0.6, 0.7, 0.9, noise=eps)
    assert out.next.shape == x.shape and out.log_prob.shape == (2,)
    img = sde_step(x.flatten(1, 2), v.flatten(1, 2), 0.7, 0.6, 0.7, 0.9, noise=eps.flatten(1, 2))
    close(out.log_prob, img.log_prob)  # frames stacked as channels: same per-sample average
    prev = out.next.clone()
    prev[1] += 1.0  # changing sample 1 leaves sample 0 alone
    moved = sde_step(x, v, 0.7, 0.6, 0.7, 0.9, prev_sample=prev).log_prob
    assert moved[0] == out.log_prob[0] and moved[1] != out.log_prob[1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_give_float32_log_probs(dtype):
    x, v = (4 * rand(2, 3, 8, 8, seed=3)).to(dtype), (4 * rand(2, 3, 8, 8, seed=4)).to(dtype)
    g = torch.Generator().manual_seed(0)
    for out in (sde_step(x, v, 1.0, 0.9, 0.7, 0.9, generator=g), cps_step(x, v, 0.5, 0.4, 0.7, generator=g)):
        assert out.next.dtype == dtype and out.mean.dtype == torch.float32
        assert out.log_prob.dtype == torch.float32 and torch.isfinite(out.log_prob).all()
        assert torch.isfinite(out.next.float()).all()


# ---------------------------------------------------------------- CPS


def test_cps_hand_example():
    # s = 0.5, sn = 0.25, a = 1/3: std = 0.25 sin(pi/6) = 0.125, c = sqrt(0.0625 - 0.015625)
    # x0^ = x - 0.5 v = [0.75, -3], eps^ = x + 0.5 v = [1.25, -1]
    # mean = 0.75 x0^ + c eps^ = [0.5625 + 1.25 c, -2.25 - c] (public code's form, not ours)
    c = math.sqrt(0.046875)
    out = cps_step(X, V, 0.5, 0.25, 1 / 3, noise=EPS)
    assert out.std == pytest.approx(0.125, abs=1e-12)
    close(out.mean, [[0.5625 + 1.25 * c, -2.25 - c]])
    close(out.next, [[0.5625 + 1.25 * c + 0.125, -2.25 - c - 0.0625]])
    close(out.log_prob, [MEAN_HALF_EPS2 - math.log(0.125) - HALF_LOG_2PI])


def test_cps_is_continuous_in_a_at_zero_and_deterministic_at_the_end():
    x, v = rand(2, 3, 4, 4, dtype=F64), rand(2, 3, 4, 4, dtype=F64, seed=1)
    # a = 1e-3: sqrt(sn^2 - std^2) - sn ~ -sn (a pi / 2)^2 / 2 = -3e-7 sn: mean within 1e-6 of Euler
    close(cps_step(x, v, 0.5, 0.25, 1e-3, noise=x).mean, euler_step(x, v, 0.5, 0.25))
    last = cps_step(x, v, 0.1, 0.0, 0.7)  # std = 0 * sin(.) = 0: the predicted x0, exactly
    assert last.std == 0.0 and torch.equal(last.next, euler_step(x, v, 0.1, 0.0))
    with pytest.raises(ValueError, match="noise_level"):
        cps_step(x, v, 0.5, 0.25, 1.5)


# ---------------------------------------------------------------- mixed ODE/SDE schedules


def test_sde_steps_modes():
    assert sde_steps(4, "all").tolist() == [True] * 4
    assert sde_steps(4, "none").tolist() == [False] * 4
    assert sde_steps(5, "window", 2, start=1).tolist() == [False, True, True, False, False]
    assert sde_steps(5, "window", 2, start=3).tolist() == [False, False, False, True, True]  # last step
    assert sde_steps(5, "window", 0, start=2).tolist() == [False] * 5  # empty window == "none"
    assert sde_steps(5, "window", 5).tolist() == [True] * 5
    with pytest.raises(ValueError, match="window_size 6 must be between 0 and the number of sampling steps 5"):
        sde_steps(5, "window", 6)
    with pytest.raises(ValueError, match="start 4"):
        sde_steps(5, "window", 2, start=4)
    with pytest.raises(ValueError, match="unknown"):
        sde_steps(5, "sliding", 2)


def test_window_start_fixed_and_moving():
    assert [window_start(t, 5, 2, "fixed") for t in (0, 7)] == [0, 0]
    assert window_start(9, 5, 2, "fixed", start=2) == 2
    # one step later every 2 training steps, stopping at n - w = 3
    assert [window_start(t, 5, 2, "moving", shift_every=2) for t in range(9)] == [0, 0, 1, 1, 2, 2, 3, 3, 3]
    assert window_start(1000, 5, 2, "moving", shift_every=2) == 3
    assert [window_start(t, 5, 2, "moving", max_start=1) for t in range(4)] == [0, 1, 1, 1]
    assert window_start(0, 5, 5, "moving") == 0  # window == all steps: only start 0 is valid
    with pytest.raises(ValueError, match="number of sampling steps"):
        window_start(0, 3, 4, "moving")
    with pytest.raises(ValueError, match="max_start"):
        window_start(0, 5, 2, "fixed", start=4)
    with pytest.raises(ValueError, match="unknown"):
        window_start(0, 5, 2, "sliding")


def test_window_start_random_is_uniform_in_range_and_seeded():
    def draws(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return [window_start(t, 10, 3, "random", generator=g, **kw) for t in range(400)]

    assert draws(0) == draws(0) and draws(0) != draws(1)
    counts = torch.bincount(torch.tensor(draws(0)), minlength=8)
    assert len(counts) == 8 and (counts > 25).all()  # starts 0..7 = n - w, each ~50 times
    # Flow-GRPO-Fast style range: windows inside the first half, starts 0..2
    assert set(draws(0, max_start=2)) == {0, 1, 2}
    assert window_start(0, 10, 0, "random", generator=torch.Generator().manual_seed(0)) in range(11)
