"""Scoring split over torchrun ranks: each rank scores its share of the samples (its own
calls to a reward service, its own reward model), and the scores are gathered so every rank
holds all of them in order. A drop-in for CombinedReward."""

from __future__ import annotations

import torch

from regen.rewards.base import CombinedReward, Sample
from regen.runtime.dist import Dist


class ShardedReward:
    def __init__(self, inner: CombinedReward, dist: Dist):
        self.inner, self.dist = inner, dist

    def __call__(self, samples: list[Sample]) -> tuple[list[float], dict[str, list[float]]]:
        # contiguous shares that need not be equal (held-out sets of any size)
        mine = torch.arange(len(samples)).tensor_split(self.dist.world)[self.dist.rank].tolist()
        shares = self.dist.gather_objects(self.inner([samples[i] for i in mine]), side=True)  # scoring runs in a thread
        total = [x for t, _ in shares for x in t]
        parts = {k: [x for _, p in shares for x in p[k]] for k in shares[0][1]}
        return total, parts

    def versions(self) -> dict[str, str]:
        return self.inner.versions()

    def down(self) -> list[str]:
        return self.inner.down()

    def probe(self) -> bool:
        return self.inner.probe()

    def stats(self) -> dict[str, float]:
        """This rank's counters (rank 0's are the ones logged)."""
        return self.inner.stats()
