"""Which charts a report holds, built from the metrics the runs actually logged.

Each chart is drawn once per x axis (steps, samples seen, wall-clock); the page shows one
axis at a time. A chart whose metrics no run logged is left out. With one run, colour
tells the metrics of a chart apart; with several, colour is the run and the dash pattern
the metric."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from regen.report.load import Run
from regen.report.svg import DASHES, PALETTE, Line, histogram_chart, line_chart, stacked_chart, timeline_chart

REWARD_STATS = {"reward/mean", "reward/std", "reward/missing_frac", "reward/zero_std_frac"}
FRACTIONS = ["reward/zero_std_frac", "reward/missing_frac", "response/truncated_frac"]
TIME_ORDER = ["time/sample_s", "time/logprob_s", "time/score_s", "time/update_s"]
OUTSIDE_STEP = ("time/step_s", "time/checkpoint_s", "time/resume_s")  # not parts of a step's time
QUALITY_ORDER = ("fid", "kid", "precision", "recall", "ssim", "psnr", "temporal_ssim", "clip_score", "bleu4", "chrf",
                 "exact_match", "gates_passed")
QUALITY_HINT = {"eval/fid": " (lower is closer to the reference)", "eval/kid": " (lower is closer)",
                "eval/gates_passed": " (1 = every eval.gates threshold met)"}
SEVERE = ("stopped", "rollback", "failed", "nonfinite", "collapse")


@dataclass
class XAxis:
    mode: str  # step | samples | time
    label: str
    maps: list[dict[int, float] | None]  # per run: step -> x (None: this run cannot be drawn on it)
    range: tuple[float, float]


@dataclass
class Chart:
    key: str  # id in the page
    title: str
    keys: list[str]
    band: str | None = None  # key of a ± band around keys[0]
    points: bool = False


def x_axes(runs: list[Run]) -> tuple[list[XAxis], list[str]]:
    """The x axes the runs can be drawn on, and a note for each run left off one."""
    notes: list[str] = []
    steps = [{r["step"]: float(r["step"]) for r in run.rows} for run in runs]
    samples: list[dict[int, float] | None] = []
    for run, st in zip(runs, steps):
        bs = run.batch_size
        samples.append({s: s * bs for s in st} if bs else None)
        if bs is None:
            notes.append(f"{run.name}: batch size unknown (no config.yaml): left off the samples axis")
    elapsed = [run.elapsed() or None for run in runs]
    for run, e in zip(runs, elapsed):
        if e is None:
            notes.append(f"{run.name}: no time/step_s logged: left off the wall-clock axis")
    longest = max((max(e.values()) for e in elapsed if e), default=0.0)
    unit, div = ("h", 3600.0) if longest > 7200 else ("min", 60.0) if longest > 120 else ("s", 1.0)
    clock = [{s: v / div for s, v in e.items()} if e else None for e in elapsed]
    out = []
    for mode, label, maps in (("step", "step", steps), ("samples", "samples seen", samples),
                              ("time", f"wall-clock ({unit})", clock)):
        xs = [x for m in maps if m for x in m.values()]
        if xs:
            out.append(XAxis(mode, label, maps, (min(xs), max(xs))))
    return out, notes


def charts_for(runs: list[Run]) -> list[Chart]:
    keys = set().union(*(run.keys() for run in runs))
    comps = sorted(k for k in keys if k.startswith("reward/") and k.count("/") == 1 and k not in REWARD_STATS)
    charts = [Chart("reward", "reward (mean ± std)", ["reward/mean"], band="reward/std")]
    # held-out reward and the quality metrics (eval.metrics) right beside the training reward, on
    # the same axis: a reward that rises while FID rises (or recall falls) is reward hacking
    quality = [k for k in (f"eval/{n}" for n in QUALITY_ORDER) if k in keys]
    charts += [Chart(f"eval-{k}", k + QUALITY_HINT.get(k, ""), [k], points=True)
               for k in ["eval/reward", *quality] if k in keys]
    if len(runs) == 1 or len(comps) <= 2:
        charts.append(Chart("components", "reward components", comps))
    else:  # several runs x several components: one chart per component stays readable
        charts += [Chart(f"component-{c}", c, [c]) for c in comps]
    tasks = sorted({k.split("/")[1] for k in keys if k.startswith("task/") and k.count("/") == 2})
    if tasks:  # a multi-task run (config tasks:): each task's reward, and how its prompts were drawn
        charts += [Chart("task-reward", "training reward per task", [f"task/{t}/reward" for t in tasks]),
                   Chart("task-weight", "task weights (task_mix)", [f"task/{t}/weight" for t in tasks]),
                   Chart("task-share", "share of each step's prompts per task", [f"task/{t}/share" for t in tasks])]
    charts += [
        Chart("kl", "KL to the reference", ["kl"]),
        Chart("clip", "clip fraction", ["clip_frac"]),
        Chart("entropy", "entropy (nats/token)", ["entropy"]),
        Chart("length", "response length (tokens): mean, max", ["response_length/mean", "response_length/max"]),
        Chart("throughput", "throughput (per second)", sorted(k for k in keys if k.startswith("throughput/"))),
        Chart("fractions", "fractions: zero-std groups, missing rewards, truncated", FRACTIONS),
        Chart("loss", "loss", ["loss"]),
        Chart("dpo-rewards", "DPO implicit rewards: chosen, rejected, margin",
              ["rewards/chosen", "rewards/rejected", "rewards/margin"]),
        Chart("dpo-accuracy", "DPO: chosen preferred (fraction of pairs)", ["rewards/accuracy"]),
        Chart("lr", "learning rate", ["lr", *sorted(k for k in keys if k.endswith("/lr") and k.count("/") == 1)]),
    ]
    shown = {k for c in charts for k in c.keys}
    charts += [Chart(f"eval-{k}", k, [k], points=True) for k in sorted(k for k in keys if k.startswith("eval/")
                                                                        and k not in shown
                                                                        and not k.startswith("eval/gate/"))]
    flat = _flat(runs)
    return [c for c in charts if any(k in keys and k not in flat for k in c.keys)]


def _flat(runs: list[Run]) -> set[str]:
    """A run without a KL term logs kl = 0 at every step: no chart (folded or not) of nothing."""
    return {k for k in ("kl",) if all(v == 0 for run in runs for _, v in run.series(k))}


def other_keys(runs: list[Run], charts: list[Chart]) -> list[str]:
    """Numeric metrics no chart shows (algorithm extras such as ratio_mean, grad_norm)."""
    used = {k for c in charts for k in c.keys} | {c.band for c in charts if c.band} | _flat(runs)
    keys = set().union(*(run.keys() for run in runs))
    return sorted(k for k in keys if k not in used and not k.startswith("time/"))


def legend(items: list[tuple[str, str, str]]) -> str:
    """HTML legend: (colour, dash, label) each; the swatch is a CSS border, not an svg."""
    spans = []
    for color, dash, label in items:
        style = f"border-top:3px {'dashed' if dash else 'solid'} {color}"
        spans.append(f'<span class="key"><span class="sw" style="{style}"></span>{escape(label)}</span>')
    return f'<div class="legend">{"".join(spans)}</div>'


def _figure(axis: XAxis, chart_id: str, title: str, svg: str, leg: str = "") -> str:
    return (f'<figure class="plot ax-{axis.mode}" data-chart="{escape(chart_id)}">'
            f"<figcaption>{escape(title)}</figcaption>{leg}{svg}</figure>")


def alert_color(kind: str) -> str:
    return "#d62728" if any(w in kind for w in SEVERE) else "#ff7f0e"


def chart_figures(runs: list[Run], axes: list[XAxis], charts: list[Chart]) -> list[str]:
    multi = len(runs) > 1
    out = []
    for axis in axes:
        for chart in charts:
            lines, leg = [], {}
            for r, (run, m) in enumerate(zip(runs, axis.maps)):
                if m is None:
                    continue
                for j, key in enumerate(chart.keys):
                    pts = [(m[s], v) for s, v in run.series(key) if s in m]
                    if not pts:
                        continue
                    color = PALETTE[r % len(PALETTE)] if multi else PALETTE[j % len(PALETTE)]
                    dash = DASHES[j % len(DASHES)] if multi else ""
                    ln = Line([x for x, _ in pts], [y for _, y in pts], color,
                              f"{run.name} {key}" if multi else key, dash, points=chart.points)
                    if chart.band and j == 0:
                        sd = dict(run.series(chart.band))
                        steps = [s for s, _ in run.series(key) if s in m]
                        if all(s in sd for s in steps):
                            ln.lo = [y - sd[s] for s, y in zip(steps, ln.ys)]
                            ln.hi = [y + sd[s] for s, y in zip(steps, ln.ys)]
                    lines.append(ln)
                    leg.setdefault(key, ("#444" if multi else color, dash, key))
            if not lines:
                continue
            markers = _alert_markers(runs, axis) if chart.key == "reward" else None
            svg = line_chart(lines, title=chart.title, x_label=axis.label, x_range=axis.range, markers=markers)
            out.append(_figure(axis, chart.key, chart.title, svg, legend(list(leg.values()))
                                   if len(leg) > 1 or chart.key == "components" else ""))
    return out


def _alert_markers(runs: list[Run], axis: XAxis) -> list[tuple[float, str, str]]:
    out = []
    for r, (run, m) in enumerate(zip(runs, axis.maps)):
        for a in run.alerts or []:
            if m and a["step"] in m:
                color = PALETTE[r % len(PALETTE)] if len(runs) > 1 else alert_color(str(a.get("kind")))
                out.append((m[a["step"]], color, f"{run.name} step {a['step']} [{a.get('kind')}] {a.get('message')}"))
    return out


def time_split_figures(runs: list[Run], axis: XAxis) -> list[str]:
    """Where each step's time went, stacked; one chart per run (stacks do not overlay)."""
    out = []
    for run, m in zip(runs, axis.maps):
        keys = run.keys()
        parts = [k for k in TIME_ORDER if k in keys] + sorted(
            k for k in keys if k.startswith("time/") and k not in TIME_ORDER and k not in OUTSIDE_STEP)
        if not parts or m is None:
            continue
        rows = {s: {} for s, _ in run.series(parts[0])}
        for k in parts + ["time/step_s"]:
            for s, v in run.series(k):
                rows.setdefault(s, {})[k] = v
        steps = sorted(s for s in rows if s in m)
        if not steps:
            continue
        layers = [(k.removeprefix("time/"), [rows[s].get(k, 0.0) for s in steps], PALETTE[i % len(PALETTE)])
                  for i, k in enumerate(parts)]
        if "time/step_s" in keys:  # what the stages do not account for: logging, eval, checkpoints
            rest = [max(rows[s].get("time/step_s", 0.0) - sum(rows[s].get(k, 0.0) for k in parts), 0.0)
                    for s in steps]
            layers.append(("other", rest, "#bbbbbb"))
        title = "time per step by stage (s)" + (f": {run.name}" if len(runs) > 1 else "")
        svg = stacked_chart([m[s] for s in steps], layers, title=title, x_label=axis.label, x_range=axis.range)
        out.append(_figure(axis, "time-split", title, svg, legend([(c, "", lab) for lab, _, c in layers])))
    return out


