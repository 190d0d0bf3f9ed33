"""Image and video rewards over `Sample.media` (uint8, image (H, W, C) or video (F, H, W, C)),
and the three reward forms: scalar, binary (`binary`) and pairwise preference (`pairwise`).

Every reward here is a black box over pixels, needs no download, and returns one float per
sample, or None (missing, never 0) for a sample without media or that it cannot score.
Each is registered with a version: bump it when the scoring changes, so a resumed run can
tell its rewards are no longer comparable.

Alone, most of these are easy to hack (a JPEG-size reward gives black images within
minutes of RL): combine them with `adherence` (regen/rewards/adherence.py), or at
least log `adherence_accuracy` beside them.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from regen.rewards.base import Sample, register, resolve, version_of


def _frames(media: Any) -> np.ndarray:
    """(F, H, W, C) view of an image (F = 1) or a video."""
    a = np.asarray(media)
    return a[None] if a.ndim == 3 else a


def _jpeg_kb(frame: np.ndarray, quality: int) -> float:
    """Size in kB (1000 bytes, as DDPO and Flow-GRPO count) of one frame saved as JPEG."""
    from PIL import Image

    if frame.shape[-1] == 1:
        frame = frame[..., 0]  # greyscale
    elif frame.shape[-1] == 4:
        frame = frame[..., :3]  # JPEG has no alpha
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


@register("jpeg_incompressibility", version="1")
def jpeg_incompressibility(samples: list[Sample], quality: int = 95) -> list[float | None]:
    """JPEG size in kB at `quality` (Pillow); video: mean over frames. Larger = more detail.

    The classic prompt-free reward of DDPO (Black et al. 2023) and Flow-GRPO.
    """
    return [None if s.media is None else float(np.mean([_jpeg_kb(f, quality) for f in _frames(s.media)]))
            for s in samples]


@register("jpeg_compressibility", version="1")
def jpeg_compressibility(samples: list[Sample], quality: int = 95) -> list[float | None]:
    """Minus the JPEG size in kB at `quality`; video: mean over frames. Larger = simpler image."""
    return [None if v is None else -v for v in jpeg_incompressibility(samples, quality)]


def _rgb(target: str | Sequence[float]) -> np.ndarray:
    """A shapes colour name ('red', ...) or an [R, G, B] triple in 0..255."""
    if isinstance(target, str):
        from regen.tasks.shapes import COLOURS

        if target not in COLOURS:
            raise ValueError(f"colour_target: unknown colour '{target}'; known: {', '.join(COLOURS)} or [R, G, B]")
        return (np.asarray(COLOURS[target]) + 1.0) * 127.5  # the task's [-1, 1] colours in 0..255
    rgb = np.asarray(target, dtype=np.float64)
    if rgb.shape != (3,):
        raise ValueError(f"colour_target: target must be a colour name or [R, G, B], got {target!r}")
    return rgb


def _foreground(frames: np.ndarray, background: Sequence[float], tol: float) -> np.ndarray:
    """(F, H, W) bool: pixels whose largest channel difference from `background` exceeds `tol`
    (the shapes task draws on black; generated backgrounds carry some noise, hence a tolerance)."""
    diff = np.abs(frames[..., :3].astype(np.float64) - np.asarray(background, dtype=np.float64))
    return diff.max(-1) > tol


@register("colour_target", version="1")
def colour_target(samples: list[Sample], target: str | Sequence[float] = "red", region: str = "shape",
                  background: Sequence[float] = (0, 0, 0), tol: float = 64.0) -> list[float | None]:
    """Closeness of a mean colour to `target`: 1 - |mean - target| / |white - black| in [0, 1].

    region "image": mean over all pixels (and frames). region "shape": mean over the pixels
    that differ from `background` by more than `tol` in some channel; an image with no such
    pixel scores 0.0 (it has no shape of the wanted colour: a real judgement, not a missing one).
    """
    if region not in ("image", "shape"):
        raise ValueError(f"colour_target: region must be 'image' or 'shape', got '{region}'")
    want, scale = _rgb(target), 255.0 * math.sqrt(3.0)  # Euclidean RGB distance, 1 = black vs white
    out: list[float | None] = []
    for s in samples:
        if s.media is None:
            out.append(None)
            continue
        px = _frames(s.media)[..., :3].astype(np.float64)
        if region == "shape":
            px = px[_foreground(px, background, tol)]
            if len(px) == 0:
                out.append(0.0)
                continue
        mean = px.reshape(-1, 3).mean(0)
        out.append(float(1.0 - np.linalg.norm(mean - want) / scale))
    return out


@register("temporal_smoothness", version="1")
def temporal_smoothness(samples: list[Sample]) -> list[float | None]:
    """1 - mean |frame[t+1] - frame[t]| / 255 over all pixels, channels and consecutive pairs, in [0, 1].

    1.0 for a static video, 0.0 for frames flipping black/white. It penalises flicker and
    motion alike, so pair it with `motion_amount` or adherence's direction. An image (or a
    1-frame video) has no frame pairs: missing (None).
    """
    out: list[float | None] = []
    for s in samples:
        if s.media is None or np.ndim(s.media) != 4 or len(s.media) < 2:
            out.append(None)
            continue
        v = np.asarray(s.media, dtype=np.float64)
        out.append(float(1.0 - np.abs(np.diff(v, axis=0)).mean() / 255.0))
    return out


@register("motion_amount", version="1")
def motion_amount(samples: list[Sample], background: Sequence[float] = (0, 0, 0),
                  tol: float = 64.0) -> list[float | None]:
    """Mean displacement of the shape's centroid between consecutive frames, in pixels per frame.

    Shape = the pixels differing from `background` by more than `tol`, as in colour_target.

    The centroid, not the mean frame difference: a difference also rewards flicker and noise
    (and would be 1 - temporal_smoothness, so the two rewards would only pull against each
    other), while the centroid moves only if the object does. Pairs of frames where either
    has no shape pixel are skipped; a video with no such pair scores 0.0 (nothing moves).
    The shapes task moves its shape 8 px in 7 steps: about 1.14 px/frame. Image: None.
    """
    out: list[float | None] = []
    for s in samples:
        if s.media is None or np.ndim(s.media) != 4:
            out.append(None)
            continue
        fg = _foreground(np.asarray(s.media), background, tol)  # (F, H, W)
        cents: list[np.ndarray | None] = []
        for m in fg:
            ys, xs = np.nonzero(m)
            cents.append(np.array([xs.mean(), ys.mean()]) if len(xs) else None)
        steps = [float(np.linalg.norm(b - a)) for a, b in zip(cents, cents[1:]) if a is not None and b is not None]
        out.append(float(np.mean(steps)) if steps else 0.0)
    return out


def _inner(of: str, args: dict | None, where: str):
    """Another reward as a plain callable with its args bound (a factory is built here)."""
    fn, args = resolve(of, where=where), dict(args or {})
    if getattr(fn, "reward_factory", False):
        return fn(**args), {}
    return fn, args


@register("binary", version="1", kind="binary", factory=True)
class Binary:
    """1.0 when another reward's score is >= `threshold` (<= with below=True), else 0.0.

    args: of (reward name), threshold, args (the inner reward's args), below. Turns any
    scalar reward into good/bad labels; missing stays missing.
    """

    def __init__(self, of: str, threshold: float, args: dict | None = None, below: bool = False):
        self.fn, self.args = _inner(of, args, "binary.of")
        self.threshold, self.below = float(threshold), below
        # the labels change when the inner scorer does: carry its version
        self.reward_version = f"1({of}={version_of(self.fn)})"

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        out: list[float | None] = []
        for v in self.fn(samples, **self.args):
            if v is None or math.isnan(v):
                out.append(None)
            else:
                out.append(float(v <= self.threshold if self.below else v >= self.threshold))
        return out


def pairwise_preferences(scores_a: Sequence[float | None], scores_b: Sequence[float | None],
                         tie: float = 0.0) -> list[float | None]:
    """Preference label of each pair (a_i, b_i) from a's point of view: 1.0 when a wins
    (a_i - b_i > tie), 0.0 when it loses (b_i - a_i > tie), 0.5 for a tie (|a_i - b_i| <= tie).
    A pair with a missing score (None or NaN) has no label: None."""
    if len(scores_a) != len(scores_b):
        raise ValueError(f"pairwise_preferences: {len(scores_a)} scores against {len(scores_b)}")
    out: list[float | None] = []
    for a, b in zip(scores_a, scores_b):
        if a is None or b is None or math.isnan(a) or math.isnan(b):
            out.append(None)
        else:
            out.append(1.0 if a - b > tie else 0.0 if b - a > tie else 0.5)
    return out


def groups(samples: list[Sample]) -> list[range]:
    """Runs of consecutive samples with the same prompt: how the loop lays out the n samples
    of each prompt (sample i belongs to prompt i // n). A "pair" key in Sample.meta splits
    further (held-out evaluation pairs each sample with the starting model's on its own)."""
    def key(s: Sample):
        return s.prompt, s.meta.get("pair") if isinstance(s.meta, dict) else None

    out: list[range] = []
    start = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or key(samples[i]) != key(samples[start]):
            out.append(range(start, i))
            start = i
    return out


@register("pairwise", version="1", factory=True)
class Pairwise:
    """Win rate in [0, 1] of each sample against the others of its group, from pairwise labels.

    args: of (a reward name), args (its args), tie (score difference that counts as a tie).
    `of` is either a judge that compares two samples (registered with kind="pairwise", called as
    judge(samples_a, samples_b, **args) -> 1.0 when a is better, 0.0 when b is, 0.5 for a tie,
    None when it cannot say; every pair of a group is judged once, b against a is 1 - label) or
    any scalar reward, whose scores are compared (pairwise_preferences). Group = consecutive
    samples with the same prompt. A sample's score is the mean of its labels against every
    other member it was compared with (win 1, tie 0.5, loss 0), so only the ranking inside the
    group matters, not the scale of a scalar. Missing: a sample with no labelled comparison. The score depends on the
    whole batch: behind the reward service, keep the result cache off (the default) and send
    whole groups in one request.
    """

    def __init__(self, of: str, args: dict | None = None, tie: float = 0.0):
        self.fn, self.args = _inner(of, args, "pairwise.of")
        self.tie, self.of = float(tie), of
        self.reward_version = f"1({of}={version_of(self.fn)})"

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        if getattr(self.fn, "reward_kind", "scalar") == "pairwise":
            return self._judged(samples)
        scores = [None if v is None or math.isnan(v) else float(v) for v in self.fn(samples, **self.args)]
        out: list[float | None] = [None] * len(samples)
        for g in groups(samples):
            scored = [i for i in g if scores[i] is not None]
            for i in scored:
                others = [scores[j] for j in scored if j != i]
                if others:
                    prefs = pairwise_preferences([scores[i]] * len(others), others, self.tie)
                    out[i] = sum(p for p in prefs if p is not None) / len(others)
        return out

    def _judged(self, samples: list[Sample]) -> list[float | None]:
        pairs = [(i, j) for g in groups(samples) for i in g for j in g if i < j]
        labels = list(self.fn([samples[i] for i, _ in pairs], [samples[j] for _, j in pairs], **self.args)) \
            if pairs else []
        if len(labels) != len(pairs):
            raise ValueError(f"pairwise judge '{self.of}' returned {len(labels)} labels for {len(pairs)} pairs")
        won: list[list[float]] = [[] for _ in samples]
        for (i, j), p in zip(pairs, labels):
            if p is None or math.isnan(p):
                continue
            if p not in (0.0, 0.5, 1.0):
                raise ValueError(f"pairwise judge '{self.of}' returned {p!r}: labels are 1 (first better), "
                                 "0 (second better), 0.5 (tie) or None")
            won[i].append(float(p))
            won[j].append(1.0 - float(p))
        return [sum(w) / len(w) if w else None for w in won]
