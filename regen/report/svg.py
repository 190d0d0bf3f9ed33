"""Inline SVG charts, written directly as text: no plotting library and nothing fetched, so
a report opens anywhere (an air-gapped cluster, an attachment). Every chart shares one frame
(size, margins), so charts stacked in one column line up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

W, H = 600, 230
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 10, 36
MAX_POINTS = 1200  # past this a line is thinned (min and max per bucket) to keep the page small

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22"]
DASHES = ["", "6 4", "2 3", "10 3 2 3"]


@dataclass
class Line:
    xs: list[float]
    ys: list[float]
    color: str
    label: str
    dash: str = ""
    lo: list[float] | None = None  # band (e.g. mean ± std), same length as ys
    hi: list[float] | None = None
    points: bool = False  # draw each value as a dot (sparse series such as eval/*)


def fmt_num(v: float) -> str:
    """Short tick/label text: 0.25, 1200, 1.2e+05, 3e-05."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.2g}"
    return f"{v:.4g}" if a < 1 else f"{v:.5g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return ticks


def _pad(lo: float, hi: float) -> tuple[float, float]:
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi), 1e-30):  # flat (to rounding): a visible band around it
        d = abs(lo) * 0.1 or 1.0
        return lo - d, hi + d
    d = (hi - lo) * 0.05
    return lo - d, hi + d


