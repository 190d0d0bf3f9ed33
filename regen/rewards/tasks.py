"""The reward of a run, built once from its config wherever scoring happens (this process,
torchrun ranks, Ray reward actors): the combined reward terms, or, in a multi-task run, each
task's own terms routed by the sample's meta['task'] (set by regen/data/tasks.py)."""

from __future__ import annotations

import math

from regen.rewards.base import CombinedReward, Sample


def build_reward(cfg):
    """CombinedReward of cfg.reward, or TaskReward of cfg.tasks' streams."""
    if not cfg.tasks:
        return CombinedReward.from_config(cfg.reward)
    return TaskReward({name: CombinedReward.from_config(s.reward, where=f"tasks.{name}.reward")
                       for name, s in cfg.tasks.items()})


class TaskReward:
    """A drop-in for CombinedReward that scores each sample with its task's terms. The parts are
    named TASK/TERM (NaN on the other tasks' rows), so a step's metrics hold reward/TASK/TERM."""

    def __init__(self, by_task: dict[str, CombinedReward]):
        self.by_task = by_task

    def __call__(self, samples: list[Sample]) -> tuple[list[float], dict[str, list[float]]]:
        rows: dict[str, list[int]] = {name: [] for name in self.by_task}
        for i, s in enumerate(samples):
            name = s.meta.get("task")
            if name not in rows:
                raise RuntimeError(f"sample {i} has meta['task']={name!r}, not one of this run's tasks "
                                   f"({', '.join(rows)})")
            rows[name].append(i)
        total = [math.nan] * len(samples)
        parts: dict[str, list[float]] = {}
        for name, idx in rows.items():
            if not idx:
                continue
            t, p = self.by_task[name]([samples[i] for i in idx])
            for i, x in zip(idx, t):
                total[i] = x
            for term, xs in p.items():
                col = parts.setdefault(f"{name}/{term}", [math.nan] * len(samples))
                for i, x in zip(idx, xs):
                    col[i] = x
        return total, parts

    def versions(self) -> dict[str, str]:
        return {f"{name}/{k}": v for name, r in self.by_task.items() for k, v in r.versions().items()}

    def down(self) -> list[str]:
        return [f"{name}/{k}" for name, r in self.by_task.items() for k in r.down()]

    def probe(self) -> bool:
        return all([r.probe() for r in self.by_task.values()])  # every task's terms probed, not the first down

    def stats(self) -> dict[str, float]:
        return {k.replace("reward/", f"reward/{name}/", 1): v
                for name, r in self.by_task.items() for k, v in r.stats().items()}
