"""The report page: one self-contained HTML file (inline CSS and SVG, media as data URIs,
no script and nothing fetched). The x-axis switch is CSS only: radio inputs whose checked
state shows the charts drawn on that axis."""

from __future__ import annotations

import time
from html import escape
from pathlib import Path

import yaml

from regen import __version__
from regen.report.gallery import Gallery
from regen.report.load import Run, age
from regen.report.plots import (
    alert_timeline,
    chart_figures,
    charts_for,
    legend,
    length_figure,
    other_figures,
    other_keys,
    time_split_figures,
    x_axes,
)
from regen.report.runstate import run_state
from regen.report.svg import PALETTE, fmt_num

AXIS_NAMES = {"step": "steps", "samples": "samples", "time": "wall-clock"}
CONFIG_KEYS = ["model.path", "model.init", "algorithm.name", "algorithm.advantage", "algorithm.kl_coef",
               "rollout.global_batch_size", "rollout.group_size", "rollout.temperature", "rollout.max_new_tokens",
               "train.steps", "sft.steps", "sft.global_batch_size", "optim.lr", "data.train", "data.eval",
               "eval.every", "run.seed"]
MAX_ALERT_ROWS = 500

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#f6f7f9}
header{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid #ddd;padding:8px 20px;
 display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
main{padding:12px 20px;max-width:1400px}
section{margin:18px 0}
h2{font-size:16px;border-bottom:1px solid #ddd;padding-bottom:4px}
.xsel{position:absolute;opacity:0;pointer-events:none}
.axis-switch label{border:1px solid #999;border-radius:4px;padding:2px 8px;margin-left:4px;cursor:pointer}
.ax-samples,.ax-time{display:none}
#x-samples:checked~main .ax-step,#x-time:checked~main .ax-step{display:none}
#x-samples:checked~main .ax-samples,#x-time:checked~main .ax-time{display:block}
#x-step:checked~header label[for=x-step],#x-samples:checked~header label[for=x-samples],
#x-time:checked~header label[for=x-time]{background:#1f77b4;color:#fff;border-color:#1f77b4}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 14px}
.card h3{margin:0 0 6px;font-size:15px;word-break:break-all}
table{border-collapse:collapse;font-size:13px}
td,th{padding:3px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
.facts{width:100%}.facts th{color:#666;font-weight:normal;width:45%}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:12px}
figure{margin:0;background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px 8px}
figcaption{font-size:13px;font-weight:600;margin-bottom:2px}
svg.chart{width:100%;height:auto;display:block}
.legend{font-size:12px;display:flex;flex-wrap:wrap;gap:10px;margin:2px 0}
.key{display:inline-flex;align-items:center;gap:4px}.sw{display:inline-block;width:22px;height:0}
.note{color:#8a5a00;background:#fff8e5;border-left:3px solid #f0b400;padding:4px 8px;font-size:13px}
ul.notes{background:#fff8e5;border-left:3px solid #f0b400;padding:6px 8px 6px 28px;font-size:13px}
.ok{color:#2a7a2a}.bad{color:#c62828}
.compare{width:100%;table-layout:fixed}.compare td{width:50%}
.samples{display:grid;grid-template-columns:repeat(auto-fill,minmax(260px,1fr));gap:8px}
.sample{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px;font-size:13px}
.sample .lbl{color:#888;font-size:11px;margin-right:6px}
.prompt,.completion,.observation{white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,monospace}
.completion{background:#f3f6fb;margin:3px 0;padding:2px 4px}
.observation{background:#f6f3e8;margin:3px 0 3px 12px;padding:2px 4px}
.meta{color:#555;font-size:12px}.more{color:#888}
img.media{max-width:100%;height:160px;width:auto;object-fit:contain;display:block;margin:0 auto 4px;
 image-rendering:pixelated}
.missing{color:#c62828;font-size:12px;border:1px dashed #c62828;padding:6px;margin-bottom:4px}
details{margin:6px 0}summary{cursor:pointer;font-size:14px}
pre{background:#fff;border:1px solid #ddd;padding:8px;font-size:12px;overflow:auto}
"""


def render(runs: list[Run], now: float | None = None) -> str:
    now = time.time() if now is None else now
    axes, axis_notes = x_axes(runs)
    charts = charts_for(runs)
    multi = len(runs) > 1
    figures = chart_figures(runs, axes, charts)
    for axis in axes:
        figures += time_split_figures(runs, axis)
    timelines = "".join(alert_timeline(runs, axis) for axis in axes)
    others = other_figures(runs, axes, other_keys(runs, charts))
    galleries = [Gallery(run) for run in runs]
    gallery_html = [g.html() for g in galleries]  # before the notes: media problems become notes
    states = [run_state(run, now) for run in runs]

    radios = "".join(f'<input type="radio" name="xaxis" class="xsel" id="x-{a.mode}"{" checked" if i == 0 else ""}>'
                     for i, a in enumerate(axes))
    switch = ""
    if len(axes) > 1:
        switch = '<nav class="axis-switch">x axis:' + "".join(
            f'<label for="x-{a.mode}">{AXIS_NAMES[a.mode]}</label>' for a in axes) + "</nav>"
    title = runs[0].name if not multi else f"{len(runs)} runs"
    parts = [f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
             f'<meta name="viewport" content="width=device-width,initial-scale=1">'
             f"<title>regen report: {escape(title)}</title><style>{CSS}</style></head><body>{radios}"
             f"<header><h1>regen report: {escape(title)}</h1><span>made {_when(now)} by regen {__version__}</span>"
             f"{switch}</header><main>"]
    parts.append('<section id="runs"><div class="cards">'
                 + "".join(_card(run, st, i, multi, now) for i, (run, st) in enumerate(zip(runs, states)))
                 + "</div></section>")
    notes = [(run.name, n) for run in runs for n in run.notes]
    notes += [(g.run.name, p) for g in galleries for p in g.problems]
    notes += [("", n) for n in axis_notes]
    if notes:
        items = "".join(f"<li>{escape(name + ': ' if name and multi else '')}{escape(n)}</li>" for name, n in notes)
        parts.append(f'<section id="notes"><h2>Notes</h2><ul class="notes">{items}</ul></section>')

    parts.append('<section id="curves"><h2>Training curves</h2>')
    if multi:
        parts.append(legend([(PALETTE[i % len(PALETTE)], "", run.name) for i, run in enumerate(runs)]))
    if figures:
        parts.append(f'<div class="plots">{"".join(figures)}</div>')
    else:
        parts.append('<p class="note">No metrics to plot yet.</p>')
    if timelines:  # in the charts' grid: the same width, so the same font size as the charts above
        parts.append(f'<div class="plots timelines">{timelines}</div>')
    parts.append("</section>")

    lengths = "".join(length_figure(run, multi) for run in runs)
    if lengths:
        parts.append(f'<section id="lengths"><h2>Completion lengths</h2><div class="plots">{lengths}</div></section>')
    parts.append(f'<section id="alerts"><h2>Alerts</h2>{_alerts_table(runs, multi)}</section>')
    parts.append('<section id="checkpoints"><h2>Checkpoints</h2>'
                 + "".join(_checkpoints_table(run, multi, now) for run in runs) + "</section>")
    parts.append('<section id="samples"><h2>Samples</h2>')
    for run, html in zip(runs, gallery_html):
        if multi:
            parts.append(f'<details class="run-samples"><summary>{escape(run.name)}</summary>{html}</details>')
        else:
            parts.append(html)
    parts.append("</section>")
    if others:
        parts.append(f'<section id="other"><details><summary>Other metrics ({len(others) // max(len(axes), 1)})'
                     f'</summary><div class="plots">{"".join(others)}</div></details></section>')
    parts.append("</main></body></html>\n")
    return "".join(parts)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def reward_last(run: Run, n: int = 10) -> tuple[float | None, float | None]:
    """(last reward/mean, mean of the last n steps' reward/mean)."""
    vals = [v for _, v in run.series("reward/mean")]
    if not vals:
        return None, None
    tail = vals[-n:]
    return vals[-1], sum(tail) / len(tail)


def _fact(key: str, label: str, value: str) -> str:
    return f'<tr><th>{escape(label)}</th><td data-fact="{key}">{value}</td></tr>'


def _card(run: Run, state, i: int, multi: bool, now: float) -> str:
    rows = [_fact("state", "state", f"<b>{escape(state.label)}</b>: {escape(state.detail)}")]
    model = run.cfg("model", "path") or run.cfg("model", "init")
    rows.append(_fact("model", "model", escape(str(model)) if model else "unknown (no config.yaml)"))
    lora = run.cfg("model", "lora")
    if isinstance(lora, dict):
        rows.append(_fact("lora", "LoRA adapter", escape(f"r {lora.get('r')}, alpha {lora.get('alpha')}"
                                                         + (f", on {', '.join(lora['target_modules'])}"
                                                            if lora.get("target_modules") else ""))))
    algo = run.kind if run.config is not None else "unknown"
    if run.cfg("algorithm", "advantage") and run.kind not in ("sft", "dpo"):
        algo += f" (advantage {run.cfg('algorithm', 'advantage')})"
    rows.append(_fact("algorithm", "algorithm", escape(algo)))
    last, total = run.last_step, run.total_steps
    rows.append(_fact("steps", "steps", f"{last if last is not None else '—'} / {total if total is not None else '?'}"))
    if last is not None and run.batch_size:
        rows.append(_fact("samples", "samples seen", f"{last * run.batch_size}"))
    elapsed = run.elapsed()
    if elapsed:
        rows.append(_fact("wallclock", "wall-clock (sum of step times)", age(max(elapsed.values()))))
    r_last, r_mean = reward_last(run)
    if r_last is not None:
        rows.append(_fact("reward_last", "reward/mean, last step", fmt_num(r_last)))
        rows.append(_fact("reward_last10", "reward/mean, mean of the last 10 steps", fmt_num(r_mean)))
    for key in sorted(k for k in run.keys() if k.startswith("eval/")):
        s = run.series(key)
        value = fmt_num(s[-1][1]) if len(s) == 1 else f"{fmt_num(s[0][1])} → {fmt_num(s[-1][1])}"
        rows.append(_fact(key, f"{key} (step {s[0][0]}→{s[-1][0]})", value))
    n_alerts = len(run.alerts or [])
    rows.append(_fact("alerts", "alerts", str(n_alerts)))
    ck = run.checkpoints
    rows.append(_fact("checkpoints", "checkpoints",
                      f"{len(ck)}, newest step {ck[-1].step} ({age(now - ck[-1].mtime)} ago)" if ck else "none"))
    swatch = f'<span class="sw" style="border-top:3px solid {PALETTE[i % len(PALETTE)]}"></span> ' if multi else ""
    cfg = _config_table(run)
    return (f'<div class="card"><h3>{swatch}{escape(run.name)}</h3><div>{escape(str(run.path))}</div>'
            f'<table class="facts">{"".join(rows)}</table>{cfg}</div>')


def _config_table(run: Run) -> str:
    if run.config is None:
        return '<p class="note">config.yaml missing or unreadable: settings unknown.</p>'
    rows = []
    for dotted in CONFIG_KEYS:
        v = run.cfg(*dotted.split("."))
        if v is not None:
            rows.append(f"<tr><th>{escape(dotted)}</th><td>{escape(str(v))}</td></tr>")
    for i, term in enumerate(run.cfg("reward") or []):
        if isinstance(term, dict):
            rows.append(f"<tr><th>reward.{i}</th><td>{escape(str(term.get('name')))} × "
                        f"{escape(str(term.get('weight', 1.0)))}</td></tr>")
    full = yaml.safe_dump(run.config, sort_keys=False)  # already redacted by load_run
    return (f'<details><summary>config</summary><table class="facts">{"".join(rows)}</table>'
            f"<pre>{escape(full)}</pre></details>")


def _alerts_table(runs: list[Run], multi: bool) -> str:
    rows = [(run.name, a) for run in runs for a in (run.alerts or [])]
    absent = [run.name for run in runs if run.alerts is None]
    out = ""
    if absent:
        who = ", ".join(absent) if multi else "this run"
        out += f"<p>No alerts.jsonl in {escape(who)}: no alert was raised.</p>"
    if not rows:
        return out or "<p>No alerts.</p>"
    shown = rows[-MAX_ALERT_ROWS:]
    if len(shown) < len(rows):
        out += f'<p class="note">{len(rows)} alerts: showing the last {len(shown)}.</p>'
    head = ("<th>run</th>" if multi else "") + "<th>step</th><th>time</th><th>kind</th><th>message</th>"
    body = []
    for name, a in shown:
        t = a.get("time")
        when = _when(t) if isinstance(t, (int, float)) else ""
        run_cell = f"<td>{escape(name)}</td>" if multi else ""
        body.append(f'<tr class="alert">{run_cell}<td>{a["step"]}</td><td>{when}</td>'
                    f"<td>{escape(str(a.get('kind', '')))}</td><td>{escape(str(a.get('message', '')))}</td></tr>")
    return out + f'<table class="alerts"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _checkpoints_table(run: Run, multi: bool, now: float) -> str:
    title = f"<h3>{escape(run.name)}</h3>" if multi else ""
    if not run.checkpoints:
        return f"{title}<p>No checkpoints yet.</p>"
    body = []
    for c in run.checkpoints:
        healthy = {True: '<span class="ok">yes</span>', False: '<span class="bad">no</span>', None: "—"}[c.healthy]
        complete = "" if c.complete else ' <span class="bad">(no manifest: incomplete)</span>'
        body.append(f'<tr class="checkpoint"><td>{c.step}{complete}</td><td>{healthy}</td>'
                    f"<td>{c.size_bytes / 1e6:.2f} MB</td><td>{_when(c.mtime)} ({age(now - c.mtime)} ago)</td></tr>")
    return (f'{title}<table class="checkpoints"><thead><tr><th>step</th><th>healthy</th><th>size</th><th>written</th>'
            f'</tr></thead><tbody>{"".join(body)}</tbody></table>')


def write_report(runs: list[Run], out: Path) -> Path:
    """Render and write atomically (a report open in a browser is never half replaced)."""
    from regen.errors import UserError

    html = render(runs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".tmp-{out.name}")
        tmp.write_text(html, encoding="utf-8")
        tmp.replace(out)
    except OSError as e:
        raise UserError(f"report: cannot write '{out}': {e.strerror or e}") from None
    return out
