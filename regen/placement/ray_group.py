"""A Ray trainer group (`trainer_workers: N > 1`) whose samples come from rollout actors
(`distributed.group_sampling: actors`): verl's layout, N trainers sharding or replicating the
model and M rollout engines (vLLM, or HF generate on CPUs) with GPUs of their own.

Rank 0 drives the rollout actors exactly as a single trainer does (regen/placement/ray.py:
shares of the step's groups, each with its rows of the step's plan; dead actors replaced). Every
other rank draws the same prompts and the same plan from its own data sampler and generator, so
all ranks stay in step with rank 0 (and with a torchrun run of the same seed) without being sent
them, and receives the sampled batch from rank 0 (its tensors as one broadcast of raw bytes over
the process group, only its skeleton pickled: Dist.broadcast_batch). After each update every rank joins the weight
gather (FSDP2: a collective; DDP: rank 0 already holds them) and rank 0 pushes them to the
actors. Rewards are scored on the ranks, each its share, as in a group that samples itself.
With max_staleness 1 rank 0 requests the next batch before the update (it overlaps the update),
and every other rank draws that batch's prompts and plan at the same point, so the generators
agree (the update's minibatch order comes from the same generator); a checkpoint rewinds the
draw on every rank, as RayRollouts does.
"""

from __future__ import annotations

import os

import torch

from regen.data import EpochSampler, PromptItem
from regen.placement.ray import draw, rewind
from regen.runtime.dist import Dist


class GroupRollouts:
    """The loop's rollout source on every rank of a trainer group with rollout actors."""

    def __init__(self, modality, data: EpochSampler, prompts: list[PromptItem], cfg, dist: Dist, version: int):
        from regen.runtime.dist import GENERATION_ENV

        self.m, self.data, self.prompts, self.cfg, self.dist = modality, data, prompts, cfg, dist
        self.bound = cfg.distributed.max_staleness
        self._ahead = None  # ranks > 0: (step, items, data and generator state before them), as rank 0's pool
        self._stale = False
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
            sent = (batch.to("cpu"), self.pool.stale(batch))
        else:  # the draws rank 0's pool makes (RayRollouts.next), in its order, so every generator agrees
            ahead, self._ahead = self._ahead, None
            if ahead is not None and (again or ahead[0] != step):
                self._rewind(ahead)
                ahead = None
            items = ahead[1] if ahead is not None else self._draw(step, gen, again)[1]
            if self.bound >= 1 and step < self.cfg.train.steps:
                self._ahead = self._draw(step + 1, gen)
            sent = None
        batch, self._stale = self.dist.broadcast_batch(sent)  # tensors over the group, not pickled
        return items, self.m.concat([batch])

    def _draw(self, step: int, gen: torch.Generator, again: bool = False):
        items, _, before = draw(self.m, self.data, self.prompts, self.cfg, step, gen, again)
        return step, items, before

    def _rewind(self, ahead) -> None:
        rewind(self.data, ahead[2])

    def sync(self, step: int) -> dict[str, float]:
        state = self._state()
        metrics = self.pool.sync(step, state) if self.pool is not None else None
        return self.dist.broadcast_object(metrics)  # the same metrics on every rank (they are summed and logged)

    def stale(self, batch) -> bool:
        return self._stale  # rank 0's answer, sent with the batch

    def stats(self) -> dict[str, float]:
        return self.dist.broadcast_object(self.pool.stats() if self.pool is not None else None)

    def discard_prefetch(self) -> None:
        """A checkpoint: forget the batch drawn ahead and rewind its draws, on every rank."""
        if self.pool is not None:
            self.pool.discard_prefetch()
        elif self._ahead is not None:
            self._rewind(self._ahead)
            self._ahead = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
