"""Held-out evaluation of a flow-matching model (FlowModality.evaluate): ODE samples with
fixed noise, the mean of each reward term, prompt adherence on the built-in shapes, and the
first samples kept under samples/ for the report."""

from __future__ import annotations

from pathlib import Path

import torch

from regen.modalities.flow_copies import build_policy
from regen.modalities.flow_media import save_media
from regen.policies.flow import FlowPolicy, FlowSample
from regen.policies.flow_lora import swapped
from regen.rewards import Sample
from regen.runtime.metrics import nanmean

EVAL_SEED_OFFSET = 7919  # held-out samples draw from their own stream: before/after on equal noise


def to_samples(policy: FlowPolicy, batch: FlowSample, items, n: int) -> list[Sample]:
    """What a reward sees: the prompt, its row's attributes, and the pixels as uint8."""
    from regen.tasks.shapes import to_uint8

    with torch.no_grad():
        pix = to_uint8(policy.decode(batch.x0).cpu()).numpy()
    return [Sample(items[i // n].prompt, "", items[i // n].meta, True, pix[i]) for i in range(len(pix))]


def evaluate_flow(mod, items, reward, run_dir: Path, step: int, quality=None, task: str | None = None,
                  conditions: list[str] | None = None) -> dict[str, float]:
    """eval/* of the held-out `items` for FlowModality `mod`; task: a multi-task run's task
    (its samples are kept beside the other tasks' of the same step). conditions: what the model
    draws from instead of the items' prompts (a joint run's rewrites, kept beside each image);
    the rewards still judge the samples against the items."""
    e, f = mod.cfg.eval, mod.cfg.flow
    items = items[: e.num_prompts]
    gen = torch.Generator().manual_seed(mod.cfg.run.seed + EVAL_SEED_OFFSET)
    net = mod.policy.unet if mod.weight_ema is None else mod.weight_ema  # Flow-GRPO evaluates its EMA
    with swapped(mod.policy, net):
        out = mod.policy.sample_ode(conditions or [it.prompt for it in items], e.samples_per_prompt, gen,
                                    f.eval_steps, f.shift, f.guidance)
    samples = to_samples(mod.policy, out, items, e.samples_per_prompt)
    if mod.cfg.algorithm.reward_type == "pairwise":
        # a win rate within the held-out groups is 1/2 by symmetry: judge each sample against the
        # starting model's on the same prompt and noise instead (1/2 at step 0, then the win rate)
        base = base_samples(mod, items, samples, step, task)
        pairs = [Sample(s.prompt, s.completion, {**s.meta, "pair": i}, s.finished, s.media)
                 for i, both in enumerate(zip(samples, base)) for s in both]
        total, parts = reward(pairs)
        total, parts = total[0::2], {k: v[0::2] for k, v in parts.items()}
    else:
        total, parts = reward(samples)
    metrics = {"eval/reward": nanmean(total), **{f"eval/{k}": nanmean(v) for k, v in parts.items()}}
    if all("colour" in it.meta for it in items):  # the built-in shapes: did it draw what was asked?
        from regen.rewards.adherence import AdherenceAccuracy

        # logged beside any reward, so a reward that is hacked (a flat colour) shows here
        metrics["eval/adherence_accuracy"] = nanmean(AdherenceAccuracy()(samples))
    if quality:
        metrics |= {f"eval/{k}": v for k, v in quality(samples, step).items()}
    if mod.dist.main:
        n, extra, pick = e.samples_per_prompt, None, None
        if conditions is not None:  # a joint run: the first image of each prompt, beside the user's prompt and the rewrite
            pick = list(range(0, len(samples), n))[:16]
            extra = [{"prompt": items[i // n].prompt, "rewrite": conditions[i // n]} for i in pick]
        save_media(run_dir, step, out, total, policy=mod.policy, task=task, rows=extra, pick=pick)
    return metrics


def base_samples(mod, items, samples: list[Sample], step: int, task: str | None) -> list[Sample]:
    """The starting model's held-out samples of `task` (same prompts and noise): this
    evaluation's own at step 0, else sampled once from the starting model (after a resume)."""
    if task not in mod.base_samples:
        if step == 0:
            mod.base_samples[task] = samples
        else:
            e, f = mod.cfg.eval, mod.cfg.flow
            base = build_policy(mod.cfg, mod.device)
            gen = torch.Generator().manual_seed(mod.cfg.run.seed + EVAL_SEED_OFFSET)
            out = base.sample_ode([it.prompt for it in items], e.samples_per_prompt, gen, f.eval_steps, f.shift,
                                  f.guidance)
            mod.base_samples[task] = to_samples(base, out, items, e.samples_per_prompt)
    return mod.base_samples[task]