def alert_timeline(runs: list[Run], axis: XAxis) -> str:
    tracks = []
    for run, m in zip(runs, axis.maps):
        events = []
        for a in run.alerts or []:
            x = m.get(a["step"], axis.range[0]) if m else None  # step -1 (at start-up): drawn at the left
            if x is not None:
                kind = str(a.get("kind"))
                events.append((x, alert_color(kind), f"step {a['step']} [{kind}] {a.get('message', '')}"))
        tracks.append((run.name, events))
    if not any(ev for _, ev in tracks):
        return ""
    svg = timeline_chart(tracks, title="alerts", x_label=axis.label, x_range=axis.range)
    return _figure(axis, "alerts", "alerts (hover a marker for its message)", svg)


def other_figures(runs: list[Run], axes: list[XAxis], keys: list[str]) -> list[str]:
    charts = [Chart(f"other-{k}", k, [k]) for k in keys]
    return chart_figures(runs, axes, charts) if charts else []


def sample_lengths(run: Run) -> list[tuple[str, list[float], str]]:
    """Completion lengths (characters) at the first and the last evaluation with samples."""
    # image/video runs carry no completion text: no histogram for them
    steps = sorted(s for s, rows in run.samples.items() if any(isinstance(r.get("completion"), str) for r in rows))
    if not steps:
        return []
    picks = [steps[0]] if len(steps) == 1 else [steps[0], steps[-1]]
    out = []
    for i, s in enumerate(picks):
        lengths = [float(len(r["completion"])) for r in run.samples[s] if isinstance(r.get("completion"), str)]
        out.append((f"step {s}" + (" (first eval)" if i == 0 else " (last eval)"), lengths, PALETTE[i]))
    return out


def length_figure(run: Run, multi: bool) -> str:
    groups = sample_lengths(run)
    if not groups:
        return ""
    title = "completion length at the first and last evaluation (characters)" + (f": {run.name}" if multi else "")
    svg = histogram_chart(groups, title=title, x_label="characters")
    return (f'<figure class="plot lengths" data-chart="lengths"><figcaption>{escape(title)}</figcaption>'
            f"{legend([(c, '', lab) for lab, _, c in groups])}{svg}</figure>")
