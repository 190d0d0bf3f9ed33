"""`regen eval` of a joint run (config `models:`): the pipeline on held-out prompts, as the run's own
evaluations do it (regen/modalities/joint.py, JointModality.evaluate): the enhancer's greedy rewrite
of each prompt, the painter's ODE samples of the rewrite on the run's held-out noise, every image
scored against the user's prompt. SOURCE is the run directory (its newest valid checkpoint, else
export/ENHANCER and export/PAINTER) or one of its checkpoints; the run's config.yaml (or --config)
gives the models, the eval settings and the rewards; --data, --num-prompts, --samples-per-prompt,
--seed and --reward override them. One model alone: regen eval RUN/export/NAME."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

from regen.errors import UserError

# flags that set how one language model samples, or the arithmetic task: the pipeline's rewrite is
# greedy with the enhancer's own settings, so these would be ignored
NOT_READ = ("temperature", "top_p", "max_new_tokens", "digits", "test_size", "metrics", "reference", "features",
            "clip_model", "metric_samples")


def joint_names(p: Path) -> list[str]:
    """The models of a joint run directory or checkpoint folder ([] for anything else)."""
    import yaml

    if (p / "manifest.json").is_file():  # a checkpoint: one folder per model, each with its model/
        return sorted(q.name for q in p.iterdir() if (q / "model").is_dir()) if not (p / "model").exists() else []
    if (p / "config.yaml").is_file():
        try:
            tree = yaml.safe_load((p / "config.yaml").read_text())
        except yaml.YAMLError:
            return []  # load_run_config names the problem
        if isinstance(tree, dict) and isinstance(tree.get("models"), dict):
            return sorted(tree["models"])
    return []


def run_joint(args, given: str, p: Path, names: list[str]) -> dict:
    """The result dict of `regen eval` for a joint run directory or checkpoint `p`."""
    from regen.config import RLConfig, load_config
    from regen.runtime import checkpoint as ckpt

    used_flags = [f"--{f.replace('_', '-')}" for f in NOT_READ if getattr(args, f, None) is not None]
    used_flags += ["--greedy"] if args.greedy else []
    if used_flags:
        raise UserError(f"eval: {', '.join(used_flags)} not read for a joint run ({given}: models "
                        f"{', '.join(names)}): its enhancer rewrites greedily with its own settings and its painter "
                        "samples with the ODE (flow.eval_steps); evaluate one model with regen eval RUN/export/NAME")
    # the checkpoint loaded once (load_checkpoint verifies its checksums): a run's newest valid one
    state = None
    if (p / "manifest.json").is_file():
        state, run_dir = ckpt.load_checkpoint(p), p.parent.parent
    else:
        run_dir = p
        if ckpt.list_checkpoints(p):
            try:
                state = ckpt.load_latest(p, warn=lambda m: print(m, file=sys.stderr))
            except UserError:
                state = None  # none valid: the export below
    config_path = Path(args.config) if args.config else run_dir / "config.yaml"
    if not config_path.is_file():
        raise UserError(f"eval: '{given}' is a joint run's checkpoint without its run's config.yaml beside it "
                        f"({config_path} not found); pass --config with the run's config")
    overrides = [f"data.eval={args.data}"] if args.data else []
    for flag, key in (("num_prompts", "eval.num_prompts"), ("samples_per_prompt", "eval.samples_per_prompt"),
                      ("seed", "run.seed")):
        value = getattr(args, flag)
        if value is not None:
            if flag != "seed" and value < 1:
                raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
            overrides.append(f"{key}={value}")
    label = "export" if state is None else state["folder"].name
    if state is None:  # no checkpoint: the exported models
        for n in names:
            if not (run_dir / "export" / n).is_dir():
                raise UserError(f"eval: joint run '{given}' has no valid checkpoint and no export/{n}")
            overrides.append(f"models.{n}.model.path={run_dir / 'export' / n}")
    cfg = load_config(RLConfig, str(config_path), overrides, refuse_unread=False)
    if sorted(cfg.models or {}) != names:
        raise UserError(f"eval: '{config_path}' is not this joint run's config (its models: "
                        f"{', '.join(sorted(cfg.models or {})) or 'none'}; the run's: {', '.join(names)})")
    if cfg.data.eval is None:
        raise UserError("eval: the config has data.eval: null; pass --data with the held-out prompts")
    return _evaluate(args, given, cfg, state, label, config_path, run_dir)


def _evaluate(args, given, cfg, state, label, config_path, run_dir) -> dict:
    from regen.cli.eval import reward_terms
    from regen.data import load_prompts
    from regen.modalities.joint import JointModality
    from regen.policies.lm import resolve_device
    from regen.rewards import CombinedReward
    from regen.runtime.dist import Dist
    from regen.runtime.loggers import public_config

    terms = reward_terms(args, cfg)
    if not terms:
        raise UserError("eval: no reward terms in the config; pass --reward")
    items = load_prompts(cfg.data.eval, cfg.task, "--data")[: cfg.eval.num_prompts]
    if not items:
        raise UserError(f"--data: no prompts in '{cfg.data.eval}'")
    try:
        m = JointModality(cfg, resolve_device(args.device), Dist(), state)
    except (OSError, ValueError, RuntimeError) as e:
        where = state["folder"] if state is not None else "the config's model paths"
        raise UserError(f"eval: cannot load the joint run's models from {where} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    step = int(state["state"].get("step", 0)) if state is not None else 0
    with tempfile.TemporaryDirectory(prefix="regen-eval-") as tmp:  # the run's samples/ stay the run's
        metrics = m.evaluate(items, CombinedReward.from_config(terms), Path(tmp), step)
        kept = Path(tmp) / "samples" / f"step_{step:08d}.jsonl"
        rows = [json.loads(line) for line in kept.read_text().splitlines() if line.strip()] if kept.is_file() else []
    m.close()
    for r in rows:  # the images were in the temporary folder
        r.pop("image", None)
    metrics = {k.removeprefix("eval/"): v for k, v in metrics.items()}
    e = cfg.eval
    used = {"source": given, "model": ", ".join(f"{n}: {c.model.path}" for n, c in cfg.members.items())
            if state is None else str(state["folder"]), "checkpoint": label, "config": str(config_path),
            "data": cfg.data.eval, "num_prompts": len(items), "samples_per_prompt": e.samples_per_prompt,
            "seed": cfg.run.seed, "eval_steps": cfg.members[list(cfg.members)[-1]].flow.eval_steps,
            "models": list(cfg.members), "rewards": public_config([t.model_dump(mode="json") for t in terms])}
    return {"metrics": {k: v if math.isfinite(v) else None for k, v in metrics.items()}, "settings": used,
            "samples": rows, "_default_out": run_dir / "eval" / f"eval_{label}.json"}
