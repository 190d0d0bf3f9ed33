"""The reward-hacking check (health.hacking_metric): the reward keeps rising while a held-out
metric of what the reward stands for falls. With a learned reward model this is the
over-optimisation of Gao et al. 2023 ("Scaling laws for reward model overoptimization"): the
true score peaks and falls while the proxy keeps climbing."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Fall:
    kind: str  # "reward_hacking": eval/reward rose meanwhile; "heldout_fall": it fell with the metric
    peak: int  # the step of the evaluation where the metric peaked (a rollback returns to it or before)
    message: str


def held_out_fall(evals: list[dict], metric: str, drop: float) -> Fall | None:
    """The last evaluation in `evals` (rows with eval/* keys, in step order) has eval/<metric> more
    than `drop` below its peak over the earlier ones: reward hacking when eval/reward is above the
    peak's (the reward model's over-optimisation), else a held-out fall (the policy got worse:
    DiffusionNFT's late fall on the shapes task, bench/README.md); None when it has not fallen."""
    key = f"eval/{metric}"
    rows = [r for r in evals if _finite(r.get(key)) and _finite(r.get("eval/reward"))]
    if len(rows) < 2:
        return None
    now = rows[-1]
    peak = max(reversed(rows[:-1]), key=lambda r: r[key])  # the latest of equal bests: the checkpoint kept
    if peak[key] - now[key] <= drop:
        return None
    fell = f"{key} fell {peak[key]:.4g} -> {now[key]:.4g}"
    if now["eval/reward"] > peak["eval/reward"]:
        return Fall("reward_hacking", peak["step"], f"eval/reward rose {peak['eval/reward']:.4g} -> "
                    f"{now['eval/reward']:.4g} since step {peak['step']} while {fell}: the policy is exploiting the "
                    f"reward; stop here, keep the checkpoint near step {peak['step']}, or strengthen the reward (or "
                    "the KL)")
    return Fall("heldout_fall", peak["step"], f"{fell} since step {peak['step']} (eval/reward {peak['eval/reward']:.4g}"
                f" -> {now['eval/reward']:.4g}): the policy got worse on held-out prompts; health.rollback_on_alert "
                f"returns to the checkpoint at or before step {peak['step']} with a smaller learning rate")


def at_peak(evals: list[dict], metric: str) -> bool:
    """The last evaluation holds the best eval/<metric> so far (its checkpoint is kept as a rollback target)."""
    key = f"eval/{metric}"
    vals = [r[key] for r in evals if _finite(r.get(key))]
    return bool(vals) and _finite(evals[-1].get(key)) and evals[-1][key] >= max(vals)


class HeldOutWatch:
    """health.hacking_metric on rank 0: the evaluations so far (a resumed run's from its
    metrics.jsonl), the step of the best one (its checkpoint is kept as a rollback target), and a
    fall from it seen at the last evaluation."""

    def __init__(self, metric: str | None, drop: float, evals: list[dict] | None = None):
        self.metric, self.drop, self.evals = metric, drop, list(evals or [])
        self.peak: int | None = None
        self.fall: Fall | None = None

    def see(self, step: int, metrics: dict, alerts) -> None:
        """An evaluation's metrics: alerts for a metric it lacks and for a fall (kept in self.fall)."""
        if f"eval/{self.metric}" not in metrics:  # a misspelt name would otherwise watch nothing
            have = ", ".join(sorted(k.removeprefix("eval/") for k in metrics if not k.startswith("eval/gate")))
            alerts.fire(step, "hacking_metric_missing", f"health.hacking_metric '{self.metric}' is not an eval "
                        f"metric of this run (it has: {have}): nothing is watched")
        self.evals = [r for r in self.evals if r["step"] < step] + [{"step": step, **metrics}]
        self.fall = held_out_fall(self.evals, self.metric, self.drop)
        self.peak = step if at_peak(self.evals, self.metric) else self.peak
        if self.fall:
            alerts.fire(step, self.fall.kind, self.fall.message, peak_step=self.fall.peak)

    def taken(self) -> Fall | None:
        """The fall seen at this step's evaluation, once."""
        fall, self.fall = self.fall, None
        return fall

    def rolled_back(self, step: int) -> None:
        """The weights went back to step `step`: the evaluations after it are undone."""
        self.evals = [r for r in self.evals if r["step"] <= step]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def earlier_evals(run_dir) -> list[dict]:
    """The evaluation rows a resumed run already logged (metrics.jsonl, up to its checkpoint)."""
    import json
    from pathlib import Path

    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line
            if isinstance(row, dict) and "eval/reward" in row:
                rows.append(row)
    return rows
