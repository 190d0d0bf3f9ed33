"""Rule rewards: exact answer and format."""

from __future__ import annotations

import re

from regen.rewards.base import Sample, register


@register("exact_match", version="1", kind="binary")
def exact_match(samples: list[Sample], field: str = "answer", strip: bool = True) -> list[float]:
    """1.0 when the completion equals the prompt row's `field` (e.g. the arithmetic answer), else 0.0.

    A row without that field gets None (missing), not a zero: the data cannot be scored.
    """
    out: list[float | None] = []
    for s in samples:
        ref = s.meta.get(field)
        if ref is None:
            out.append(None)
            continue
        got = s.completion.strip() if strip else s.completion
        want = str(ref).strip() if strip else str(ref)
        out.append(1.0 if got == want else 0.0)
    return out


@register("format", version="1", kind="binary")
def format_reward(samples: list[Sample], pattern: str = r"\d+", require_eos: bool = True) -> list[float]:
    """1.0 when the whole completion matches `pattern` (default: digits only) and, if
    `require_eos`, the model ended it itself instead of running into max_new_tokens."""
    rx = re.compile(pattern)
    return [float(bool(rx.fullmatch(s.completion)) and (s.finished or not require_eos)) for s in samples]


@register("env_reward", version="1")
def env_reward(samples: list[Sample]) -> list[float | None]:
    """The environment's reward of a multi-turn episode (env:): its per-turn rewards plus its
    episode_reward. None (missing) for a sample that is not an episode."""
    return [s.meta["episode"]["reward"] if isinstance(s.meta.get("episode"), dict) else None for s in samples]


@register("brightness", version="1")
def brightness(samples: list[Sample], target: float | None = None) -> list[float | None]:
    """Mean pixel value of an image or video in [0, 1]; with `target`, 1 - |mean - target|.

    A sample without media gets None (missing)."""
    import numpy as np

    out: list[float | None] = []
    for s in samples:
        if s.media is None:
            out.append(None)
            continue
        mean = float(np.asarray(s.media, dtype=np.float64).mean() / 255.0)
        out.append(mean if target is None else 1.0 - abs(mean - target))
    return out
