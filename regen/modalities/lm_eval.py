"""Held-out evaluation: sample completions for prompts never trained on and score them.

`run_eval` can also keep the first few evaluated samples in the run directory
(samples/step_NNNNNNNN.jsonl) so a report shows what the model wrote, not only its numbers."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from regen.data import PromptItem
from regen.data.images import THUMB, first_image, png_data_uri
from regen.rewards import CombinedReward, Sample
from regen.rewards.builtin import exact_match
from regen.runtime import dist

EVAL_SEED_OFFSET = 7919  # eval draws from its own stream so it never shifts the training RNG
SAMPLES_KEPT = 16  # rows written per evaluation: enough to read, small enough for any run length


def evaluate(policy, items: list[PromptItem], **kw) -> dict[str, float]:
    """The metrics of `evaluate_with_samples` (same keyword arguments) without the samples."""
    return evaluate_with_samples(policy, items, **kw)[0]


@torch.no_grad()
def evaluate_with_samples(
    policy,
    items: list[PromptItem],
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    samples_per_prompt: int = 1,
    batch_size: int = 256,
    seed: int = 0,
    greedy: bool = False,
    reward: CombinedReward | None = None,
    keep: int = SAMPLES_KEPT,
    quality=None,
    step: int = 0,
) -> tuple[dict[str, float], list[dict]]:
    """`evaluate`, plus the first `keep` samples as JSON rows: prompt, completion, reward
    (combined; null when missing or when no reward is given), answer (when the prompt row
    has one) with `correct` (exact match), and finished (ended with EOS). `quality`
    (regen.quality.Quality) adds the eval.metrics of the same samples."""
    gen = torch.Generator(device=policy.device).manual_seed(seed + EVAL_SEED_OFFSET)
    n = 1 if greedy else samples_per_prompt
    samples: list[Sample] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        ro = policy.sample(policy.inputs(chunk), n, temperature, top_p, max_new_tokens, gen, greedy=greedy)
        fin = ro.finished.tolist()
        samples += [Sample(chunk[i // n].prompt, ro.completions[i], {**chunk[i // n].meta, **ro.row_meta(i)}, fin[i],
                           first_image(chunk[i // n].image)) for i in range(len(fin))]
    out = {"length": sum(len(s.completion) for s in samples) / max(len(samples), 1)}
    correct = exact_match(samples)
    if items and all("answer" in it.meta for it in items):
        out["accuracy"] = sum(correct) / len(samples)
    total: list = [None] * len(samples)
    if reward is not None:
        total, _ = reward(samples)
        finite = [t for t in total if t == t]
        out["reward"] = sum(finite) / len(finite) if finite else float("nan")
    eps = [s.meta["episode"] for s in samples if "episode" in s.meta]
    if eps:  # multi-turn episodes: how they went, beside how they scored
        out |= {"turns": sum(len(e["turns"]) for e in eps) / len(eps),
                "tool_calls": sum(e["tool_calls"] for e in eps) / len(eps),
                "tool_errors": sum(e["tool_errors"] for e in eps) / len(eps),
                "truncated_frac": sum(e["truncated"] for e in eps) / len(eps)}
    if quality:
        out |= quality(samples, step)
    rows = []
    for s, t, c in list(zip(samples, total, correct))[:keep]:
        row = {"prompt": s.prompt, "completion": s.completion,
               "reward": float(t) if t is not None and math.isfinite(t) else None}
        if "answer" in s.meta:
            row |= {"answer": s.meta["answer"], "correct": bool(c)}
        if "episode" in s.meta:  # a multi-turn episode: the whole transcript, turns and observations
            ep = s.meta["episode"]
            row |= {"turns": ep["turns"], "observations": ep["observations"], "tool_calls": ep["tool_calls"],
                    "tool_errors": ep["tool_errors"], "truncated": ep["truncated"]}
        if s.media is not None:  # a VLM's prompt image, small, for the report
            row["image"] = png_data_uri(s.media, THUMB)
        rows.append(row | {"finished": bool(s.finished)})
    return out, rows


def run_eval(
    policy, items: list[PromptItem], cfg, reward: CombinedReward | None,
    run_dir: Path | None = None, step: int | None = None, quality=None, task: str | None = None,
) -> dict[str, float]:
    """Evaluate with the run's eval/rollout settings; keys prefixed 'eval/'. Given a run
    directory and step, the first samples go to run_dir/samples/step_NNNNNNNN.jsonl (task: a
    multi-task run's task, whose rows join the other tasks' of that step)."""
    e, r = cfg.eval, cfg.rollout
    common = dict(top_p=r.top_p, max_new_tokens=r.max_new_tokens, batch_size=e.batch_size, seed=cfg.run.seed)
    items = items[: e.num_prompts]
    sampled, rows = evaluate_with_samples(
        policy, items, temperature=e.temperature or r.temperature, samples_per_prompt=e.samples_per_prompt,
        reward=reward, quality=quality, step=step or 0, **common,
    )
    if run_dir is not None and step is not None and dist.current().main:
        write_samples(Path(run_dir), step, rows, task)
    out = {f"eval/{k}": v for k, v in sampled.items()}
    if e.greedy:
        greedy = evaluate(policy, items, temperature=1.0, greedy=True, **common)
        if "accuracy" in greedy:
            out["eval/greedy_accuracy"] = greedy["accuracy"]
    return out


def samples_path(run_dir: Path, step: int) -> Path:
    return run_dir / "samples" / f"step_{step:08d}.jsonl"


def write_samples(run_dir: Path, step: int, rows: list[dict], task: str | None = None) -> Path:
    """Write under a temporary name and rename, so a report made during training never reads
    half a file; a resumed run that redoes a step replaces that step's file. task: the rows are
    that task's (each gets "task"); they replace that task's rows of the file, the other tasks'
    rows stay."""
    path = samples_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    if task is not None:
        rows = [{"task": task, **row} for row in rows]
        if path.is_file():
            others = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
            rows = [r for r in others if r.get("task") != task] + rows
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


def fmt_eval(m: dict[str, float]) -> str:
    return "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items())
