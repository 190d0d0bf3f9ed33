"""A before/after picture of a joint run (models: an enhancer feeding a painter) for the README.

Reads the held-out samples a joint run kept at two evaluations (samples/step_N.jsonl: the user's
prompt, the enhancer's greedy rewrite, the painter's image, its reward; the same prompts and noise
at every evaluation) and draws one row per prompt: the user's prompt, then the rewrite and image
before, then after.

    python bench/joint_picture.py runs/demo-joint --out docs/joint_before_after.png
    python bench/joint_picture.py RUN --before 0 --after 250 --rows 8 --out picture.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_at(run: Path, step: int) -> list[dict]:
    path = run / "samples" / f"step_{step:08d}.jsonl"
    if not path.exists():
        sys.exit(f"{path}: no samples at step {step} (evaluated steps: {', '.join(map(str, steps(run)))})")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or "rewrite" not in rows[0]:
        sys.exit(f"{path}: not a joint run's samples (no 'rewrite' field)")
    return rows


def steps(run: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run / "samples").glob("step_*.jsonl"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a joint run's directory")
    p.add_argument("--before", type=int, help="the step before (default: the first evaluated)")
    p.add_argument("--after", type=int, help="the step after (default: the last evaluated)")
    p.add_argument("--rows", type=int, default=8, help="held-out prompts shown (one image each)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    from PIL import Image, ImageDraw, ImageFont

    have = steps(a.run)
    if not have:
        sys.exit(f"{a.run}: no samples/step_*.jsonl (was it evaluated?)")
    before, after = a.before if a.before is not None else have[0], a.after if a.after is not None else have[-1]
    pairs = []
    seen = set()
    for b, c in zip(rows_at(a.run, before), rows_at(a.run, after)):
        if b["prompt"] != c["prompt"]:
            sys.exit(f"step {before} and step {after} kept different prompts: not one run's evaluations")
        if b["prompt"] not in seen:  # one image per prompt
            seen.add(b["prompt"])
            pairs.append((b, c))
    pairs = pairs[: a.rows]
    font = ImageFont.load_default()
    px, text_w, rw, gap, line = 64, 250, 170, 10, 14  # image, user-prompt and rewrite widths
    col_w = rw + px + gap
    width = text_w + 2 * col_w + gap
    height = line * 2 + len(pairs) * (px + gap) + gap
    pic = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(pic)
    draw.text((gap, gap), "user prompt (held out)", fill="black", font=font)
    draw.text((text_w + gap, gap), f"step {before}: rewrite -> image", fill="black", font=font)
    draw.text((text_w + col_w + gap, gap), f"step {after}: rewrite -> image", fill="black", font=font)
    for i, (b, c) in enumerate(pairs):
        y = line * 2 + i * (px + gap)
        draw.text((gap, y + px // 3), b["prompt"], fill="black", font=font)
        for j, r in enumerate((b, c)):
            x = text_w + j * col_w + gap
            draw.text((x, y + px // 3), r["rewrite"], fill="navy", font=font)
            reward = "" if r.get("reward") is None else f"reward {r['reward']:.2f}"
            draw.text((x, y + px // 3 + line), reward, fill="gray", font=font)
            img = Image.open(a.run / r["image"]).convert("RGB").resize((px, px), Image.NEAREST)
            pic.paste(img, (x + rw, y))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    pic.save(a.out)
    print(f"wrote {a.out} ({len(pairs)} prompts, step {before} -> {after})")


if __name__ == "__main__":
    main()
