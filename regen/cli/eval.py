"""`regen eval`: score a checkpoint, a run or an exported model on held-out prompts.

SOURCE is one of
  - a run directory: its newest valid checkpoint, else its export/; settings from its config.yaml
    (a joint run's, config `models:`: the pipeline of its models, regen/cli/eval_joint.py)
  - a checkpoint folder (RUN/checkpoints/step_NNNNNNNN): verified, LoRA adapters merged into
    their base; settings from the run's config.yaml when it sits in a run directory
  - a model folder (an export/, any Hugging Face causal LM) or a hub id: built-in defaults
Flags given on the command line win over the config's settings. The result (metrics, the
settings used, every sample) goes to --out, by default RUN/eval/eval_<checkpoint>.json.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from regen.errors import UserError

# The defaults `regen eval` always had, used when no config gives a value.
DEFAULTS = {"data": "builtin:arithmetic:test", "num_prompts": 500, "samples_per_prompt": 4, "temperature": 1.0,
            "top_p": 1.0, "max_new_tokens": 8, "seed": 0, "digits": 2, "test_size": 500, "batch_size": 256,
            "also_greedy": False, "columns": {}}
FLAGS = ("data", "num_prompts", "samples_per_prompt", "temperature", "top_p", "max_new_tokens", "seed",
         "digits", "test_size")


@dataclass
class Source:
    model_dir: Path | str  # HF folder, LoRA adapter folder, or hub id
    label: str  # checkpoint name ('step_00000300'), 'export', or the folder's name
    run_dir: Path | None  # where config.yaml is read and eval/ is written


def resolve_source(src: str) -> Source:
    from regen.policies.lm_load import _looks_local
    from regen.runtime import checkpoint as ckpt

    p = Path(src).expanduser()
    if not p.exists():
        if _looks_local(src):
            raise UserError(f"eval: '{src}' not found")
        return Source(src, src.replace("/", "_"), None)  # a hub id, where a network exists
    if not p.is_dir():
        raise UserError(f"eval: '{src}' is a file, not a run directory, checkpoint or model folder")
    if (p / "manifest.json").is_file():  # one checkpoint
        ckpt.verify(p)
        in_run = p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file()
        run = p.parent.parent if in_run else None
        return Source(p / "model", p.name, run)
    if (p / "checkpoints").is_dir() or (p / "config.yaml").is_file():  # a run directory
        folder, warnings = ckpt.latest_valid(p)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        if folder is not None:
            return Source(folder / "model", folder.name, p)
        if is_model_folder(p / "export"):
            return Source(p / "export", "export", p)
        raise UserError(f"eval: run directory '{src}' has no valid checkpoint and no export/")
    if is_model_folder(p):
        return Source(p, p.resolve().name, None)
    raise UserError(f"eval: '{src}' is not a run directory, checkpoint or model folder (no checkpoints/, "
                    "manifest.json, config.json, adapter_config.json, flow_policy.json or model_index.json in it)")


# what marks a model folder: transformers (config.json), a PEFT adapter, a regen flow model (flow_policy.json:
# the shapes models, a flow run's export/), a diffusers pipeline (model_index.json)
MODEL_MARKERS = ("config.json", "adapter_config.json", "flow_policy.json", "model_index.json")


def is_model_folder(p: Path) -> bool:
    return any((p / name).is_file() for name in MODEL_MARKERS)


def load_run_config(path: Path, max_new_tokens: int | None):
    """The run's config (RLConfig, or SFTConfig for an SFT run), validated like at training."""
    from regen.config import RLConfig, SFTConfig, load_config

    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        tree = None  # load_config below names the problem
    tree = tree if isinstance(tree, dict) else {}
    overrides = []
    # config.yaml written before redact() learned that a count of tokens is no secret
    if (tree.get("rollout") or {}).get("max_new_tokens") == "<redacted>":
        if max_new_tokens is None:
            raise UserError(f"eval: '{path}' has rollout.max_new_tokens redacted (written by an older regen); "
                            "pass --max-new-tokens N")
        overrides.append(f"rollout.max_new_tokens={max_new_tokens}")
    # a run's own config: older runs wrote every key, including those their method did not read
    return load_config(SFTConfig if "sft" in tree else RLConfig, str(path), overrides, refuse_unread=False)


