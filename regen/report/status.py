"""`regen status RUN_DIR`: where a run stands, in a few lines for a terminal."""

from __future__ import annotations

import time
from pathlib import Path

from regen.report.load import Run, age, load_run
from regen.report.runstate import run_state
from regen.report.svg import fmt_num

TREND_WINDOW = 10
RECENT_ALERTS = 5


def trend(values: list[float], window: int = TREND_WINDOW) -> tuple[float, float, int] | None:
    """(mean of the last k values, mean of the k before, k) with k = window, or half the
    values when there are fewer than 2 x window; None below two values."""
    k = min(window, len(values) // 2)
    if k == 0:
        return None
    return sum(values[-k:]) / k, sum(values[-2 * k:-k]) / k, k


def arrow(delta: float) -> str:
    return "↑" if delta > 0 else "↓" if delta < 0 else "→"


def status_text(path: str | Path, now: float | None = None) -> str:
    run = load_run(path)
    now = time.time() if now is None else now
    state = run_state(run, now)
    out = [f"run         {run.path}  ({state.label})"]
    last, total = run.last_step, run.total_steps
    step = f"step        {last if last is not None else 'none yet'} / {total if total is not None else '?'}"
    if last is not None and total:
        step += f"  ({100 * last / total:.0f}%)"
    out.append(step)
    out.append(_trend_line(run))
    out.append(_eval_line(run))
    alerts = run.alerts or []
    out.append(f"alerts      {len(alerts)}" + (f" (last {min(len(alerts), RECENT_ALERTS)}):" if alerts else ""))
    for a in alerts[-RECENT_ALERTS:]:
        t = a.get("time")
        ago = f"  ({age(now - t)} ago)" if isinstance(t, (int, float)) else ""
        out.append(f"  step {a['step']}  [{a.get('kind')}] {a.get('message', '')}{ago}")
    if run.checkpoints:
        c = run.checkpoints[-1]
        health = {True: "healthy", False: "unhealthy", None: "health not recorded"}[c.healthy]
        out.append(f"checkpoint  step {c.step}, written {age(now - c.mtime)} ago, {health}"
                   + ("" if c.complete else ", INCOMPLETE (no manifest)"))
    else:
        out.append("checkpoint  none yet")
    alive = {True: "yes", False: "no", None: "unknown"}[state.alive]
    out.append(f"alive       {alive}: {state.label}, {state.detail}")
    out += [f"note        {n}" for n in run.notes]
    return "\n".join(out)


def _trend_line(run: Run) -> str:
    key = "reward/mean" if run.series("reward/mean") else "loss" if run.series("loss") else None
    if key is None:
        return "reward      no reward/mean or loss logged yet"
    values = [v for _, v in run.series(key)]
    t = trend(values)
    label = "reward" if key == "reward/mean" else "loss"
    if t is None:
        return f"{label:<12}{fmt_num(values[-1])} (one step so far)"
    now_, before, k = t
    line = (f"{label:<12}{fmt_num(now_)} (mean of the last {k} step{'s' if k > 1 else ''}) vs {fmt_num(before)} "
            f"(the {k} before)  "
            f"{arrow(now_ - before)} {now_ - before:+.3g}")
    return line + ("  (loss: lower is better)" if key == "loss" else "")


def _eval_line(run: Run) -> str:
    steps = [s for s in sorted({r["step"] for r in run.rows})
             if any(k.startswith("eval/") for k in run.rows_at(s))]
    if not steps:
        return "eval        none yet"
    at = run.rows_at(steps[-1])
    vals = "  ".join(f"{k.removeprefix('eval/')} {fmt_num(v)}" for k, v in sorted(at.items()) if k.startswith("eval/"))
    return f"eval        step {steps[-1]}: {vals}"
