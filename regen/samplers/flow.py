"""Per-step samplers of a flow-matching model, as pure functions of tensors.

Conventions (other modules rely on them):
    x_sigma = (1 - sigma) * x0 + sigma * eps      sigma = 1 is noise, sigma = 0 is data
    v       = eps - x0 = dx/dsigma                what the model predicts
    a step goes from sigma to sigma_next < sigma, dt = sigma_next - sigma < 0

x is (B, ...) with the batch first: (B, C, H, W) images, (B, F, C, H, W) video; per-sample
reductions run over every non-batch dim. sigma and sigma_next are python floats or 0-dim
tensors; a tensor is read with float(), one host sync per step (pass sigmas.tolist() to avoid
it). Arithmetic runs in at least float32 (float64 stays float64) because bf16 overflows and
loses the small drift terms (flow_grpo upcasts for the same reason); the returned sample has
x's dtype, means and log-probs are in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

VelocityFn = Callable[[torch.Tensor, float | torch.Tensor], torch.Tensor]  # (x, sigma) -> v


@dataclass
class StepOut:
    """One stochastic step. next: the sample, x's dtype; mean: (B, ...) Gaussian mean in the
    compute dtype, differentiable w.r.t. v; std: the scalar noise std of this step;
    log_prob: (B,) log-density of `next` averaged over its elements."""

    next: torch.Tensor
    mean: torch.Tensor
    std: float
    log_prob: torch.Tensor


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in ts:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _sigmas(sigma: float | torch.Tensor, sigma_next: float | torch.Tensor) -> tuple[float, float]:
    s, sn = float(sigma), float(sigma_next)
    if not 0.0 <= sn < s <= 1.0:
        raise ValueError(f"a step needs 0 <= sigma_next < sigma <= 1, got sigma={s}, sigma_next={sn}")
    return s, sn


def sigma_schedule(n_steps: int, shift: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n_steps + 1,) sigmas from 1 to 0: linear, then the SD3 time shift (Esser et al. 2024,
    "resolution-dependent shifting")  sigma' = shift * sigma / (1 + (shift - 1) * sigma).

    Same grid as diffusers' FlowMatchEulerDiscreteScheduler for SD3: linspace(1, 1/n, n) plus a
    final 0. Computed in float64 and rounded once; both endpoints are exact.
    """
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    s = torch.linspace(1.0, 0.0, n_steps + 1, dtype=torch.float64)
    return (shift * s / (1.0 + (shift - 1.0) * s)).to(dtype)


def _euler(xc: torch.Tensor, vc: torch.Tensor, dt: float) -> torch.Tensor:
    # the one Euler expression every sampler starts from, so that their zero-noise limits
    # are the same floating-point operations as euler_step
    return xc + vc * dt


def euler_step(x: torch.Tensor, v: torch.Tensor, sigma: float | torch.Tensor,
               sigma_next: float | torch.Tensor) -> torch.Tensor:
    """Euler step of the probability-flow ODE dx/dsigma = v:  x' = x + v * dt."""
    s, sn = _sigmas(sigma, sigma_next)
    cd = _compute_dtype(x, v)
    return _euler(x.to(cd), v.to(cd), sn - s).to(x.dtype)


def heun_step(x: torch.Tensor, v: torch.Tensor, velocity_fn: VelocityFn,
              sigma: float | torch.Tensor, sigma_next: float | torch.Tensor) -> torch.Tensor:
    """Heun's second-order step (explicit trapezoid rule; Karras et al. 2022, Alg. 1):

        x~ = x + v(x, sigma) * dt                       predictor (Euler)
        x' = x + (v(x, sigma) + v(x~, sigma_next)) / 2 * dt   corrector

    v is v(x, sigma), already computed; velocity_fn(x~, sigma_next) is called once. At
    sigma_next == 0 the step is plain Euler, as in diffusers' Heun scheduler and Karras's
    sampler: the velocity at sigma = 0 is not needed and often ill-conditioned.
    """
    s, sn = _sigmas(sigma, sigma_next)
    cd = _compute_dtype(x, v)
    xc, vc, dt = x.to(cd), v.to(cd), sn - s
    x_pred = _euler(xc, vc, dt)
    if sn == 0.0:
        return x_pred.to(x.dtype)
    v_next = velocity_fn(x_pred.to(x.dtype), sigma_next).to(cd)
    return (xc + (vc + v_next) * (0.5 * dt)).to(x.dtype)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """(B,) log N(x; mean, std^2) per element, averaged over all non-batch dims:

        mean_i [ -(x_i - mean_i)^2 / (2 std^2) - log std - log sqrt(2 pi) ]

    In at least float32 whatever the input dtype. std > 0 (a scalar or broadcastable to x).
    The average, not the sum, is the Flow-GRPO convention: the log-ratio of a step then does
    not grow with the latent size, so clip ranges transfer across resolutions.
    """
    cd = _compute_dtype(x, mean, *([std] if isinstance(std, torch.Tensor) else []))
    std_t = torch.as_tensor(std, dtype=cd, device=x.device)
    lp = -((x.to(cd) - mean.to(cd)) ** 2) / (2.0 * std_t**2) - torch.log(std_t) - _HALF_LOG_2PI
    return lp.reshape(x.shape[0], -1).mean(dim=1)


