"""Mixed precision for the RL loops (`train.precision`).

bf16 / fp16 run the networks' forward passes under `torch.autocast`: matrix products and
convolutions in half precision, everything else as it was. Weights, gradients and optimizer
state stay fp32 ("master weights", Micikevicius et al. 2018, Mixed Precision Training), and
the quantities the losses compare are computed in fp32: language-model log-probs from logits
cast to fp32 (policies/lm.py), the flow samplers' Gaussian log-probs from fp32 states. Sampling,
re-scoring and the update all run under the same autocast, so an on-policy ratio is still
exactly 1. fp16's narrow range needs loss scaling: a GradScaler multiplies the loss before
backward, unscales the gradients before clipping, and skips the step (lowering the scale) when
they overflow.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, mode: str, device: torch.device):
        if mode not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {mode!r}")
        self.mode, self.device, self.dtype = mode, device, DTYPES[mode]
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None

    def autocast(self):
        """Context for forward passes: autocast to the half type, or nothing in fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, opt: torch.optim.Optimizer, params: list, grad_clip: float) -> tuple[torch.Tensor, bool]:
        """Clip the (unscaled) gradients to grad_clip (0 = no clipping) and step; returns the
        gradient norm and whether the step was taken (not when the norm is not finite)."""
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a DTensor
            norm = norm.full_tensor()
        ok = bool(torch.isfinite(norm))
        if self.scaler is not None:
            if ok:
                self.scaler.step(opt)
            self.scaler.update()  # an overflow lowers the scale for the next step
        elif ok:
            opt.step()
        return norm, ok

