"""Pure tensor math: advantage estimators, KL estimators, policy losses, loss aggregation.

Nothing here imports anything but torch, so every function can be checked against numbers
derived by hand from its paper. Registries map config names to functions.
"""

from regen.algorithms.advantages import (
    ADVANTAGES,
    advantage_kwargs,
    grpo_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from regen.algorithms.kl import kl_penalty
from regen.algorithms.losses import POLICY_LOSSES, aggregate, dpo_loss, grpo_loss, gspo_loss, ppo_clip_loss

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "advantage_kwargs",
    "aggregate",
    "dpo_loss",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "overlong_penalty",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "kl_penalty",
    "ppo_clip_loss",
]
