"""Optimizer and learning-rate schedule (set per step, so resuming needs only the step)."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, optim, total_steps: int) -> float:
    """Linear warm-up to optim.lr over optim.warmup_steps, then constant or cosine decay to 0."""
    if optim.warmup_steps and step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    if optim.schedule == "cosine":
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        return optim.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return optim.lr


def make_optimizer(model, optim) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    try:  # one fused kernel for all parameters: several times faster than the per-tensor loop
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError):  # a device or dtype without a fused kernel
        return torch.optim.AdamW(params, **kw)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
