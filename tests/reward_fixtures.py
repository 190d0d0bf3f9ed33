"""Reward functions that misbehave on purpose, served by test reward servers."""

import time

from regen.rewards.builtin import exact_match


def slow_exact(samples):
    time.sleep(0.3)
    return exact_match(samples)


def quick_exact(samples):
    time.sleep(0.02)
    return exact_match(samples)


def crashing(samples):
    raise RuntimeError("scorer exploded")


def bright_or_not(samples, threshold=0.08):
    """1 for an image brighter than `threshold` on average (about the test bases' mean), else 0:
    a binary reward with ties."""
    return [float(s.media.mean() / 255 > threshold) for s in samples]


def unruly(samples):
    """inf, -inf, a string, None, then a proper score, cycling: what a buggy scorer returns."""
    bad = [float("inf"), float("-inf"), "high", None, 0.5]
    return [bad[i % len(bad)] for i in range(len(samples))]


def exact_if_image(samples):
    """Exact match for samples that carry their prompt's image (a vision-language run), None
    (missing) for the others."""
    return [float(s.completion.strip() == s.meta["answer"]) if s.media is not None and s.media.ndim == 3 else None
            for s in samples]


def hang_on_text(samples):
    """Hangs (for an hour) when a sample's text is 'hang', like a scorer stuck on one input; else 1.0."""
    import time

    if any(s.completion == "hang" for s in samples):
        time.sleep(3600)
    return [1.0 for _ in samples]


def answer_words(samples):
    """The fraction of a completion's words that are shapes-vqa answer words: a reward that varies
    between the samples of an untrained model (so an RL step has advantages to follow)."""
    from regen.tasks.shapes_vqa import ANSWERS

    known = {a for v in ANSWERS.values() for a in v}
    return [sum(w in known for w in s.completion.split()) / max(len(s.completion.split()), 1) for s in samples]
