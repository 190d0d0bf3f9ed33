"""Hooks at the loop's phase changes, and the built-in ones: parking idle state in CPU memory,
putting the rollout engine to sleep, and measuring each phase's peak memory.

Sampling needs the policy's weights only; the update also needs the optimizer's moments
(twice the trained weights for AdamW) and, depending on the method, a frozen reference or
old policy. When sampling and training share one GPU (the colocated placement), parking what
the coming phase does not use frees that memory for the sampler's activations and KV cache.
With `train.offload: true` the loops move the optimizer state and the idle frozen copies to
the CPU before sampling and back before the update. On a CPU-only run it moves nothing.

`distributed.colocate: true` is the whole colocated plan (verl's
"hybrid engine"): parking as above; a rollout engine with its own memory (vLLM) goes to sleep
for the update (its KV cache dropped, its weights moved to CPU memory) and wakes before the new
weights are loaded into it; and the peak memory of the sampling and the update phases is logged
each step (`memory/sample_peak_mb`, `memory/update_peak_mb`): the CUDA allocator's peak on a
GPU, the process's peak resident set (Linux VmHWM, reset per phase) on a CPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

PHASES = ("sample", "update", "sync")  # sync: the update is done, the samplers take the new weights


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


class PhaseMemory:
    """Peak memory of each phase, as a hook on every phase: entering a phase closes the one before
    (its peak is recorded) and resets the peak counter. `pop()` returns and clears what was
    recorded since the last call, as metrics in MB. Measured phases: sample (from entering
    "sample" to "update") and update (from "update" to "sync")."""

    MEASURED = ("sample", "update")

    def __init__(self, device: torch.device):
        self.device, self.current, self.peaks = device, None, {}
        self.cuda = device.type == "cuda"
        self.proc = Path("/proc/self/clear_refs")
        self.works = self.cuda or _reset_rss_peak(self.proc)  # False: not Linux, no metric

    def hook(self, phase: str) -> None:
        if not self.works:
            return
        if self.current in self.MEASURED:
            self.peaks[f"memory/{self.current}_peak_mb"] = self._peak_mb()
        self.current = phase
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak(self.proc)

    def _peak_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return _rss_peak_kb() / 1024

    def pop(self) -> dict[str, float]:
        out, self.peaks = self.peaks, {}
        return out


def _reset_rss_peak(clear_refs: Path) -> bool:
    """Linux: writing 5 to /proc/self/clear_refs resets VmHWM to the current resident set."""
    try:
        clear_refs.write_text("5")
        return _rss_peak_kb() > 0
    except (OSError, ValueError):
        return False


def _rss_peak_kb() -> int:
    found = re.search(r"VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text())
    if found is None:
        raise ValueError("no VmHWM in /proc/self/status")
    return int(found.group(1))


def loop_hooks(offload: bool, device: torch.device, optimizers: list, idle: list, sampler=None,
               memory: bool = False) -> tuple[PhaseHooks, PhaseMemory | None]:
    """A run's hooks: the parking hook before sampling and before the update when `offload`
    (train.offload or distributed.colocate); `sampler` (the modality, distributed.colocate) is
    put to sleep for the update and woken for the sync; with `memory`, each phase's peak."""
    hooks = PhaseHooks()
    meter = PhaseMemory(device) if memory else None
    if meter is not None:  # first, so the parking and the sleep count in the phase they serve
        for phase in PHASES:
            hooks.on(phase, meter.hook)
    if offload:
        park = parking(device, optimizers, idle)
        for phase in ("sample", "update"):
            hooks.on(phase, park)
    if sampler is not None:
        hooks.on("update", lambda _: sampler.sampler_sleep())
        hooks.on("sync", lambda _: sampler.sampler_wake())
    return hooks, meter
