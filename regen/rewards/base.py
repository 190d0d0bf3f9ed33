"""Reward protocol, name registry and weighted combination."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from regen.errors import ConfigError


@dataclass
class Sample:
    """What a reward sees of one completion."""

    prompt: str
    completion: str
    meta: dict[str, Any] = field(default_factory=dict)  # the prompt row's extra fields, e.g. 'answer'
    finished: bool = True  # ended with EOS (False: cut at max_new_tokens)
    media: Any = None  # uint8 numpy array: image (H, W, C) or video (F, H, W, C); None for text


RewardFn = Callable[..., Sequence[float | None]]
REGISTRY: dict[str, RewardFn] = {}


def register(name: str, version: str = "1", kind: str = "scalar", factory: bool = False):
    """Register a reward under `name`.

    version: reported by the reward service and stored in checkpoints; bump it when the
        scoring changes so a resumed run can warn that its rewards are not comparable.
    kind: "scalar" (any float), "binary" (1.0 good / 0.0 bad; the service also returns it
        as an integer label) or "pairwise" (a judge called with two lists of samples, returning
        1.0 / 0.0 / 0.5 per pair: used through the `pairwise` reward).
    factory: the object is called once with the config's `args` and returns the scoring
        callable (for rewards with state, e.g. a client holding connections and a cache).
    """

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"reward '{name}' registered twice")
        fn.reward_version, fn.reward_kind, fn.reward_factory = version, kind, factory
        REGISTRY[name] = fn
        return fn

    return deco


def version_of(fn) -> str:
    return str(getattr(fn, "reward_version", None) or getattr(fn, "version", None) or "unversioned")


# Folders the user's own modules are imported from, besides sys.path as Python set it up: the
# current directory and the config file's folder (regen/cli/main.py); Ray actors get them too.
USER_PATHS: list[str] = []


def add_user_path(folder) -> None:
    path = str(folder)
    if path not in USER_PATHS:
        USER_PATHS.append(path)
    if path not in sys.path:
        sys.path.insert(0, path)


def describe_reward(name: str, fn) -> tuple[str, str, str]:
    """(name, what it computes: the first paragraph of its doc, arguments with their defaults)
    for `regen rewards`."""
    import inspect

    doc = inspect.getdoc(fn) or ""
    summary = " ".join(doc.split("\n\n")[0].split())
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        params = []
    skip = {"self", "samples"}
    args = [p.name + ("" if p.default is inspect.Parameter.empty else f"={p.default!r}")
            for p in params if p.name not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return name, summary, ", ".join(args)


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
    def from_config(cls, reward_cfg, where: str = "reward") -> CombinedReward:
        """The terms of a config's reward list; `where` names that list in errors."""
        terms = []
        for i, t in enumerate(reward_cfg):
            fn, args = resolve(t.name, where=f"{where}.{i}.name"), dict(t.args)
            if getattr(fn, "reward_kind", "scalar") == "pairwise":
                raise ConfigError(f"{where}.{i}.name: '{t.name}' is a pairwise judge (it compares two samples); use "
                                  f"it as {{name: pairwise, args: {{of: {t.name}}}}}")
            if getattr(fn, "reward_factory", False):
                try:
                    fn, args = fn(**args), {}
                except TypeError as e:
                    raise ConfigError(f"{where}.{i}.args: {e}") from None
            terms.append((t.name, fn, t.weight, args))
        return cls(terms)

    def versions(self) -> dict[str, str]:
        """Each term's scorer version (for a remote scorer: what the service last reported)."""
        return {name: version_of(fn) for name, fn, _, _ in self.terms}

    def down(self) -> list[str]:
        """The terms whose service is down (a remote client's circuit breaker is open)."""
        return [name for name, fn, _, _ in self.terms if getattr(fn, "is_down", lambda: False)()]

    def probe(self) -> bool:
        """Probe the terms that are down; True when every one answers again."""
        return all(fn.probe() for _, fn, _, _ in self.terms if getattr(fn, "is_down", lambda: False)())

    def stats(self) -> dict[str, float]:
        """Counters of stateful terms (e.g. a remote client's retries), as metrics."""
        out = {}
        for name, fn, _, _ in self.terms:
            for k, v in (fn.stats() if hasattr(fn, "stats") else {}).items():
                out[f"reward/{name}/{k}"] = float(v)
        return out

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
