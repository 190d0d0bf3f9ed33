"""The sample gallery: what the model wrote (or drew) at each evaluation, with its reward;
the first and the last evaluation side by side, then each evaluation step."""

from __future__ import annotations

import math
from html import escape

from regen.report.load import Run
from regen.report.media import MediaError, image_uri, video_uri
from regen.report.svg import fmt_num

MAX_EVAL_STEPS = 12  # per-step sections shown (spread over the run, first and last always)
MAX_TEXT = 2000  # characters of a prompt/completion shown


def _text(v, limit: int = MAX_TEXT) -> str:
    s = v if isinstance(v, str) else "" if v is None else str(v)
    if len(s) > limit:
        return escape(s[:limit]) + f'<span class="more">… ({len(s) - limit} more characters)</span>'
    return escape(s)


def reward_of(row: dict) -> float | None:
    r = row.get("reward")
    ok = isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
    return float(r) if ok else None


def spread(steps: list[int], n: int = MAX_EVAL_STEPS) -> list[int]:
    """At most n of the sorted steps, evenly spread, first and last included."""
    if len(steps) <= n:
        return steps
    idx = sorted({round(i * (len(steps) - 1) / (n - 1)) for i in range(n)})
    return [steps[i] for i in idx]


class Gallery:
    """Renders one run's samples; media are encoded once even when a sample is shown twice,
    and every media problem is collected for the report's notes."""

    def __init__(self, run: Run):
        self.run = run
        self.problems: list[str] = []
        self._media: dict[tuple[int, int], str] = {}

    def _media_html(self, step: int, i: int, row: dict) -> str:
        if (step, i) in self._media:
            return self._media[(step, i)]
        out = ""
        for field, fn in (("image", image_uri), ("video", video_uri)):
            if field not in row:
                continue
            try:
                uri = fn(self.run.path, row[field])
                out += f'<img class="media {field}" src="{uri}" alt="{field} of sample {i}" loading="eager">'
            except MediaError as e:
                self.problems.append(f"samples/step_{step:08d}.jsonl row {i + 1}: {field} {e}")
                out += f'<div class="missing">{field}: {escape(str(e))}</div>'
        self._media[(step, i)] = out
        return out

    def card(self, step: int, i: int, row: dict) -> str:
        r = reward_of(row)
        meta = [f'reward <b class="reward">{fmt_num(r) if r is not None else "missing"}</b>']
        if "answer" in row:
            mark = {True: " ✓", False: " ✗"}.get(row.get("correct"), "")
            meta.append(f"answer {_text(row['answer'], 200)}{mark}")
        if "finished" in row:
            meta.append("ended with EOS" if row["finished"] else "truncated")
        if "task" in row:  # a multi-task run: which task's held-out prompt
            meta.append(f"task {_text(row['task'], 60)}")
        parts = [self._media_html(step, i, row)]
        if "rewrite" in row:  # a joint run: what the enhancer wrote, which the painter drew (above the image)
            parts.insert(0, f'<div class="completion"><span class="lbl">rewrite</span>{_text(row["rewrite"])}</div>')
        if "prompt" in row:
            parts.append(f'<div class="prompt"><span class="lbl">prompt</span>{_text(row["prompt"])}</div>')
        if isinstance(row.get("turns"), list):  # a multi-turn episode: the model's turns and what answered them
            parts.append(self.transcript(row))
        elif "completion" in row:
            parts.append(f'<div class="completion"><span class="lbl">completion</span>{_text(row["completion"])}</div>')
        parts.append(f'<div class="meta">{" · ".join(meta)}</div>')
        return f'<div class="sample" data-step="{step}">{"".join(parts)}</div>'

    @staticmethod
    def transcript(row: dict) -> str:
        obs = row.get("observations") or []
        out = []
        for i, turn in enumerate(row["turns"]):
            out.append(f'<div class="completion turn"><span class="lbl">model {i + 1}</span>{_text(turn)}</div>')
            if i < len(obs) and obs[i]:
                out.append(f'<div class="observation"><span class="lbl">env</span>{_text(obs[i])}</div>')
        calls, errors = row.get("tool_calls", 0), row.get("tool_errors", 0)
        tail = f"{len(row['turns'])} turns · {calls} tool calls · {errors} tool errors"
        tail += " · truncated" if row.get("truncated") else ""
        return f'<div class="episode">{"".join(out)}<div class="meta">{escape(tail)}</div></div>'

    def summary(self, step: int) -> str:
        rows = self.run.samples[step]
        rewards = [r for r in map(reward_of, rows) if r is not None]
        text = f"step {step}: {len(rows)} samples"
        if rewards:
            text += f", mean reward {fmt_num(sum(rewards) / len(rewards))}"
        evals = {k: v for k, v in self.run.rows_at(step).items() if k.startswith("eval/")}
        if evals:
            text += " (" + ", ".join(f"{k.removeprefix('eval/')} {fmt_num(v)}" for k, v in sorted(evals.items())) + ")"
        return escape(text)

    def html(self) -> str:
        steps = sorted(self.run.samples)
        if not steps:
            return ('<p class="note">No samples/ in this run: it saved no evaluation samples (evaluation off, or '
                    "a run made before regen saved them).</p>")
        first, last = steps[0], steps[-1]
        out = []
        if first != last:
            a, b = self.run.samples[first], self.run.samples[last]
            rows = []
            for i in range(max(len(a), len(b))):
                left = self.card(first, i, a[i]) if i < len(a) else ""
                right = self.card(last, i, b[i]) if i < len(b) else ""
                rows.append(f"<tr><td>{left}</td><td>{right}</td></tr>")
            out.append(f'<table class="compare"><thead><tr><th>{self.summary(first)} (first evaluation)</th>'
                       f'<th>{self.summary(last)} (last evaluation)</th></tr></thead><tbody>{"".join(rows)}'
                       "</tbody></table>")
        shown = spread(steps)
        if len(shown) < len(steps):
            out.append(f'<p class="note">{len(steps)} evaluation steps with samples: showing {len(shown)}, spread '
                       "over the run.</p>")
        for s in shown:
            cards = "".join(self.card(s, i, row) for i, row in enumerate(self.run.samples[s]))
            is_open = " open" if first == last else ""
            out.append(f'<details class="eval-step"{is_open}><summary>{self.summary(s)}</summary>'
                       f'<div class="samples">{cards or "<p class=note>empty file</p>"}</div></details>')
        return "".join(out)
