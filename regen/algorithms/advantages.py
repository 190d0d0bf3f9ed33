"""Advantage estimators over a flat batch laid out as consecutive groups of `group_size`.

Each estimator of `algorithm.advantage` registers itself with the algorithm.* settings it takes
(`advantage(name, parameter=setting)`): the loop passes exactly those, by name, and a keyword an
estimator does not take is a TypeError rather than a setting silently ignored."""

from __future__ import annotations

from collections.abc import Callable

import torch

ADVANTAGES: dict[str, Callable] = {}  # algorithm.advantage -> estimator (with .settings: parameter -> algorithm key)


def advantage(name: str, **settings: str):
    """Register an estimator as algorithm.advantage=name; settings: its parameter -> the algorithm.* key it reads."""

    def register(fn: Callable) -> Callable:
        fn.settings = settings
        ADVANTAGES[name] = fn
        return fn

    return register


def advantage_kwargs(fn: Callable, algorithm) -> dict:
    """The keyword arguments estimator `fn` takes from the algorithm config section."""
    return {param: getattr(algorithm, key) for param, key in fn.settings.items()}


@advantage("grpo", std_normalize="std_normalize")
def grpo_advantages(
    rewards: torch.Tensor, group_size: int, std_normalize: bool | str = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantage (GRPO, Shao et al. 2024, §4.1.2).

        A_i = (R_i - mean_g R) / (std_g R + eps)     (std_normalize="group" or True)
        A_i = (R_i - mean_g R) / (std_B R + eps)     (std_normalize="batch": the std of all kept
                                                      rewards of the batch, Flow-GRPO's global std)
        A_i =  R_i - mean_g R                        (std_normalize="none" or False, as in Dr.GRPO)

    rewards: (B,) with B = G * group_size, samples of a group consecutive. NaN marks a
    *missing* reward (the scorer failed): it is excluded from its group's mean and std and
    gets no advantage, never a zero reward. A group with fewer than two valid rewards has no
    baseline and is dropped whole. std is the unbiased (Bessel-corrected) sample std, as in
    verl and TRL.

    Returns (adv (B,), valid (B,) bool, metrics) where metrics holds `zero_std_frac` (the
    fraction of kept groups whose rewards are all equal: they carry no learning signal),
    `dropped_group_frac` and `missing_frac`.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).to(torch.float64)
    present = torch.isfinite(r)
    count = present.sum(1, keepdim=True)
    keep_group = count >= 2
    valid = present & keep_group
    r0 = torch.where(present, r, torch.zeros_like(r))
    mean = r0.sum(1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(present, r - mean, torch.zeros_like(r))
    var = centred.pow(2).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    std = var.sqrt()
    mode = {True: "group", False: "none"}.get(std_normalize, std_normalize) if isinstance(std_normalize, bool) \
        else std_normalize
    if mode == "group":
        adv = centred / (std + eps)
    elif mode == "batch":
        kept = r[present & keep_group]
        adv = centred / ((kept.std() if kept.numel() >= 2 else torch.zeros((), dtype=r.dtype)) + eps)
    elif mode == "none":
        adv = centred
    else:
        raise ValueError(f"std_normalize must be group, batch or none, got {std_normalize!r}")
    # "all rewards equal" by max == min, not std == 0: a float mean of equal values can be
    # off by an ulp and leave a std of 1e-17 (and an advantage of 1e-11 instead of 0)
    hi = torch.where(present, r, torch.full_like(r, -torch.inf)).amax(1)
    lo = torch.where(present, r, torch.full_like(r, torch.inf)).amin(1)
    flat = (hi == lo).unsqueeze(1)
    adv = torch.where(valid & ~flat, adv, torch.zeros_like(adv))
    kept = keep_group.squeeze(1)
    metrics = {
        "zero_std_frac": (flat.squeeze(1) & kept).sum() / kept.sum().clamp(min=1),
        "dropped_group_frac": 1.0 - kept.to(torch.float64).mean(),
        "missing_frac": 1.0 - present.to(torch.float64).mean(),
    }
    return adv.view(-1).to(rewards.dtype), valid.view(-1), {k: v.float() for k, v in metrics.items()}


@advantage("rloo")
def rloo_advantages(
    rewards: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE leave-one-out (RLOO, Ahmadian et al. 2024, eq. 4 / Kool et al. 2019):

        A_i = R_i - (sum_{j != i} R_j) / (G - 1)

    over the G valid (non-NaN) rewards of the group; missing rewards and groups with fewer
    than two valid rewards are handled as in `grpo_advantages`. Equivalently
    A_i = G / (G - 1) * (R_i - mean_g R).
    """
    centred, valid, metrics = grpo_advantages(rewards, group_size, std_normalize=False)
    count = valid.view(-1, group_size).sum(1, keepdim=True).clamp(min=2).to(centred.dtype)
    adv = (centred.view(-1, group_size) * count / (count - 1)).view(-1)
    return adv, valid, metrics


@advantage("reinforce_pp", baseline="reinforce_baseline")
def reinforce_pp_advantages(
    rewards: torch.Tensor, group_size: int, baseline: bool = False, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE++ with outcome rewards (Hu 2025): advantages whitened over the whole batch,

        A_i = (R_i - mean_batch R) / (std_batch R + eps)                 (baseline=False)
        A_i = (R'_i - mean_batch R') / (std_batch R' + eps),  R'_i = R_i - mean_g R   (baseline=True)

    mean/std over all valid samples of the batch (unbiased std). The paper also shapes
    token rewards with a k1 KL penalty; here the KL is the loss term (algorithm.kl_coef),
    a deliberate simplification. Missing rewards get no advantage; with baseline=True groups
    with fewer than two valid rewards are dropped, as in GRPO.
    """
    if baseline:
        base, valid, metrics = grpo_advantages(rewards, group_size, std_normalize=False)
    else:
        present = torch.isfinite(rewards)
        base = torch.where(present, rewards, torch.zeros_like(rewards))
        _, _, metrics = grpo_advantages(rewards, group_size, std_normalize=False)
        valid = present
    n = valid.sum()
    if n < 2:
        return torch.zeros_like(base), valid & False, metrics
    v = base[valid].to(torch.float64)
    adv = (base.to(torch.float64) - v.mean()) / (v.std() + eps)
    adv = torch.where(valid, adv, torch.zeros_like(adv)).to(rewards.dtype)
    return adv, valid, metrics


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward:

        0                                      if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache * f   if L_max - L_cache < |y| <= L_max
        -f                                     if |y| > L_max

    lengths: (B,) response lengths in tokens. Returns (B,) penalties (<= 0).
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong: need 0 < cache_len ({cache_len}) <= max_len ({max_len})")
    lengths = lengths.to(torch.float32)
    soft = (max_len - cache_len - lengths) / cache_len * factor
    out = torch.where(lengths <= max_len - cache_len, torch.zeros_like(lengths), soft)
    return torch.where(lengths > max_len, torch.full_like(lengths, -factor), out)

