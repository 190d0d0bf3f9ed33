"""Prompt adherence for the synthetic shapes task: a small CNN that reads back the prompt.

Reward hacking: a redness or JPEG reward alone turns every sample into a solid red
or black frame within minutes; a reward that checks the prompt, optimised or at least
logged beside the target, catches that. With no downloads allowed the project trains its
own judge on the drawings of regen.tasks.shapes, where the ground truth is free.

One softmax head per prompt attribute: colour (4), shape (3) and position (5) for images;
colour, shape and direction (4) for videos, whose 8 frames are stacked as channels after a
per-frame convolution (see _build). Trained on first use: fixed seed, 300 steps of 128 from
a pool of 4096 drawings with fresh noise, uint8 quantisation and reward-hack negatives every
step (see _augment); about 10 s (images) and 20 s (videos) on one CPU core. Cached as

    $REGEN_CACHE/adherence/{kind}-v{VERSION}-s{steps}-seed{seed}.safetensors  (weights)
    $REGEN_CACHE/adherence/{kind}-v{VERSION}-s{steps}-seed{seed}.json         (version, settings,
        held-out accuracy, training time, SHA-256 of the weights)

($REGEN_CACHE defaults to ~/.cache/regen.) A cache that cannot be read or does not match
its checksum is retrained with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from regen.rewards.base import Sample, register

VERSION = "1"  # bump on any change to the architecture, the training data or the score
HEADS = {"image": (("colour", 4), ("shape", 3), ("position", 5)),
         "video": (("colour", 4), ("shape", 3), ("direction", 4))}
STATS = {"trained": 0, "loaded": 0}  # counters, so tests can tell a cache hit from a retrain
_MEMO: dict[str, Any] = {}  # cache file -> (model, info): one load per process


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    return Path(root or os.environ.get("REGEN_CACHE") or "~/.cache/regen").expanduser() / "adherence"


def _values(kind: str) -> dict[str, list[str]]:
    """Each attribute's class names, in head order."""
    from regen.tasks import shapes

    return shapes.vocabulary(kind)


