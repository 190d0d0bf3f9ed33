"""DAPO's dynamic sampling (Yu et al. 2025, eq. 11 and Alg. 1), for every modality: keep only
the groups whose rewards differ (the others have zero advantage: no signal) and sample more
prompts until the step holds as many such groups as a step has prompts, at most
`algorithm.max_sampling_rounds` extra rounds."""

from __future__ import annotations

import torch


def signal_groups(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """(G,) bool: groups with at least two rewards (non-missing) that are not all equal."""
    grouped = rewards.view(-1, n)
    finite = torch.isfinite(grouped)
    hi = torch.where(finite, grouped, torch.full_like(grouped, -torch.inf)).amax(1)
    lo = torch.where(finite, grouped, torch.full_like(grouped, torch.inf)).amin(1)
    return (finite.sum(1) >= 2) & (hi > lo)


def refill_groups(run, step: int, items: list, batch, scored, score) -> tuple[list, object, tuple, dict]:
    """The step's batch with its groups without signal replaced; returns the prompts of the
    groups kept, the filled batch, its (rewards, parts), and metrics. score(run, items, batch)
    scores a new round. Extra rounds are sampled as more rounds of the same step (flow models:
    the same SDE steps)."""
    cfg = run.cfg
    n, G = cfg.rollout.group_size, cfg.prompts_per_step
    kept: list[tuple] = []
    have = dropped = rounds = 0
    while True:
        rewards, parts = scored
        ok = signal_groups(rewards, n)
        take = ok.nonzero().flatten()[: G - have]
        rows = (take[:, None] * n + torch.arange(n)).flatten()
        if len(rows):
            kept.append((batch.select(rows), rewards[rows], {k: [v[i] for i in rows.tolist()] for k, v in parts.items()},
                         [items[g] for g in take.tolist()]))
        have, dropped = have + len(take), dropped + int((~ok).sum())
        if have >= G or rounds >= cfg.algorithm.max_sampling_rounds:
            break
        rounds += 1
        with run.precision.autocast():
            items, batch = run.rollout.next(step, run.gen, again=True)
        scored = score(run, items, batch)
    metrics = {"dynamic/extra_rounds": float(rounds), "dynamic/dropped_groups": float(dropped),
               "dynamic/filled_frac": have / G}
    if not kept:  # nothing with signal even after the extra rounds: train on the last batch (zero advantages)
        return items, batch, scored, metrics
    filled = run.m.concat([k[0] for k in kept])
    all_parts = {k: [x for part in kept for x in part[2][k]] for k in kept[0][2]}
    return [it for k in kept for it in k[3]], filled, (torch.cat([k[1] for k in kept]), all_parts), metrics
