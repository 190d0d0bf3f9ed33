"""bench/flow_methods.py's tables and figure (see its docstring for what each column means)."""

from __future__ import annotations

import statistics
from pathlib import Path


def table(head: list[str], widths: list[int], rows: list[list[str]]) -> None:
    for cells in [head, *rows]:
        print("".join(f"{c:<{w}}" if j == 0 else f"{c:>{w}}" if len(c) < w else " " + c
                      for j, (c, w) in enumerate(zip(cells, widths))).rstrip())


def fmt(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def report(summary: dict, runs: list[dict]) -> None:
    """The per-method table (mean±std, min..max below) and the per-run one."""
    stats = [("target_s", ".1f"), ("target_images", ".0f"), ("target_adherence", ".3f"), ("final_reward", ".4f"),
             ("final_adherence", ".3f"), ("train_s", ".1f")]
    rows = []
    for s in summary.values():
        sp = [s[k] for k, _ in stats]
        rows.append([s["label"], "/".join(f"{v:g}" for v in s["lr"]), str(s["steps"]), f"{s['reached']}/{s['seeds']}",
                     f"{s['held']}/{s['seeds']}",
                     *("-" if v is None else f"{v['mean']:{f}}±{v['std']:{f}}" for v, (_, f) in zip(sp, stats)),
                     fmt(s["speedup_time"], ".2f", "x"), fmt(s["speedup_worst"], ".2f", "x"),
                     fmt(s["speedup_images"], ".2f", "x")])
        rows.append(["", "", "", "", "", *("" if v is None else f"{v['min']:{f}}..{v['max']:{f}}"
                                           for v, (_, f) in zip(sp, stats)), "", "", ""])
    table(["method", "lr", "steps", "reached", "held", "s to tgt", "img to tgt", "adh@tgt", "final rew", "final adh",
           "train s", "speedup t", "worst", "speedup img"], [14, 8, 7, 9, 6, 15, 13, 14, 18, 14, 13, 11, 8, 13], rows)
    print("\nper run (speed-ups against the reference's mean whole run):")
    table(["method", "base", "seed", "load", "rew@0", "adh@0", "final rew", "final adh", "train s", "med step ms", "tgt step",
           "s to tgt", "img to tgt", "adh@tgt", "speedup t", "speedup img"],
          [14, 6, 5, 6, 9, 7, 11, 11, 9, 13, 10, 10, 12, 9, 11, 13],
          [[r["label"], str(r["base"]), str(r["seed"]), f"{r['load_before']:.2f}", f"{r['reward_at_0']:.4f}",
            f"{r['adherence_at_0']:.3f}",
            f"{r['final_reward']:.4f}", f"{r['final_adherence']:.3f}", f"{r['train_s']:.1f}", f"{r['median_step_ms']:.1f}",
            fmt(r["target_step"], "d"), fmt(r["target_s"], ".1f"), fmt(r["target_images"], "d"),
            fmt(r["target_adherence"], ".3f"), fmt(r["speedup_time"], ".2f", "x"), fmt(r["speedup_images"], ".2f", "x")]
           for r in sorted(runs, key=lambda r: (list(summary).index(r["name"]), r["base"], r["seed"]))])


def plot(path: str, runs: list[dict], summary: dict, target: float, source: str, base_adh: float, title: str) -> None:
    """Per method the mean over seeds at each eval point (x: mean training seconds there), min..max shaded."""
    try:
        import matplotlib
    except ImportError:
        print(f"no figure ({path}): matplotlib is missing (pip install -e '.[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(14, 6), dpi=120)
    for i, (name, s) in enumerate(summary.items()):
        rs = [r for r in runs if r["name"] == name]
        n = min(len(r["steps"]) for r in rs)
        if any(r["steps"][:n] != rs[0]["steps"][:n] or len(r["steps"]) != n for r in rs):
            print(f"WARNING: {s['label']}'s seeds have different eval steps; plotting the first {n} points")
        x = [statistics.fmean(r["seconds"][j] for r in rs) for j in range(n)]
        style = {"color": f"C{i}", "marker": "os^Dv"[i % 5], "lw": 1.8, "ms": 4}
        for ax, key in ((ax_r, "reward"), (ax_a, "adherence")):
            ys = [[r[key][j] for r in rs] for j in range(n)]
            final = statistics.fmean(y for y in ys[-1])
            label = f"{s['label']}, lr {'/'.join(f'{v:g}' for v in s['lr'])} ({final:.3f}"
            label += f"; {s['reached']}/{s['seeds']} reached)" if key == "reward" else ")"
            ax.plot(x, [statistics.fmean(y) for y in ys], **style, label=label)
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=f"C{i}", alpha=0.15, lw=0)
        if s["reached"] == s["seeds"]:
            ax_r.plot([s["target_s"]["mean"]], [target], "*", color=f"C{i}", ms=16, mec="black", zorder=5)
    ax_r.axhline(target, color="grey", lw=1, ls="--", label=f"target {target:.3f} ({source})")
    ax_a.axhline(base_adh, color="grey", lw=1, ls="--", label=f"base {base_adh:.3f} (mean over seeds)")
    ax_r.set_ylabel("held-out eval/reward")
    ax_a.set_ylabel("held-out eval/adherence_accuracy (fraction drawn as prompted)")
    for ax in (ax_r, ax_a):
        ax.set_xlabel("training wall-clock, s (sum of time/step_s, mean over seeds; evaluation not counted)")
        ax.grid(alpha=0.3)
    ax_r.legend(title="method: mean over seeds (final), min..max shaded; * = mean s to target", fontsize=8)
    ax_a.legend(title="method (final mean)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    print(f"figure written to {path}")