def _gaussian_step(x: torch.Tensor, mean: torch.Tensor, std: float, noise: torch.Tensor | None,
                   generator: torch.Generator | None, prev_sample: torch.Tensor | None) -> StepOut:
    """Draw next = mean + std * eps (or take prev_sample) and score it. The log-prob is of the
    sample as returned, i.e. after rounding to x's dtype, so re-scoring a stored transition
    with the same x and v reproduces it bit for bit (first on-policy ratio exactly 1)."""
    if prev_sample is not None and noise is not None:
        raise ValueError("give either prev_sample (re-scoring) or noise (sampling), not both")
    if prev_sample is not None:
        nxt = prev_sample
    elif std == 0.0:
        nxt = mean.to(x.dtype)
    else:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=mean.dtype)
        nxt = (mean + std * noise.to(mean.dtype)).to(x.dtype)
    if std == 0.0:
        # a point mass has no density; 0 by definition makes such steps contribute ratio 1
        # and no gradient. Only SDE steps should be trained, so nobody should depend on it.
        log_prob = torch.zeros(x.shape[0], dtype=mean.dtype, device=x.device)
    else:
        # the sample is data, not a function of the parameters (the score-function estimator)
        log_prob = gaussian_log_prob(nxt.detach(), mean, std)
    return StepOut(nxt, mean, std, log_prob)


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor,
             noise_level: float, sigma_max: float, noise: torch.Tensor | None = None,
             generator: torch.Generator | None = None, prev_sample: torch.Tensor | None = None) -> StepOut:
    """Flow-GRPO SDE step (Liu et al. 2025, arXiv:2505.05470, Euler-Maruyama discretisation of
    the reverse SDE with the same marginals as the flow ODE):

        s    = a * sqrt(sigma / (1 - sigma~)),   sigma~ = sigma_max if sigma == 1 else sigma
        mean = x * (1 + s^2 dt / (2 sigma)) + v * (1 + s^2 (1 - sigma) / (2 sigma)) * dt
        std  = s * sqrt(-dt),   next = mean + std * eps

    a = noise_level (0.7 in the paper). sigma_max stands in for sigma only in the denominator
    at sigma = 1, where s is infinite; pass the grid's next value (e.g. 0.9 for 10 steps) as
    flow_grpo does: 0.99 gives a first-step std of 2.2 and speckled samples (measured on the shapes task).
    noise: the standard-normal eps (drawn with `generator` when None). prev_sample: re-score
    that stored sample instead of drawing one. noise_level 0 is exactly euler_step, with
    std 0 and log_prob 0 by definition.

    Computed as mean = [x + v dt] + (s^2 dt / (2 sigma)) * (x + (1 - sigma) v), the same
    expression regrouped (x + (1 - sigma) v is the predicted noise eps^), so that a = 0 adds
    exactly 0 to the Euler result.
    """
    s, sn = _sigmas(sigma, sigma_next)
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if not 0.0 < sigma_max < 1.0:
        raise ValueError(f"sigma_max must be in (0, 1), got {sigma_max}")
    cd = _compute_dtype(x, v)
    xc, vc, dt = x.to(cd), v.to(cd), sn - s
    s_t = noise_level * math.sqrt(s / (1.0 - (sigma_max if s == 1.0 else s)))
    mean = _euler(xc, vc, dt) + (s_t**2 * dt / (2.0 * s)) * (xc + (1.0 - s) * vc)
    return _gaussian_step(x, mean, s_t * math.sqrt(-dt), noise, generator, prev_sample)


