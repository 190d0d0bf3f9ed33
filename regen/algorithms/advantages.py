"""Advantage estimators over a flat batch laid out as consecutive groups of `group_size`."""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantage (GRPO, Shao et al. 2024, §4.1.2).

        A_i = (R_i - mean_g R) / (std_g R + eps)     (std_normalize=True)
        A_i =  R_i - mean_g R                        (std_normalize=False, as in Dr.GRPO)

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
    adv = centred / (std + eps) if std_normalize else centred
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


ADVANTAGES = {"grpo": grpo_advantages}
