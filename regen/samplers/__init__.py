"""ODE/SDE steppers for flow-matching models, with per-step Gaussian log-probs (see flow.py)."""

from regen.samplers.flow import (
    StepOut,
    VelocityFn,
    cps_step,
    euler_step,
    gaussian_log_prob,
    heun_step,
    sde_step,
    sde_steps,
    sigma_schedule,
    window_start,
)

__all__ = [
    "StepOut",
    "VelocityFn",
    "cps_step",
    "euler_step",
    "gaussian_log_prob",
    "heun_step",
    "sde_step",
    "sde_steps",
    "sigma_schedule",
    "window_start",
]
