"""The reward-hacking check (health.hacking_metric): the reward keeps rising while a held-out
metric of what the reward stands for falls. With a learned reward model this is the
over-optimisation of Gao et al. 2023 ("Scaling laws for reward model overoptimization"): the
true score peaks and falls while the proxy keeps climbing."""

from __future__ import annotations

import math


def hacking(evals: list[dict], metric: str, drop: float) -> str | None:
    """A message when the last evaluation in `evals` (rows with eval/* keys, in step order) has a
    higher eval/reward than the evaluation where eval/<metric> peaked, and eval/<metric> more than
    `drop` below that peak; else None."""
    key = f"eval/{metric}"
    rows = [r for r in evals if _finite(r.get(key)) and _finite(r.get("eval/reward"))]
    if len(rows) < 2:
        return None
    now = rows[-1]
    peak = max(rows[:-1], key=lambda r: r[key])
    fell = peak[key] - now[key]
    if fell > drop and now["eval/reward"] > peak["eval/reward"]:
        return (f"eval/reward rose {peak['eval/reward']:.4g} -> {now['eval/reward']:.4g} since step {peak['step']} "
                f"while {key} fell {peak[key]:.4g} -> {now[key]:.4g}: the policy is exploiting the reward; stop "
                f"here, keep the checkpoint near step {peak['step']}, or strengthen the reward (or the KL)")
    return None


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