def _build(kind: str):
    """Plain Sequential (no custom class): its state dict is all the cache has to hold. No
    normalisation layers, so a sample's score does not depend on its batch. Max-pooling, not
    strided convolutions: it keeps the corners that tell a circle from a square at r = 3 px
    (shape accuracy after 300 steps 0.997-0.999 against 0.91 with strides).

    Videos: one 3x3 convolution shared by all frames, then the frames' features stacked as
    channels. Stacking raw frames as the first layer's input learns shapes from one eighth as
    many examples per filter and stalled at 0.88 shape accuracy on two of four seeds at 300
    steps (>= 0.997 this way); the direction head is right either way.
    """
    from torch import nn

    out = sum(n for _, n in HEADS[kind])
    if kind == "image":
        front, c = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)], 32  # 8x8
    else:
        frames = _media_shape(kind)[0]
        front = [nn.Flatten(0, 1),  # (N * F, 3, H, W): every frame through the same filters
                 nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                 nn.Unflatten(0, (-1, frames)), nn.Flatten(1, 2)]  # (N, F * 8, 8, 8)
        c = 8 * frames
    return nn.Sequential(
        *front,
        nn.Conv2d(c, 48, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 4x4: position survives the flatten
        nn.Conv2d(48, 64, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 16, 96), nn.ReLU(), nn.Linear(96, out),
    )


def _media_shape(kind: str) -> tuple[int, ...]:
    """What the classifier reads: the shapes task's uint8 image (H, W, C) or video (F, H, W, C)."""
    from regen.tasks import shapes

    return (shapes.RES, shapes.RES, 3) if kind == "image" else (shapes.FRAMES, shapes.RES, shapes.RES, 3)


def _draw(kind: str, n: int, g) -> tuple:
    """n drawings of random prompts (all 60 image / 48 video combinations, held-out ones
    included: this is a judge, not the policy) in [-1, 1], and one-hot targets per head."""
    import torch

    from regen.tasks import shapes

    vals = _values(kind)
    idx = {a: torch.randint(len(v), (n,), generator=g) for a, v in vals.items()}
    metas = [{a: vals[a][int(idx[a][i])] for a in vals} for i in range(n)]
    targets = {a: torch.nn.functional.one_hot(idx[a], len(v)).float() for a, v in vals.items()}
    return shapes.draw(metas, generator=g), targets


def _augment(kind: str, x, targets: dict, g, noise: float, negatives: bool) -> tuple:
    """Network input and soft targets from clean drawings (copied, not modified).

    With `negatives`, 1/8 of the batch are frames without a proper shape (one flat colour,
    plain background, noise) whose targets are uniform on every head: those are exactly the
    reward hacks seen in RL (a solid colour, an empty frame), and without them the classifier would answer confidently on
    inputs it never saw. For videos another 1/8 are static (one frame repeated): right colour
    and shape, uniform direction, so a video that does not move is not credited with a
    direction. Gaussian noise of a per-sample std in [0, noise] covers clean and imperfect
    samples alike.
    """
    import torch

    x, targets, n = x.clone(), {a: t.clone() for a, t in targets.items()}, len(x)  # callers keep theirs
    if negatives:
        k = n // 8
        flat = torch.rand(k, 3, generator=g) * 2 - 1
        flat[: k // 4] = -1.0  # plain background: the "black image" JPEG hack
        neg = flat.view(k, *([1] * (x.dim() - 4)), 3, 1, 1).expand_as(x[:k]).clone()
        neg[k // 2:] += torch.randn(neg[k // 2:].shape, generator=g) * 0.5  # noise frames
        x[:k] = neg
        for t in targets.values():
            t[:k] = 1.0 / t.shape[1]
        if kind == "video":
            x[k:2 * k] = x[k:2 * k, :1].expand_as(x[k:2 * k])
            targets["direction"][k:2 * k] = 1.0 / targets["direction"].shape[1]
    if noise > 0:
        x = x + torch.randn(x.shape, generator=g) * torch.rand(n, generator=g).mul(noise).view(-1, *[1] * (x.dim() - 1))
    x = ((x.clamp(-1, 1) + 1) * 127.5).round() / 127.5 - 1  # what decoding a uint8 sample gives
    return x, targets


def _split_heads(logits, kind: str) -> dict:
    return dict(zip([a for a, _ in HEADS[kind]], logits.split([n for _, n in HEADS[kind]], dim=1)))


def accuracy(model, kind: str, n: int = 1024, seed: int = 12345, noise: float = 0.0) -> dict[str, float]:
    """Fraction of fresh clean drawings (another seed than training) whose every head is
    right ('all'), and each head's accuracy."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x, targets = _augment(kind, *_draw(kind, n, g), g, noise=noise, negatives=False)
    with torch.no_grad():
        heads = _split_heads(model(x), kind)
    right = {a: heads[a].argmax(1) == targets[a].argmax(1) for a in heads}
    out = {a: float(r.float().mean()) for a, r in right.items()}
    out["all"] = float(torch.stack(list(right.values())).all(0).float().mean())
    return out


def train(kind: str, steps: int = 300, batch: int = 128, seed: int = 0, lr: float = 1e-2, pool: int = 4096):
    """Train a fresh classifier; returns (model, info). Leaves the global RNG untouched, so a
    run that trains it on its first reward call keeps its exact-resume random streams.

    Minibatches come from a pool drawn once: shapes.draw renders one sample at a time and
    fresh drawings every step cost 40% of the training time, for the same accuracy.
    """
    import torch

    t0 = time.perf_counter()
    # enable_grad: the first reward call may come from inside a no_grad evaluation
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(seed)
        model = _build(kind)
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        # one-cycle at 1e-2: 300 steps at a flat 3e-3 left the shape head at 0.91
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15)
        pool_x, pool_t = _draw(kind, pool, g)
        for _ in range(steps):
            i = torch.randint(pool, (batch,), generator=g)
            x, targets = _augment(kind, pool_x[i], {a: t[i] for a, t in pool_t.items()}, g, noise=0.3, negatives=True)
            heads = _split_heads(model(x), kind)
            loss = sum(torch.nn.functional.cross_entropy(heads[a], targets[a]) for a in heads)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    STATS["trained"] += 1
    info = {"version": VERSION, "kind": kind, "steps": steps, "batch": batch, "seed": seed,
            "train_s": round(time.perf_counter() - t0, 2), "heldout_accuracy": accuracy(model, kind)}
    return model, info


def load(kind: str, steps: int = 300, seed: int = 0, root: str | os.PathLike | None = None):
    """The cached classifier (model, info), trained and cached first if there is none or it
    is unreadable."""
    stem = cache_dir(root) / f"{kind}-v{VERSION}-s{steps}-seed{seed}"
    if str(stem) in _MEMO:
        return _MEMO[str(stem)]
    weights, meta = stem.with_suffix(".safetensors"), stem.with_suffix(".json")
    got = None
    if meta.exists() or weights.exists():
        try:
            got = _read(kind, weights, meta)
        except Exception as e:  # noqa: BLE001  (any unreadable cache means the same thing: retrain)
            warnings.warn(f"adherence classifier cache {weights} is unreadable ({e}); retraining", stacklevel=2)
    if got is None:
        got = train(kind, steps=steps, seed=seed)
        try:
            _write(got[0], got[1], weights, meta)
        except OSError as e:  # a read-only or full disk costs a retrain next time, not the run
            warnings.warn(f"cannot cache the adherence classifier in {weights.parent}: {e}", stacklevel=2)
    _MEMO[str(stem)] = got
    return got


def _read(kind: str, weights: Path, meta: Path):
    from safetensors.torch import load_file

    info = json.loads(meta.read_text())
    if info.get("version") != VERSION or info.get("kind") != kind:
        raise ValueError(f"cache is version {info.get('version')} {info.get('kind')}, want {VERSION} {kind}")
    if hashlib.sha256(weights.read_bytes()).hexdigest() != info.get("sha256"):
        raise ValueError("weights do not match the checksum in the JSON")
    model = _build(kind)
    model.load_state_dict(load_file(str(weights)), strict=True)
    model.eval()
    STATS["loaded"] += 1
    return model, info


def _write(model, info: dict, weights: Path, meta: Path) -> None:
    """Weights first, JSON (holding their checksum) last, each via a temporary name and a
    rename: a reader never sees a half-written file, and the JSON marks a complete pair."""
    from safetensors.torch import save_file

    weights.parent.mkdir(parents=True, exist_ok=True)
    tmp = weights.with_name(f".{weights.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    info["sha256"] = hashlib.sha256(tmp.read_bytes()).hexdigest()
    os.replace(tmp, weights)
    tmp = meta.with_name(f".{meta.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, meta)


class _Classifier:
    """Shared by both registered rewards: per-sample head probabilities of the prompted attributes."""

    def __init__(self, steps: int = 300, seed: int = 0, cache: str | None = None):
        self.steps, self.seed, self.cache = steps, seed, cache
        # the trained weights depend on steps and seed, so they are part of the version
        self.reward_version = f"{VERSION}-s{steps}-seed{seed}"

    def probs(self, samples: list[Sample]) -> list[dict[str, float] | None]:
        """For each sample: {attribute: probability of the prompted value}; None when it has
        no media, media of another shape than the task's, or neither a meta with its attributes
        nor a prompt in the painter's words (regen.tasks.shapes.parse_prompt) to read them from."""
        import numpy as np
        import torch

        out: list[dict[str, float] | None] = [None] * len(samples)
        todo: dict[str, list[tuple[int, np.ndarray, list[int]]]] = {"image": [], "video": []}
        from regen.tasks.shapes import parse_prompt

        for i, s in enumerate(samples):
            kind = {3: "image", 4: "video"}.get(getattr(s.media, "ndim", 0))
            vals = _values(kind) if kind else {}
            meta = s.meta
            if kind and not any(a in meta for a in vals):  # no attributes given: the prompt's own words
                meta = parse_prompt(s.prompt, kind) or {}
            want = [vals[a].index(meta[a]) if meta.get(a) in vals[a] else -1 for a in vals]
            if kind and -1 not in want and tuple(s.media.shape) == _media_shape(kind):
                todo[kind].append((i, np.asarray(s.media), want))
        for kind, rows in todo.items():
            if not rows:
                continue
            model, _ = load(kind, self.steps, self.seed, self.cache)
            x = torch.from_numpy(np.stack([r[1] for r in rows])).float().div(127.5).sub(1).movedim(-1, -3)
            with torch.no_grad():
                heads = {a: h.softmax(1) for a, h in _split_heads(model(x), kind).items()}
            for j, (i, _, want) in enumerate(rows):
                out[i] = {a: float(heads[a][j, w]) for a, w in zip(heads, want)}
        return out


@register("adherence", version=VERSION, kind="scalar", factory=True)
class Adherence(_Classifier):
    """Prompt adherence of shapes images/videos in [0, 1]: mean over heads of the prompted attribute's probability.

    args: steps (300) and seed (0) of the classifier's training, cache (default $REGEN_CACHE).
    The prompt is read from Sample.meta (colour, shape, position or direction) or, when meta has
    none of them, from the prompt text if it is in the painter's words ("a red circle at the
    left": a joint run's painter judged against its rewrite); a sample without media, or whose
    attributes are neither, is missing (None).
    """

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        return [None if p is None else sum(p.values()) / len(p) for p in self.probs(samples)]


@register("adherence_accuracy", version=VERSION, kind="binary", factory=True)
class AdherenceAccuracy(_Classifier):
    """1.0 when the adherence classifier gives every prompted attribute probability > 0.5, else 0.0.

    More than a half makes it the argmax and excludes the near-uniform answers given to
    shapeless frames (whose argmax is a coin toss). Same args as `adherence`; meant to be
    logged beside the optimised reward (weight 0).
    """

    def __call__(self, samples: list[Sample]) -> list[float | None]:
        return [None if p is None else float(all(v > 0.5 for v in p.values())) for p in self.probs(samples)]


@register("adherence_judge", version=VERSION, kind="pairwise", factory=True)
class AdherenceJudge(_Classifier):
    """A pairwise judge for the built-in shapes: compares two images (videos) of the same prompt and
    says which the adherence classifier finds closer to it: 1.0 when the first is, 0.0 when the second
    is, 0.5 when their `adherence` differs by no more than `tie` (0.02). Use it under `pairwise`
    ({name: pairwise, args: {of: adherence_judge}}) with algorithm.reward_type=pairwise; it stands for
    a judge model shown two samples. Other args as `adherence`."""

    def __init__(self, tie: float = 0.02, steps: int = 300, seed: int = 0, cache: str | None = None):
        super().__init__(steps, seed, cache)
        self.tie = float(tie)

    def __call__(self, first: list[Sample], second: list[Sample]) -> list[float | None]:
        probs = self.probs([*first, *second])
        score = [None if p is None else sum(p.values()) / len(p) for p in probs]
        a, b = score[: len(first)], score[len(first):]
        return [None if x is None or y is None else 1.0 if x - y > self.tie else 0.0 if y - x > self.tie else 0.5
                for x, y in zip(a, b)]
