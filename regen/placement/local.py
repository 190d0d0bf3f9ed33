"""Where a step's samples come from, the same calls in every placement:
`rollout.next(step, gen)` takes the step's prompts and returns them with their samples,
`rollout.sync(step)` hands the new weights to whatever samples, `rollout.stale(batch)` says
whether a batch was sampled with older weights than the trainer's. Two placements:

- LocalRollouts (here): the trained policy samples in this process; under torchrun
  (regen/runtime/dist.py) every rank takes the same prompts, samples its share of the groups,
  and the shares are gathered so every rank holds the whole batch;
- RayRollouts (regen/placement/ray.py): rollout actors sample, weights are pushed to them.

The randomness of a step is drawn here, from the run's generator, for the whole batch
(the modality's `plan`: one uniform per (row, token) for language models, the noise of every
SDE step for flow models), and each sampler gets its rows' slice: a row's sample does not
depend on which process sampled it, so one process and N processes sample the same batch.
"""

from __future__ import annotations

import torch

from regen.data import EpochSampler, PromptItem
from regen.runtime.dist import Dist


def group_rows(groups: torch.Tensor, n: int) -> torch.Tensor:
    """The batch rows of the given groups (a group is n consecutive rows)."""
    return (groups[:, None] * n + torch.arange(n)).flatten()


class LocalRollouts:
    """Sampling in this process (and, under torchrun, in each rank for its groups)."""

    def __init__(self, modality, data: EpochSampler, prompts: list[PromptItem], cfg, dist: Dist):
        self.m, self.data, self.prompts, self.cfg, self.dist = modality, data, prompts, cfg, dist

    def next(self, step: int, gen: torch.Generator, again: bool = False):
        """(the step's prompts, their samples); again: another round of the same step (dynamic sampling)."""
        n = self.cfg.rollout.group_size
        items = [self.prompts[i] for i in self.data.take(self.cfg.prompts_per_step)]
        plan = self.m.plan(gen, step, again)
        groups = self.dist.my_rows(torch.arange(len(items)))
        part = self.m.sample(self.m.inputs([items[g] for g in groups.tolist()]), n, plan.select(group_rows(groups, n)))
        if not self.dist.on:
            return items, part
        return items, self.m.concat(self.dist.gather_objects(part.to("cpu")))

    def sync(self, step: int) -> dict[str, float]:
        """Nothing to move: the sampler is the trained model (a vLLM engine gets the weights)."""
        return self.m.sync_local(step)

    def stale(self, batch) -> bool:
        return False  # sampled by the trained model itself, just now

    def stats(self) -> dict[str, float]:
        return {}

    def discard_prefetch(self) -> None:
        """Nothing is sampled ahead here (see RayRollouts)."""

    def close(self) -> None:
        pass
