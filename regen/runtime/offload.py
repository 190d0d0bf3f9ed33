"""Hooks at the loop's phase changes, and the built-in one: parking idle state in CPU memory.

Sampling needs the policy's weights only; the update also needs the optimizer's moments
(twice the trained weights for AdamW) and, depending on the method, a frozen reference or
old policy. When sampling and training share one GPU (the colocated placement), parking what
the coming phase does not use frees that memory for the sampler's activations and KV cache.
With `train.offload: true` the loops move the optimizer state and the idle frozen copies to
the CPU before sampling and back before the update. On a CPU-only run it moves nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PHASES = ("sample", "update")


class PhaseHooks:
    """Callbacks fn(phase) run as the loop enters a phase ("sample", then "update", each step)."""

    def __init__(self):
        self.hooks: dict[str, list[Callable[[str], None]]] = {p: [] for p in PHASES}

    def on(self, phase: str, fn: Callable[[str], None]) -> None:
        if phase not in self.hooks:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.hooks[phase].append(fn)

    def enter(self, phase: str) -> None:
        for fn in self.hooks[phase]:
            fn(phase)


def optimizer_to(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Move the optimizer's per-parameter state (moments) to `device`. AdamW's `step` counters
    stay where they are: the non-capturable implementation wants them on the CPU."""
    for state in opt.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and k != "step" and v.device != device:
                state[k] = v.to(device, non_blocking=True)


def parking(device: torch.device, optimizers: list, idle: list) -> Callable[[str], None]:
    """The built-in hook: before sampling, the optimizers' state and the `idle` modules (frozen
    copies sampling does not read) go to the CPU; before the update they come back to `device`."""

    def hook(phase: str) -> None:
        if device.type == "cpu":
            return  # everything already lives there
        where = torch.device("cpu") if phase == "sample" else device
        for opt in optimizers:
            if opt is not None:
                optimizer_to(opt, where)
        for m in idle:
            if isinstance(m, torch.nn.Module):
                m.to(where)
        if device.type == "cuda" and phase == "sample":
            torch.cuda.empty_cache()  # hand the freed blocks back before the sampler allocates

    return hook


def loop_hooks(offload: bool, device: torch.device, optimizers: list, idle: list) -> PhaseHooks:
    """A run's hooks: the parking hook on both phases when `offload` (train.offload)."""
    hooks = PhaseHooks()
    if offload:
        park = parking(device, optimizers, idle)
        for phase in PHASES:
            hooks.on(phase, park)
    return hooks