def _reward_args(given: list[str] | None, i: int) -> dict:
    """The i-th --reward-args (a YAML mapping), or {}."""
    if not given or i >= len(given):
        return {}
    try:
        args = yaml.safe_load(given[i])
    except yaml.YAMLError as e:
        raise UserError(f"--reward-args '{given[i]}': not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(args, dict):
        raise UserError(f"--reward-args '{given[i]}': must be a mapping such as '{{pattern: \"[0-9]+\"}}'")
    return args


def settings(args, cfg) -> tuple[dict[str, Any], list]:
    """(sampling settings, reward terms): flags, else the config's, else DEFAULTS."""
    s = dict(DEFAULTS)
    if cfg is not None:
        e, r = cfg.eval, cfg.rollout
        s |= {"num_prompts": e.num_prompts, "samples_per_prompt": e.samples_per_prompt,
              "temperature": e.temperature or r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
              "seed": cfg.run.seed, "digits": cfg.task.digits, "test_size": cfg.task.test_size,
              "batch_size": e.batch_size, "also_greedy": e.greedy, "columns": getattr(cfg.data, "columns", {})}
        if cfg.data.eval is None and args.data is None:
            raise UserError("eval: the config has data.eval: null; pass --data with the held-out prompts")
        s["data"] = cfg.data.eval or s["data"]
    for flag in FLAGS:
        if getattr(args, flag) is not None:
            s[flag] = getattr(args, flag)
    for flag in ("num_prompts", "samples_per_prompt", "max_new_tokens"):
        if s[flag] < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    if s["temperature"] <= 0 or not 0 < s["top_p"] <= 1:
        raise UserError("--temperature must be > 0 and --top-p in (0, 1]")
    return s, reward_terms(args, cfg)


def reward_terms(args, cfg) -> list:
    """The config's reward terms, or those named by --reward / --reward-args."""
    from regen.config import RewardTerm

    terms = list(getattr(cfg, "reward", [])) if cfg is not None else []
    if args.reward_args and len(args.reward_args) > len(args.reward or []):
        raise UserError("--reward-args: each one goes with the --reward before it (more --reward-args than --reward)")
    if args.reward:  # rewards named on the command line replace the config's
        terms = [RewardTerm(name=n, args=_reward_args(args.reward_args, i)) for i, n in enumerate(args.reward)]
    for i, t in enumerate(terms):  # config.yaml is written redacted: such an arg cannot be used
        for k, v in t.args.items():
            if v == "<redacted>":
                raise UserError(f"eval: reward.{i}.args.{k} is redacted in the run's config.yaml; pass --config "
                                "with the original file, or --reward")
    return terms


def eval_settings(args, cfg):
    """The run's eval section (metrics, reference, features, gates) with the flags applied, validated."""
    from pydantic import ValidationError

    from regen.config import EvalConfig

    e = cfg.eval.model_dump() if cfg is not None else {}
    if args.metrics is not None:
        e["metrics"] = [m.strip() for m in args.metrics.split(",") if m.strip()]
    for flag in ("reference", "features", "clip_model", "metric_samples"):
        if getattr(args, flag) is not None:
            e[flag] = getattr(args, flag)
    try:
        return EvalConfig(**e)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise UserError(f"eval: {where}: {first['msg'].removeprefix('Value error, ')}") from None


def load_policy(source: Source, task, seed: int, device: str):
    from regen.config import ModelConfig
    from regen.policies.lm import LMPolicy, load_model_and_tokenizer, resolve_device

    d = source.model_dir
    if isinstance(d, Path) and (d / "adapter_config.json").is_file():  # LoRA: merge into its base
        try:
            from peft import AutoPeftModelForCausalLM
            from transformers import AutoTokenizer
        except ImportError:
            raise UserError("eval: this checkpoint holds a LoRA adapter; merging it needs peft "
                            "(pip install 'regen[lora]')") from None
        try:
            model = AutoPeftModelForCausalLM.from_pretrained(str(d)).merge_and_unload()
            tok = AutoTokenizer.from_pretrained(str(d))
        except (OSError, ValueError) as e:
            raise UserError(f"eval: cannot load the adapter's base model: {str(e).splitlines()[0]}") from None
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    else:
        model, tok = load_model_and_tokenizer(ModelConfig(path=str(d)), task, seed)
    policy = LMPolicy(model, tok, resolve_device(device))
    policy.model.eval()
    return policy


class _PartsRecorder:
    """The combined reward, keeping each term's per-sample scores for the rows and the table."""

    def __init__(self, reward):
        self.reward, self.parts = reward, {}

    def __call__(self, samples):
        total, parts = self.reward(samples)
        for name, scores in parts.items():
            self.parts.setdefault(name, []).extend(scores)
        return total, parts


def run(args) -> dict:
    from regen.config import TaskConfig
    from regen.data import load_prompts
    from regen.modalities.lm_eval import evaluate, evaluate_with_samples
    from regen.quality import Quality, gates
    from regen.rewards import CombinedReward

    given = args.source or args.model
    if given is None:
        raise UserError("eval: give a run directory, checkpoint or model folder (SOURCE or --model)")
    if args.source and args.model and args.source != args.model:
        raise UserError("eval: give SOURCE or --model, not both")
    from regen.cli.eval_joint import joint_names, run_joint

    p = Path(given).expanduser()
    names = joint_names(p) if p.is_dir() else []
    if names:  # a joint run (models:) or one of its checkpoints: the pipeline, as its own evaluations
        return run_joint(args, given, p, names)
    source = resolve_source(given)
    config_path = Path(args.config) if args.config else (source.run_dir / "config.yaml" if source.run_dir else None)
    if args.config and not config_path.is_file():
        raise UserError(f"--config: '{args.config}' not found")
    has_config = config_path is not None and config_path.is_file()
    cfg = load_run_config(config_path, args.max_new_tokens) if has_config else None
    e = eval_settings(args, cfg)
    from regen.cli.eval_flow import is_flow_source, run_flow

    if is_flow_source(source, cfg):
        result = run_flow(args, source, cfg, config_path, reward_terms(args, cfg), e)
        from regen.runtime.loggers import public_config

        result["settings"]["rewards"] = public_config(result["settings"]["rewards"])
        result["metrics"] = {k: _num(v) for k, v in result["metrics"].items()}
        result["_default_out"] = source.run_dir / "eval" / f"eval_{source.label}.json" if source.run_dir else None
        return result
    s, terms = settings(args, cfg)
    task = TaskConfig(digits=s["digits"], test_size=s["test_size"])
    extra = {"columns": s["columns"]} if s["columns"] else {}
    chat = cfg is not None and cfg.data.chat_template
    items = load_prompts(s["data"], task, "--data", chat=chat, **extra)[: s["num_prompts"]]
    if not items:
        raise UserError(f"--data: no prompts in '{s['data']}'")
    reward = _PartsRecorder(CombinedReward.from_config(terms)) if terms else None
    policy = load_policy(source, task, s["seed"], args.device)
    sampler = policy
    if cfg is not None:  # the run's chat template, stop tokens and environment, as in its own evaluations
        from regen.data.chat import render
        from regen.policies.lm import configure_prompts
        from regen.policies.lm_episodes import episode_engine

        configure_prompts(policy, cfg)
        sampler = episode_engine(cfg, policy) or policy  # env: whole multi-turn episodes
        tools = getattr(sampler, "tools", None)
        items = render(items, policy.tokenizer, cfg.data.system_prompt, "--data", tools) if chat else items
    n = 1 if args.greedy else s["samples_per_prompt"]
    common = {"top_p": s["top_p"], "max_new_tokens": s["max_new_tokens"], "batch_size": s["batch_size"],
              "seed": s["seed"]}
    quality = Quality(e, "lm", s["seed"])
    metrics, rows = evaluate_with_samples(sampler, items, temperature=s["temperature"], samples_per_prompt=n,
                                          greedy=args.greedy, reward=reward, keep=len(items) * n, quality=quality,
                                          **common)
    if reward is not None:
        for name, scores in reward.parts.items():
            finite = [x for x in scores if math.isfinite(x)]
            metrics[f"reward/{name}"] = sum(finite) / len(finite) if finite else math.nan
            for row, x in zip(rows, scores):
                row.setdefault("rewards", {})[name] = x if math.isfinite(x) else None
    if s["also_greedy"] and not args.greedy:  # the run's eval.greedy: greedy accuracy too, as in training
        greedy = evaluate(sampler, items, temperature=1.0, greedy=True, **common)
        if "accuracy" in greedy:
            metrics["greedy_accuracy"] = greedy["accuracy"]
    checked = gates.check(e.gates, {f"eval/{k}": v for k, v in metrics.items()})
    metrics |= {k.removeprefix("eval/"): v for k, v in checked.items()}
    used = {"source": given, "model": str(source.model_dir), "checkpoint": source.label,
            "config": str(config_path) if cfg is not None else None, "data": s["data"], "num_prompts": len(items),
            "samples_per_prompt": n, "temperature": s["temperature"], "top_p": s["top_p"],
            "max_new_tokens": s["max_new_tokens"], "greedy": bool(args.greedy), "seed": s["seed"],
            "rewards": [t.model_dump(mode="json") for t in terms], "metrics": list(e.metrics), "gates": dict(e.gates)}
    from regen.runtime.loggers import public_config  # rewards' args: no secret goes into the file

    used["rewards"] = public_config(used["rewards"])
    return {"metrics": {k: _num(v) for k, v in metrics.items()}, "settings": used, "samples": rows,
            "_default_out": source.run_dir / "eval" / f"eval_{source.label}.json" if source.run_dir else None}


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None  # JSON has no NaN


def print_table(result: dict, show: int) -> None:
    s, m = result["settings"], result["metrics"]
    print(f"model   {s['model']}")
    if "models" in s:  # a joint run
        how = f"images: {s['models'][0]}'s greedy rewrite, {s['models'][-1]}'s ODE samples ({s['eval_steps']} steps)"
    elif "eval_steps" in s:  # a flow model
        how = f"ODE samples ({s['eval_steps']} steps)"
    else:
        how = "greedy" if s["greedy"] else f"samples at temperature {s['temperature']:g}"
    print(f"data    {s['data']}: {s['num_prompts']} prompts x {s['samples_per_prompt']} {how}, seed {s['seed']}")
    first = [k for k in ("accuracy", "greedy_accuracy", "reward") if k in m]
    parts = sorted(k for k in m if k.startswith("reward/"))
    keys = first + parts + sorted(set(m) - set(first) - set(parts))
    width = max([len("metric"), *map(len, keys)])
    print(f"\n{'metric':<{width}}  value")
    for k in keys:
        print(f"{k:<{width}}  {'n/a' if m[k] is None else f'{m[k]:.4f}'}")
    rows = result["samples"][:show]
    if rows:
        print(f"\nsamples (first {len(rows)} of {len(result['samples'])}):")
        for r in rows:
            reward = "  -  " if r.get("reward") is None else f"{r['reward']:.3f}"
            answer = f"  answer {json.dumps(r['answer'], ensure_ascii=False)}" if "answer" in r else ""
            shown = f" -> {_short(r['completion'])}" if "completion" in r else ""
            shown = f" -> rewrite {_short(r['rewrite'])}" if "rewrite" in r else shown
            print(f"  reward {reward}  {_short(r['prompt'])}{shown}{answer}")
            if "turns" in r:  # a multi-turn episode: the whole transcript
                print(transcript(r, indent="      "))


def transcript(row: dict, indent: str = "") -> str:
    """An episode's turns and observations in order, each on its own line, labelled."""
    lines = []
    for i, turn in enumerate(row["turns"]):
        lines.append(f"{indent}[model] {_short(turn, 200)}")
        obs = row["observations"][i] if i < len(row["observations"]) else ""
        if obs:
            lines.append(f"{indent}[env]   {_short(obs, 200)}")
    tail = [f"{row['tool_calls']} tool call(s)", f"{row['tool_errors']} error(s)"] + (["truncated"] if row["truncated"] else [])
    return "\n".join(lines + [f"{indent}({', '.join(tail)})"])


def _short(text: str, limit: int = 60) -> str:
    return json.dumps(text if len(text) <= limit else text[: limit - 3] + "...", ensure_ascii=False)


def write_json(result: dict, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)  # a reader never sees half a file
    except OSError as e:
        raise UserError(f"--out: cannot write '{path}': {e.strerror or e}") from None


def cmd_eval(args) -> int:
    result = run(args)
    default_out = result.pop("_default_out")
    out = Path(args.out) if args.out else default_out
    media = result.pop("_media", None)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print_table(result, args.show)
    if out is not None:
        write_json(result, out)
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
        if media is not None:
            from regen.cli.eval_flow import write_grid

            grid = write_grid(media, out)
            print(f"wrote {grid}", file=sys.stderr if args.json else sys.stdout)
    return 0