class Frame:
    """Maps data to pixels and draws the axes of one chart."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float], height: int = H):
        self.x0, self.x1 = x_range if x_range[1] > x_range[0] else (x_range[0] - 1, x_range[0] + 1)
        self.y0, self.y1 = y_range
        self.h = height

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * (W - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return self.h - BOTTOM - (y - self.y0) / (self.y1 - self.y0) * (self.h - TOP - BOTTOM)

    def axes(self, x_label: str, y_ticks: bool = True) -> list[str]:
        out = [f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{self.h - TOP - BOTTOM}" '
               'fill="#fff" stroke="#ccc"/>']
        for t in nice_ticks(self.x0, self.x1, 6):
            x = self.px(t)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{self.h - BOTTOM}" stroke="#eee"/>')
            out.append(f'<text x="{x:.1f}" y="{self.h - BOTTOM + 13}" text-anchor="middle">{fmt_num(t)}</text>')
        if y_ticks:
            shown = set()
            for t in nice_ticks(self.y0, self.y1, 5):
                if fmt_num(t) in shown:  # ticks closer than the label's digits: one label each
                    continue
                shown.add(fmt_num(t))
                y = self.py(t)
                out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
                out.append(f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>')
        out.append(f'<text x="{(LEFT + W - RIGHT) / 2:.0f}" y="{self.h - 4}" text-anchor="middle" '
                   f'class="axis-label">{escape(x_label)}</text>')
        return out


def _svg(body: list[str], title: str, height: int = H, cls: str = "chart") -> str:
    return (f'<svg class="{cls}" viewBox="0 0 {W} {height}" width="{W}" height="{height}" role="img" '
            f'font-family="sans-serif" font-size="11" fill="#444"><title>{escape(title)}</title>'
            + "".join(body) + "</svg>")


def _thin(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """At most MAX_POINTS points: the min and max of each bucket, so spikes stay visible."""
    if len(xs) <= MAX_POINTS:
        return xs, ys
    size = math.ceil(len(xs) / (MAX_POINTS // 2))
    ox, oy = [], []
    for i in range(0, len(xs), size):
        seg = list(zip(xs[i:i + size], ys[i:i + size]))
        for x, y in sorted({min(seg, key=lambda p: p[1]), max(seg, key=lambda p: p[1])}):
            ox.append(x)
            oy.append(y)
    return ox, oy


def line_chart(lines: list[Line], *, title: str, x_label: str, x_range: tuple[float, float] | None = None,
               markers: list[tuple[float, str, str]] | None = None) -> str:
    """Lines (with optional bands and dots) on shared axes; `markers` are vertical dashed
    lines (x, colour, tooltip), e.g. alerts on the reward curve."""
    lines = [ln for ln in lines if ln.xs]
    if not lines:
        return ""
    all_x = [x for ln in lines for x in ln.xs]
    all_y = [y for ln in lines for y in ln.ys + (ln.lo or []) + (ln.hi or [])]
    xr = x_range or (min(all_x), max(all_x))
    fr = Frame(xr, _pad(min(all_y), max(all_y)))
    body = fr.axes(x_label)
    for ln in lines:
        if ln.lo is not None and ln.hi is not None:
            pts = [f"{fr.px(x):.1f},{fr.py(y):.1f}" for x, y in zip(ln.xs, ln.hi)]
            pts += [f"{fr.px(x):.1f},{fr.py(y):.1f}" for x, y in reversed(list(zip(ln.xs, ln.lo)))]
            body.append(f'<polygon class="band" points="{" ".join(pts)}" fill="{ln.color}" fill-opacity="0.15" '
                        'stroke="none"/>')
    for ln in lines:
        xs, ys = _thin(ln.xs, ln.ys)
        d = " ".join(f"{'M' if i == 0 else 'L'}{fr.px(x):.1f} {fr.py(y):.1f}" for i, (x, y) in enumerate(zip(xs, ys)))
        dash = f' stroke-dasharray="{ln.dash}"' if ln.dash else ""
        body.append(f'<path class="series" data-label="{escape(ln.label)}" data-n="{len(ln.xs)}" d="{d}" '
                    f'fill="none" stroke="{ln.color}" stroke-width="1.6"{dash}>'
                    f"<title>{escape(ln.label)}</title></path>")
        if ln.points or len(ln.xs) == 1:
            for x, y in zip(xs, ys):
                body.append(f'<circle cx="{fr.px(x):.1f}" cy="{fr.py(y):.1f}" r="3" fill="{ln.color}">'
                            f'<title>{escape(ln.label)}: {fmt_num(y)} at {fmt_num(x)}</title></circle>')
    for x, color, tip in markers or []:
        if xr[0] <= x <= xr[1]:
            body.append(f'<line class="marker" x1="{fr.px(x):.1f}" x2="{fr.px(x):.1f}" y1="{TOP}" '
                        f'y2="{H - BOTTOM}" stroke="{color}" stroke-dasharray="3 3">'
                        f"<title>{escape(tip)}</title></line>")
    return _svg(body, title)


def stacked_chart(xs: list[float], layers: list[tuple[str, list[float], str]], *, title: str, x_label: str,
                  x_range: tuple[float, float] | None = None) -> str:
    """Areas stacked bottom-up (label, values, colour), e.g. the time split of each step."""
    tops = [0.0] * len(xs)
    polys = []
    for label, ys, color in layers:
        base = tops
        tops = [b + max(y, 0.0) for b, y in zip(base, ys)]
        polys.append((label, base, tops, color))
    fr = Frame(x_range or (min(xs), max(xs)), (0.0, _pad(0.0, max(tops))[1]))
    body = fr.axes(x_label)
    stride = math.ceil(len(xs) / MAX_POINTS)  # thinned by stride: top and base keep the same x
    for label, base, top, color in polys:
        ox, ot, ob = xs[::stride], top[::stride], base[::stride]
        pts = [f"{fr.px(x):.1f},{fr.py(y):.1f}" for x, y in zip(ox, ot)]
        pts += [f"{fr.px(x):.1f},{fr.py(y):.1f}" for x, y in reversed(list(zip(ox, ob)))]
        body.append(f'<polygon class="series" data-label="{escape(label)}" points="{" ".join(pts)}" '
                    f'fill="{color}" fill-opacity="0.75" stroke="{color}"><title>{escape(label)}</title></polygon>')
    return _svg(body, title)


def histogram_chart(groups: list[tuple[str, list[float], str]], *, title: str, x_label: str) -> str:
    """Grouped bars of counts per bin, one colour per group (e.g. first vs last eval)."""
    values = [v for _, vs, _ in groups for v in vs]
    lo, hi = min(values), max(values)
    if all(float(v).is_integer() for v in values) and hi - lo <= 40:
        edges = [lo - 0.5 + i for i in range(int(hi - lo) + 2)]  # one bin per integer
    else:
        width = (hi - lo) / 20 or 1.0
        edges = [lo + i * width for i in range(21)]
    counts = [[sum(1 for v in vs if edges[b] <= v < edges[b + 1] or (b == len(edges) - 2 and v == edges[-1]))
               for b in range(len(edges) - 1)] for _, vs, _ in groups]
    fr = Frame((edges[0], edges[-1]), (0.0, max(max(c) for c in counts) * 1.1 or 1.0))
    body = fr.axes(x_label)
    slot = (fr.px(edges[1]) - fr.px(edges[0])) / len(groups)
    for g, (label, _, color) in enumerate(groups):
        for b, c in enumerate(counts[g]):
            if c:
                x, y = fr.px(edges[b]) + g * slot, fr.py(c)
                body.append(f'<rect class="bar" x="{x + 0.5:.1f}" y="{y:.1f}" width="{max(slot - 1, 0.5):.1f}" '
                            f'height="{fr.py(0) - y:.1f}" fill="{color}"><title>{escape(label)}: {c} in '
                            f'[{fmt_num(edges[b])}, {fmt_num(edges[b + 1])})</title></rect>')
    return _svg(body, title)


def timeline_chart(tracks: list[tuple[str, list[tuple[float, str, str]]]], *, title: str, x_label: str,
                   x_range: tuple[float, float]) -> str:
    """One row per track (a run): a marker per event (x, colour, tooltip), on the x axis of
    the charts above it."""
    row_h = 18
    height = TOP + BOTTOM + row_h * max(len(tracks), 1)
    fr = Frame(x_range, (0.0, 1.0), height)
    body = fr.axes(x_label, y_ticks=False)
    for i, (name, events) in enumerate(tracks):
        y = TOP + row_h * i + row_h / 2
        body.append(f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{escape(name[:9])}</text>')
        for x, color, tip in events:
            cx = fr.px(min(max(x, fr.x0), fr.x1))
            body.append(f'<path class="alert-marker" d="M{cx:.1f} {y - 6:.1f} L{cx + 5:.1f} {y + 5:.1f} '
                        f'L{cx - 5:.1f} {y + 5:.1f} Z" fill="{color}"><title>{escape(tip)}</title></path>')
    return _svg(body, title, height, cls="chart timeline")