def cps_step(x: torch.Tensor, v: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor,
             noise_level: float, noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
             prev_sample: torch.Tensor | None = None) -> StepOut:
    """Coefficients-Preserving Sampling (Wang & Yu 2025, arXiv:2509.05952; sde_type "cps" in
    flow_grpo): re-noise the predicted clean sample so that next keeps exactly the
    coefficients (1 - sigma_next, sigma_next) of x0 and total noise:

        x0^ = x - sigma v,   eps^ = x + (1 - sigma) v,   std = sigma_next * sin(a pi / 2)
        mean = (1 - sigma_next) x0^ + sqrt(sigma_next^2 - std^2) eps^,   next = mean + std * eps

    a = noise_level in [0, 1]. At sigma_next = 0 std is 0: the last step is deterministic.

    Deviation from the public code: flow_grpo's cps log_prob is -(next - mean)^2 averaged, with
    no 1/(2 std^2) and no normalisation. Its ratios are exp(2 std^2 * true log-ratio), i.e. far
    flatter than the policy's, and its clip range means something else. We return the proper
    Gaussian log-density (std does not depend on the weights, so only the 1/(2 std^2) scale
    changes ratios); clip ranges tuned for the public code do not transfer.
    """
    s, sn = _sigmas(sigma, sigma_next)
    if not 0.0 <= noise_level <= 1.0:
        raise ValueError(f"cps noise_level must be in [0, 1], got {noise_level}")
    cd = _compute_dtype(x, v)
    xc, vc, dt = x.to(cd), v.to(cd), sn - s
    std = sn * math.sin(noise_level * math.pi / 2.0)
    # (1 - sn) x0^ + sn eps^ = (1 - sn)(x - s v) + sn (x + (1 - s) v)
    #                        = x + v (-s + s sn + sn - s sn) = x + v (sn - s) = x + v dt,
    # so mean = [x + v dt] + (sqrt(sn^2 - std^2) - sn) eps^. At a = 0, sqrt(sn^2) == sn exactly
    # in IEEE arithmetic, the correction is exactly 0 and the step is euler_step bit for bit.
    c = math.sqrt(sn * sn - std * std) - sn
    mean = _euler(xc, vc, dt) + c * (xc + (1.0 - s) * vc)
    return _gaussian_step(x, mean, std, noise, generator, prev_sample)


# ---------------------------------------------------------------- mixed ODE/SDE schedules


def _check_window(n_steps: int, window_size: int) -> int:
    """The last valid window start, n_steps - window_size."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    if not 0 <= window_size <= n_steps:
        raise ValueError(f"SDE window_size {window_size} must be between 0 and the number of sampling steps {n_steps}")
    return n_steps - window_size


def sde_steps(n_steps: int, mode: str, window_size: int = 0, start: int = 0) -> torch.Tensor:
    """(n_steps,) bool: which sampling steps are stochastic (and trained); the rest use euler_step.

    "all": every step (Flow-GRPO); "none": an ODE rollout (DiffusionNFT, AWM);
    "window": steps start .. start + window_size - 1 (Flow-GRPO-Fast, MixGRPO). A window of
    size 0 is empty, the same as "none".
    """
    if mode == "all":
        return torch.ones(n_steps, dtype=torch.bool)
    if mode == "none":
        return torch.zeros(n_steps, dtype=torch.bool)
    if mode != "window":
        raise ValueError(f"unknown SDE step mode '{mode}' (expected all, none or window)")
    last = _check_window(n_steps, window_size)
    if not 0 <= start <= last:
        raise ValueError(f"SDE window start {start} must be between 0 and {last} "
                         f"(n_steps {n_steps} - window_size {window_size})")
    mask = torch.zeros(n_steps, dtype=torch.bool)
    mask[start:start + window_size] = True
    return mask


def window_start(train_step: int, n_steps: int, window_size: int, policy: str,
                 generator: torch.Generator | None = None, shift_every: int = 1,
                 max_start: int | None = None, start: int = 0) -> int:
    """Where the SDE window of this training step begins. max_start (default and at most
    n_steps - window_size) is the latest allowed start.

    "fixed":  always `start`.
    "random": uniform on [start, max_start], one draw per call (Flow-GRPO-Fast samples the
              window inside a range, e.g. the first half of the steps). Pass a generator whose
              state the checkpoint saves to make resume exact.
    "moving": MixGRPO's sliding window (Li et al. 2025): start + train_step // shift_every,
              advancing one step every `shift_every` training steps toward the clean end.
              It stops at max_start and stays there (MixGRPO's default; its public code can
              also roll back to the start, and lets the window shrink past the end, which we
              do not: the window keeps its size).
    """
    last = _check_window(n_steps, window_size)
    if max_start is None:
        max_start = last
    if not 0 <= start <= max_start <= last:
        raise ValueError(f"need 0 <= start ({start}) <= max_start ({max_start}) <= "
                         f"n_steps - window_size ({last})")
    if policy == "fixed":
        return start
    if policy == "random":
        return int(torch.randint(start, max_start + 1, (1,), generator=generator).item())
    if policy == "moving":
        if shift_every < 1:
            raise ValueError(f"shift_every must be >= 1, got {shift_every}")
        if train_step < 0:
            raise ValueError(f"train_step must be >= 0, got {train_step}")
        return min(start + train_step // shift_every, max_start)
    raise ValueError(f"unknown SDE window policy '{policy}' (expected fixed, random or moving)")
