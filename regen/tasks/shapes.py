"""Synthetic images and videos: coloured shapes drawn procedurally from text prompts.

Images: "a red circle at the left" — 4 colours x 3 shapes x 5 positions = 60 prompts, 16x16
RGB. Videos: "a red circle moving left" — 4 colours x 3 shapes x 4 directions = 48 prompts, 8
frames of 16x16 in which the shape crosses the frame. A fixed task seed holds out 12 prompts
of each (every word still appears in training), so "held-out prompts" are word combinations
the base never saw drawn.

Pixels are in [-1, 1] (the flow model's data space): background -1, the shape its colour with
a little jitter. Size, exact position and colour vary per drawing, so a prompt has many
valid images and a flow model has a distribution to learn.
"""

from __future__ import annotations

import random

import torch

from regen.data import PromptItem

SPLIT_SEED = 4321  # fixed: SFT and RL must agree on the held-out prompts
RES = 16
FRAMES = 8
HELD_OUT = 12
COLOURS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0), "yellow": (1.0, 1.0, -1.0)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {"left": (4.0, 8.0), "right": (12.0, 8.0), "top": (8.0, 4.0), "bottom": (8.0, 12.0), "centre": (8.0, 8.0)}
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}


def vocabulary(kind: str) -> dict[str, list[str]]:
    """Each attribute's values, in prompt order: colour, shape, and position (images) or direction (videos)."""
    key, where = ("position", POSITIONS) if kind == "image" else ("direction", DIRECTIONS)
    return {"colour": list(COLOURS), "shape": list(SHAPES), key: list(where)}


def _all(kind: str) -> list[dict]:
    (c_key, colours), (s_key, shapes), (w_key, where) = vocabulary(kind).items()
    return [{c_key: c, s_key: s, w_key: w} for c in colours for s in shapes for w in where]


def prompt_text(meta: dict) -> str:
    if "position" in meta:
        return f"a {meta['colour']} {meta['shape']} at the {meta['position']}"
    return f"a {meta['colour']} {meta['shape']} moving {meta['direction']}"


def parse_prompt(text: str, kind: str = "image") -> dict | None:
    """The attributes a prompt in the painter's own words names ("a red circle at the left"; for
    videos "a red circle moving left"), or None when it is not one: every word must be the
    phrasing's ("a", "at", "the", "moving") or an attribute value, each attribute named exactly
    once (the prompt encoder reads a bag of words, so their order is free)."""
    values = vocabulary(kind)
    found: dict[str, list[str]] = {k: [] for k in values}
    for word in text.lower().split():
        hits = [k for k, v in values.items() if word in v]
        if not hits and word not in ("a", "at", "the", "moving"):
            return None
        for k in hits:
            found[k].append(word)
    if any(len(v) != 1 for v in found.values()):
        return None
    return {k: v[0] for k, v in found.items()}


def split(kind: str) -> tuple[list[dict], list[dict]]:
    """(train, test) attribute dicts; the test combinations leave every word in training."""
    items = _all(kind)
    rng = random.Random(SPLIT_SEED + (kind == "video"))
    while True:
        rng.shuffle(items)
        train, test = items[HELD_OUT:], items[:HELD_OUT]
        if all({m[k] for m in train} >= {m[k] for m in test} for k in test[0]):
            return train, test


def prompts(kind: str, split_name: str) -> list[PromptItem]:
    train, test = split(kind)
    return [PromptItem(prompt_text(m), dict(m)) for m in (train if split_name == "train" else test)]


def _mask(shape: str, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor, res: int) -> torch.Tensor:
    """(N, res, res) bool: pixels inside each shape (centres cx, cy and half-sizes r: (N,))."""
    ys, xs = torch.meshgrid(torch.arange(res, dtype=torch.float32) + 0.5,
                            torch.arange(res, dtype=torch.float32) + 0.5, indexing="ij")
    dx, dy = xs - cx[:, None, None], ys - cy[:, None, None]
    rr = r[:, None, None]
    if shape == "circle":
        return dx.pow(2) + dy.pow(2) <= rr.pow(2)
    if shape == "square":
        return (dx.abs() <= 0.8 * rr) & (dy.abs() <= 0.8 * rr)
    if shape == "triangle":  # apex up: half-width grows from 0 at the top to r at the bottom
        return (dy >= -rr) & (dy <= rr) & (dx.abs() <= (dy + rr) / 2)
    raise ValueError(f"unknown shape '{shape}'")


def draw(metas: list[dict], generator: torch.Generator | None = None, res: int = RES,
         frames: int = FRAMES) -> torch.Tensor:
    """Images (N, 3, res, res) for metas with a position, videos (N, frames, 3, res, res) for
    metas with a direction; values in [-1, 1]."""
    g = generator
    n = len(metas)
    video = "direction" in metas[0]
    r = 3.0 + 2.0 * torch.rand(n, generator=g)  # half-size 3..5 px
    jitter = torch.rand(n, 2, generator=g) * 2 - 1  # +-1 px
    tint = 0.15 * (torch.rand(n, 3, generator=g) * 2 - 1)
    steps = frames if video else 1
    out = torch.full((n, steps, 3, res, res), -1.0)
    for i, m in enumerate(metas):
        if video:  # cross the frame: start on the far side, move against the border
            dx, dy = DIRECTIONS[m["direction"]]
            t = torch.linspace(-1.0, 1.0, steps)
            cx = res / 2 + jitter[i, 0] + dx * t * (res / 2 - 4)
            cy = res / 2 + jitter[i, 1] + dy * t * (res / 2 - 4)
        else:
            px, py = POSITIONS[m["position"]]
            cx, cy = torch.full((1,), px + jitter[i, 0].item()), torch.full((1,), py + jitter[i, 1].item())
        inside = _mask(m["shape"], cx, cy, r[i].expand(steps), res)  # (steps, res, res)
        colour = (torch.tensor(COLOURS[m["colour"]]) + tint[i]).clamp(-1, 1)
        out[i] = torch.where(inside[:, None], colour[None, :, None, None], out[i])
    return out if video else out[:, 0]


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats -> uint8 [0, 255], channels last: (..., C, H, W) -> (..., H, W, C)."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).movedim(-3, -1)


# builtin:shapes / builtin:moving-shapes (regen/data BUILTIN)
def image_prompts(split_name: str, task) -> list[PromptItem]:
    return prompts("image", split_name)


def video_prompts(split_name: str, task) -> list[PromptItem]:
    return prompts("video", split_name)
