"""Where a step's samples come from: `run.rollout.next(gen)` takes the step's prompts and
returns them with their sampled completions; `run.rollout.sync(policy, step)` hands the new
weights to whatever samples. The loop calls the same two methods in every placement:

- one process: the trained policy samples; sync has nothing to move;
- torchrun (regen/runtime/dist.py): every rank takes the same prompts, samples its share of
  the groups, and the shares are gathered so every rank holds the whole batch;
- Ray (regen/ray_rollout.py): rollout actors sample, weights are pushed to them after updates.

The randomness is drawn here, one uniform per (row, token), from the run's generator, and each
sampler gets the slice for its rows: a row's completion does not depend on which process
sampled it, so one process and N processes sample the same batch.
"""

from __future__ import annotations

import torch

from regen.data import EpochSampler, PromptItem
from regen.policies.lm import LMRollout, concat_rollouts
from regen.runtime.dist import Dist


def draw_uniforms(cfg, gen: torch.Generator) -> torch.Tensor:
    """(B, max_new_tokens) uniforms of one step's sampling, on the generator's device."""
    return torch.rand(cfg.rollout.global_batch_size, cfg.rollout.max_new_tokens, generator=gen, device=gen.device)


def group_rows(groups: torch.Tensor, n: int) -> torch.Tensor:
    """The batch rows of the given groups (a group is n consecutive rows)."""
    return (groups[:, None] * n + torch.arange(n)).flatten()


class LocalRollouts:
    """Sampling in this process (and, under torchrun, in each rank for its groups)."""

    def __init__(self, engine, data: EpochSampler, prompts: list[PromptItem], cfg, dist: Dist):
        """engine: the LMPolicy, or a vLLM engine (regen/vllm_engine.py) with the same sample()."""
        self.engine, self.data, self.prompts, self.cfg, self.dist = engine, data, prompts, cfg, dist

    def next(self, gen: torch.Generator) -> tuple[list[PromptItem], LMRollout]:
        r, n = self.cfg.rollout, self.cfg.rollout.group_size
        items = [self.prompts[i] for i in self.data.take(self.cfg.prompts_per_step)]
        u = draw_uniforms(self.cfg, gen)
        groups = self.dist.my_rows(torch.arange(len(items)))
        part = self.engine.sample([items[g].prompt for g in groups.tolist()], n, r.temperature, r.top_p,
                                  r.max_new_tokens, None, uniforms=u[group_rows(groups, n).to(u.device)])
        if not self.dist.on:
            return items, part
        parts = self.dist.gather_objects(part.to("cpu"))
        return items, concat_rollouts(parts, self.engine.pad_id).to(part.input_ids.device)

    def sync(self, policy, step: int) -> dict[str, float]:
        """Nothing to move: the sampler is the trained model (a vLLM engine gets the weights)."""
        push = getattr(self.engine, "load_weights", None)
        return {} if push is None else push(policy, step)

    def old_logprobs(self, batch: LMRollout, recomputed: torch.Tensor | None) -> torch.Tensor | None:
        """PPO's old log-probs: the trainer's own (this process sampled with its current weights)."""
        return recomputed

    def stats(self) -> dict[str, float]:
        return {}

    def discard_prefetch(self) -> None:
        """Nothing is sampled ahead here (see RayRollouts)."""

    def close(self) -> None:
        pass
