"""A Ray trainer group (`trainer_workers: N > 1`) whose samples come from rollout actors
(`distributed.group_sampling: actors`): verl's layout, N trainers sharding or replicating the
model and M rollout engines (vLLM, or HF generate on CPUs) with GPUs of their own.

Rank 0 drives the rollout actors exactly as a single trainer does (regen/placement/ray.py:
shares of the step's groups, each with its rows of the step's plan; dead actors replaced). Every
other rank draws the same prompts and the same plan from its own data sampler and generator, so
all ranks stay in step with rank 0 (and with a torchrun run of the same seed) without being sent
them, and receives the sampled batch from rank 0. After each update every rank joins the weight
gather (FSDP2: a collective; DDP: rank 0 already holds them) and rank 0 pushes them to the
actors. Rewards are scored on the ranks, each its share, as in a group that samples itself.
max_staleness is 0 here (not read): a batch is always sampled with the current weights.
"""

from __future__ import annotations

import os

import torch

from regen.data import EpochSampler, PromptItem
from regen.runtime.dist import Dist


class GroupRollouts:
    """The loop's rollout source on every rank of a trainer group with rollout actors."""

    def __init__(self, modality, data: EpochSampler, prompts: list[PromptItem], cfg, dist: Dist, version: int):
        from regen.placement.ray_trainers import GENERATION_ENV

        self.m, self.data, self.prompts, self.cfg, self.dist = modality, data, prompts, cfg, dist
        state = self._state()  # every rank: under FSDP2 the gather is a collective
        self.pool = None
        if dist.main:
            from regen.placement.ray import RayRollouts

            # a restarted group's actors are new ones: the old rank 0's die with it (Ray's
            # ownership), but their names may outlive it for a moment
            name = f"regen-rollout-t{os.environ.get(GENERATION_ENV, '0')}"
            self.pool = RayRollouts(modality, data, prompts, cfg, version, state=state, name=name)
        dist.barrier()  # the actors hold the weights before any rank asks for a batch

    def _state(self) -> dict[str, torch.Tensor] | None:
        """The whole trained weights, on rank 0 (None elsewhere); every rank must call it."""
        if self.dist.sharded:
            full = self.dist.full_model_state(self.m.trained)
            return full if self.dist.main else None
        return self.m.sync_state() if self.dist.main else None

    def next(self, step: int, gen: torch.Generator, again: bool = False):
        if self.pool is not None:
            items, batch = self.pool.next(step, gen, again)
            batch = batch.to("cpu")
        else:  # the draws rank 0's pool makes (RayRollouts._submit), so every rank's sampler and generator agree
            items = [self.prompts[i] for i in self.data.take(self.cfg.prompts_per_step)]
            self.m.plan(gen, step, again)
            batch = None
        return items, self.m.concat([self.dist.broadcast_object(batch)])

    def sync(self, step: int) -> dict[str, float]:
        state = self._state()
        metrics = self.pool.sync(step, state) if self.pool is not None else None
        return self.dist.broadcast_object(metrics)  # the same metrics on every rank (they are summed and logged)

    def stale(self, batch) -> bool:
        return False  # max_staleness 0: RayRollouts samples a late batch again with the current weights

    def stats(self) -> dict[str, float]:
        return self.dist.broadcast_object(self.pool.stats() if self.pool is not None else None)

    def discard_prefetch(self) -> None:
        """Nothing is sampled ahead (max_staleness 0)."""

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
