"""`regen report` (a self-contained HTML report of one or several runs) and `regen status`
(a few lines on a run, for a terminal).

    load.py      read a run directory robustly (partial lines, missing files -> notes)
    runstate.py  alive / finished / stopped / crashed, from run.json and file times
    svg.py       inline SVG charts
    plots.py     which charts, on which x axes
    media.py     sample images and videos as data URIs
    gallery.py   the sample gallery
    html.py      the page
    status.py    the status lines
"""

from __future__ import annotations

from pathlib import Path

from regen.report.load import Run, load_run


def load_runs(paths: list[str | Path]) -> list[Run]:
    """Load each run; runs of the same folder name are told apart by their path."""
    names = [Path(p).resolve().name for p in paths]
    return [load_run(p, name=str(p) if names.count(n) > 1 else n) for p, n in zip(paths, names)]


def make_report(paths: list[str | Path], out: str | Path | None = None) -> Path:
    """Write the report and return its path: RUN_DIR/report.html for one run, ./report.html
    for several, unless `out` says otherwise."""
    from regen.report.html import write_report

    runs = load_runs(paths)
    target = Path(out) if out is not None else (runs[0].path / "report.html" if len(runs) == 1 else Path("report.html"))
    return write_report(runs, target)
