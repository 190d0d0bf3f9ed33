"""A trust region for the ODE flow methods (DiffusionNFT, AWM, DGPO): a bound on how far one
optimizer step may move the policy's velocity on the points the step was computed from.

The ODE methods have no likelihood ratio to clip (they train on clean samples pushed back through
the forward process), and Adam's step length hardly depends on the gradient's size, so neither a
penalty in the loss nor a smaller gradient bounds one update: the first update of a batch starts
at the sampling policy, where a penalty to it has no gradient at all. What is left is a step-size
rule, measured where the policy acts. After each optimizer step,

    D = mean_i mean_elements (v_new(x_t_i, t_i) - v_before(x_t_i, t_i))^2

over the minibatch's own valid rows and forward-process points (the same velocity distance that
NFT's `old_deviate` and the velocity KL use: for two flows' Gaussian steps of one std the KL is
proportional to it). When D exceeds the bound delta the step is scaled back toward the weights it
started from, theta <- theta_before + alpha (theta_after - theta_before), with

    alpha = sqrt(delta / D)

which gives D(alpha) = alpha^2 D = delta exactly when the velocity is linear in the weights
(a first-order Taylor expansion otherwise: the scaled step is short, so the expansion is close).
As PPO clips the ratio of one sample, this clips the movement of one update; like TRPO's line
search (Schulman et al. 2015, sec. 6) the step is shortened after it is proposed, with one
measurement instead of a search. The first update of a batch starts at the sampling policy, so
there the bound is against the policy that drew the batch.
"""

from __future__ import annotations

import math

import torch

from regen.algorithms.flow import velocity_drift


def velocity_change(v_new: torch.Tensor, v_before: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    """(sum over valid rows of each row's mean squared velocity change, number of valid rows):
    summed over micro-batches and ranks before the division, so the split never changes D."""
    if v_new.shape != v_before.shape:
        raise ValueError(f"velocity_change: shapes {tuple(v_new.shape)} and {tuple(v_before.shape)} differ")
    per_row = velocity_drift(v_new, v_before)
    valid = valid.to(per_row.device)
    # torch.where, not a product: a non-finite velocity of an excluded row must not leak into D
    return float(torch.where(valid, per_row, torch.zeros_like(per_row)).sum()), float(valid.sum())


def trust_region_scale(drift: float, bound: float) -> float:
    """alpha in (0, 1]: the factor a step is scaled by so that the velocity change `drift` (D above,
    measured for the whole step) becomes `bound` (delta): sqrt(delta / D) when D > delta, else 1.
    A non-finite D gives 0 (the step is undone)."""
    if not bound > 0:
        raise ValueError(f"trust_region_scale: the bound must be > 0, got {bound}")
    if not math.isfinite(drift):
        return 0.0
    return 1.0 if drift <= bound else math.sqrt(bound / drift)


def scale_step_(params: list[torch.Tensor], before: list[torch.Tensor], alpha: float) -> None:
    """In place, without gradient: each p <- before + alpha (p - before)."""
    if len(params) != len(before):
        raise ValueError(f"scale_step_: {len(params)} parameters but {len(before)} saved copies")
    with torch.no_grad():
        for p, b in zip(params, before):
            p.lerp_(b, 1.0 - alpha)  # p + (1 - alpha) (b - p)
