"""Rewards are plain callables: `fn(samples: list[Sample], **args) -> list[float | None]`.

A score of None (or NaN) means *missing*: the sample is left out of the advantage, never
counted as zero. Register a function with `@register("name")`, or point the config at any
importable `package.module:function`.
"""

from regen.rewards import (
    adherence,  # noqa: F401  (the shapes classifier "adherence"; torch loads on first use)
    builtin,  # noqa: F401  (registers the built-in rewards)
    client,  # noqa: F401  (registers "remote")
    clip,  # noqa: F401  (clip_score, pickscore, aesthetic: local CLIP models)
    image,  # noqa: F401  (image/video rewards, "binary" and "pairwise")
    math,  # noqa: F401  (math_equal: verifiable answers, math-verify in a worker process)
    reward_model,  # noqa: F401  (reward_model: a local sequence-classification model)
)
from regen.rewards.base import REGISTRY, CombinedReward, Sample, register, resolve

__all__ = ["REGISTRY", "CombinedReward", "Sample", "register", "resolve"]
