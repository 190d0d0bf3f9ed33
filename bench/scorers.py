"""Scorers of known cost for bench/reward_service.py (served by module path)."""

import time

from regen.rewards.builtin import exact_match


def _busy(seconds: float) -> None:
    # CPU-bound like a real scorer and counted in this thread's CPU time, so threads that
    # share the GIL cannot overlap their "work" (a wall-clock wait would)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def exact_100us(samples):
    """exact_match plus 100 us of CPU work per sample."""
    _busy(1e-4 * len(samples))
    return exact_match(samples)


def exact_1ms(samples):
    """exact_match plus 1 ms of CPU work per sample."""
    _busy(1e-3 * len(samples))
    return exact_match(samples)
