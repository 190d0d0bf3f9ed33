"""Reward protocol, name registry and weighted combination."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from regen.errors import ConfigError


@dataclass
class Sample:
    """What a reward sees of one completion."""

    prompt: str
    completion: str
    meta: dict[str, Any] = field(default_factory=dict)  # the prompt row's extra fields, e.g. 'answer'
    finished: bool = True  # ended with EOS (False: cut at max_new_tokens)


RewardFn = Callable[..., Sequence[float | None]]
REGISTRY: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REGISTRY:
            raise ValueError(f"reward '{name}' registered twice")
        REGISTRY[name] = fn
        return fn

    return deco


def resolve(name: str, where: str = "reward") -> RewardFn:
    """A registered name, or 'package.module:function' imported on demand."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        import difflib

        close = difflib.get_close_matches(name, list(REGISTRY), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{where}: unknown reward '{name}'{hint}; known: {', '.join(sorted(REGISTRY))}, "
                          "or give 'package.module:function'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import module '{module_name}' for reward '{name}': {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{where}: '{module_name}' has no callable '{attr}'")
    return fn


class CombinedReward:
    """Weighted sum of reward terms; returns the total and each part (B,), NaN where missing.

    If any term is missing for a sample, the total for that sample is missing too: a total
    built from the parts that happened to succeed would silently change the objective.
    """

    def __init__(self, terms: list[tuple[str, RewardFn, float, dict]]):
        self.terms = terms

    @classmethod
    def from_config(cls, reward_cfg) -> "CombinedReward":
        terms = []
        for i, t in enumerate(reward_cfg):
            terms.append((t.name, resolve(t.name, where=f"reward.{i}.name"), t.weight, dict(t.args)))
        return cls(terms)

    def __call__(self, samples: list[Sample]) -> tuple[list[float], dict[str, list[float]]]:
        parts: dict[str, list[float]] = {}
        total = [0.0] * len(samples)
        for name, fn, weight, args in self.terms:
            scores = list(fn(samples, **args))
            if len(scores) != len(samples):
                raise RuntimeError(f"reward '{name}' returned {len(scores)} scores for {len(samples)} samples")
            clean = [_as_float(s, name) for s in scores]
            parts[name] = clean
            total = [t + weight * s for t, s in zip(total, clean)]  # NaN propagates: missing stays missing
        return total, parts


def _as_float(score: Any, name: str) -> float:
    if score is None:
        return math.nan
    try:
        return float(score)
    except (TypeError, ValueError):
        raise RuntimeError(f"reward '{name}' returned a non-numeric score {score!r}") from None
