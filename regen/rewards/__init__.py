"""Rewards are plain callables: `fn(samples: list[Sample], **args) -> list[float | None]`.

A score of None (or NaN) means *missing*: the sample is left out of the advantage, never
counted as zero. Register a function with `@register("name")`, or point the config at any
importable `package.module:function`.
"""

from regen.rewards.base import REGISTRY, CombinedReward, Sample, register, resolve
from regen.rewards import builtin  # noqa: F401  (registers the built-in rewards)
from regen.rewards import client  # noqa: F401  (registers "remote")

__all__ = ["REGISTRY", "CombinedReward", "Sample", "register", "resolve"]
