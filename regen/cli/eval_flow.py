"""`regen eval` of an image or video flow model (a flow run, one of its checkpoints, or an
export/): held-out prompts sampled with the ODE on fixed noise, each reward term, prompt
adherence for the built-in shapes prompts, eval.metrics (FID, KID, ...) and eval.gates; a grid
of the samples is written next to the JSON result."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from regen.errors import UserError

DEFAULTS = {"num_prompts": 12, "samples_per_prompt": 8, "seed": 0}
LM_ONLY = ("temperature", "top_p", "max_new_tokens", "digits", "test_size")  # flags that mean nothing here
GRID_LIMIT = 64


def is_flow_source(source, cfg) -> bool:
    if cfg is not None:
        return cfg.modality == "flow" or cfg.model.init in ("shapes-unet", "moving-shapes-unet")
    d = source.model_dir
    return isinstance(d, Path) and ((d / "flow_policy.json").is_file() or (d / "model_index.json").is_file())


def _policy(source, cfg, device, base: bool = False):
    from regen.config import ModelConfig
    from regen.modalities.flow_copies import build_policy
    from regen.policies.flow_load import load_flow_policy

    if cfg is not None:
        return build_policy(cfg, device, None if base else Path(source.model_dir))
    if base:
        raise UserError("eval: --reference base needs the run's config (the starting model is its model.path); "
                        "pass --config")
    return load_flow_policy(ModelConfig(path=str(source.model_dir)), 0, device)


def _settings(args, cfg) -> dict:
    from regen.config import EvalConfig, FlowConfig

    given = [f"--{f.replace('_', '-')}" for f in LM_ONLY if getattr(args, f) is not None] + \
        (["--greedy"] if args.greedy else [])
    if given:
        raise UserError(f"eval: {', '.join(given)} set how a language model samples; this is a flow model "
                        "(it samples with the ODE: flow.eval_steps, flow.shift, flow.guidance of the run's config)")
    e = cfg.eval if cfg is not None else EvalConfig(num_prompts=DEFAULTS["num_prompts"],
                                                    samples_per_prompt=DEFAULTS["samples_per_prompt"])
    f = cfg.flow if cfg is not None else FlowConfig()
    s = {"num_prompts": e.num_prompts, "samples_per_prompt": e.samples_per_prompt,
         "seed": cfg.run.seed if cfg is not None else DEFAULTS["seed"], "data": cfg.data.eval if cfg else None,
         "eval_steps": f.eval_steps, "shift": f.shift, "guidance": f.guidance}
    for flag in ("data", "num_prompts", "samples_per_prompt", "seed"):
        if getattr(args, flag) is not None:
            s[flag] = getattr(args, flag)
    for flag in ("num_prompts", "samples_per_prompt"):
        if s[flag] < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    return s


def run_flow(args, source, cfg, config_path, terms, e) -> dict:
    """The result dict of `regen eval` for a flow model (e: the EvalConfig with the flags applied)."""
    from regen.config import TaskConfig
    from regen.data import load_prompts
    from regen.modalities.flow import EVAL_SEED_OFFSET, to_samples
    from regen.policies.lm import resolve_device
    from regen.quality import Quality, gates
    from regen.rewards import CombinedReward

    s = _settings(args, cfg)
    device = resolve_device(args.device)
    policy = _policy(source, cfg, device)
    video = len(policy.sample_shape) == 4
    s["data"] = s["data"] or f"builtin:{'moving-shapes' if video else 'shapes'}:test"
    items = load_prompts(s["data"], TaskConfig(), "--data")[: s["num_prompts"]]
    if not items:
        raise UserError(f"--data: no prompts in '{s['data']}'")
    quality = Quality(e, "flow", s["seed"], device=str(device))
    reward = CombinedReward.from_config(terms) if terms else None
    n = s["samples_per_prompt"]

    def sample(p):
        gen = torch.Generator().manual_seed(s["seed"] + EVAL_SEED_OFFSET)  # the noise of the run's evaluations
        with torch.no_grad():
            out = p.sample_ode([it.prompt for it in items], n, gen, s["eval_steps"], s["shift"], s["guidance"])
        return to_samples(p, out, items, n)

    samples = sample(policy)
    metrics: dict[str, float] = {}
    rewards: list = [None] * len(samples)
    base = None
    if e.reference == "base" and quality or cfg is not None and cfg.algorithm.reward_type == "pairwise":
        base = sample(_policy(source, cfg, device, base=True))  # the starting model, same prompts and noise
    if e.reference == "base" and quality:
        quality.set_base(np.stack([x.media for x in base]))
    if reward is not None and cfg is not None and cfg.algorithm.reward_type == "pairwise":
        # as the run evaluates: each sample judged against the starting model's on the same prompt and
        # noise (a win rate within a group of its own samples would be 1/2 by symmetry)
        from regen.rewards import Sample

        pairs = [Sample(x.prompt, x.completion, {**x.meta, "pair": i}, x.finished, x.media)
                 for i, both in enumerate(zip(samples, base)) for x in both]
        total, parts = reward(pairs)
        total, parts = total[0::2], {k: v[0::2] for k, v in parts.items()}
        rewards = [None if t is None or not math.isfinite(t) else float(t) for t in total]
        metrics["reward"] = _mean(total)
        metrics |= {f"reward/{k}": _mean(v) for k, v in parts.items()}
    elif reward is not None:
        total, parts = reward(samples)
        rewards = [None if t is None or not math.isfinite(t) else float(t) for t in total]
        metrics["reward"] = _mean(total)
        metrics |= {f"reward/{k}": _mean(v) for k, v in parts.items()}
    if all("colour" in it.meta for it in items):
        from regen.rewards.adherence import AdherenceAccuracy

        metrics["adherence_accuracy"] = _mean(AdherenceAccuracy()(samples))
    metrics |= quality(samples, 0) if quality else {}
    checked = gates.check(e.gates, {f"eval/{k}": v for k, v in metrics.items()})
    metrics |= {k.removeprefix("eval/"): v for k, v in checked.items()}
    used = {"source": args.source or args.model, "model": str(source.model_dir), "checkpoint": source.label,
            "config": str(config_path) if cfg is not None else None, "data": s["data"], "num_prompts": len(items),
            "samples_per_prompt": n, "seed": s["seed"], "eval_steps": s["eval_steps"], "shift": s["shift"],
            "guidance": s["guidance"], "metrics": list(e.metrics), "reference": e.reference,
            "features": e.features, "gates": dict(e.gates), "rewards": [t.model_dump(mode="json") for t in terms]}
    rows = [{"prompt": x.prompt, "reward": r} for x, r in zip(samples, rewards)]
    media = np.stack([x.media for x in samples[:GRID_LIMIT]])
    return {"metrics": metrics, "settings": used, "samples": rows, "_media": media}


def _mean(values) -> float:
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def write_grid(media: np.ndarray, path: Path, per_row: int = 8) -> Path:
    """The samples tiled 8 to a row, small ones enlarged to 64 px: a PNG for images, an
    animated GIF (written beside, .gif) for videos."""
    from PIL import Image

    video = media.ndim == 5
    frames = media if video else media[:, None]  # (N, F, H, W, C)
    n, f, h, w, c = frames.shape
    up = max(1, 64 // h)
    rows = math.ceil(n / per_row)
    sheet = np.full((f, rows * (h + 1) * up, per_row * (w + 1) * up, c), 128, dtype=np.uint8)  # grey gaps
    for i in range(n):
        y, x = (i // per_row) * (h + 1) * up, (i % per_row) * (w + 1) * up
        big = frames[i].repeat(up, axis=1).repeat(up, axis=2)
        sheet[:, y: y + h * up, x: x + w * up] = big
    path = path.with_suffix(".gif" if video else ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    images = [Image.fromarray(fr) for fr in sheet]
    if video:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=120, loop=0)
    else:
        images[0].save(tmp, format="PNG")
    tmp.replace(path)
    return path
