"""Where the work runs, for every modality: one process, torchrun ranks, or Ray actors.

  local.py        LocalRollouts: the trained model samples in this process (each torchrun rank
                  its share of the groups, gathered)
  ray.py          RayRollouts / RayReward: rollout and reward actors, weight sync with versions,
                  one-step-ahead sampling (max_staleness), dead actors replaced
  ray_workers.py  the actor classes
  ray_group.py    a trainer group whose rank 0 drives rollout actors (group_sampling: actors)
  checks.py       the combinations refused before anything is written
Data parallelism itself (DDP / FSDP2 around the trained model, collectives) is regen/runtime/dist.py;
a group of Ray trainer actors (distributed.trainer_workers > 1) is regen/train/ray_trainers.py; the
vLLM engine (rollout.engine=vllm) is regen/policies/lm_vllm.py.
"""

from __future__ import annotations

from contextlib import contextmanager


def place(cfg, d, modality, reward, data, prompts, start_step: int):
    """(reward, rollout source) of the run: in this process, split over torchrun ranks, or on Ray actors."""
    if cfg.distributed.mode == "ray" and not d.on:  # a trainer group (d.on) samples on its ranks, like torchrun
        from regen.placement.ray import RayReward, RayRollouts

        return RayReward(cfg), RayRollouts(modality, data, prompts, cfg, start_step)
    from regen.placement.local import LocalRollouts
    from regen.rewards.sharded import ShardedReward

    if cfg.distributed.mode == "ray" and cfg.distributed.group_sampling == "actors":  # ... or rank 0's actors do
        from regen.placement.ray_group import GroupRollouts

        return ShardedReward(reward, d), GroupRollouts(modality, data, prompts, cfg, d, start_step)

    return (ShardedReward(reward, d) if d.on else reward), LocalRollouts(modality, data, prompts, cfg, d)


@contextmanager
def released_on_error(rollout, reward):
    """A run that fails in its loop stops its workers before the error goes on: Ray actors are
    named, and ones left behind would keep the next run in this process (a notebook, the tests)
    from starting its own. Local placements have nothing to stop."""
    try:
        yield
    except BaseException:
        for release in (rollout.close, getattr(reward, "close", None)):
            try:
                if release is not None:
                    release()
            except Exception:  # the original error is the one to report
                pass
        raise
