"""Held-out evaluation: sample completions for prompts never trained on and score them."""

from __future__ import annotations

import torch

from regen.data import PromptItem
from regen.rewards import CombinedReward, Sample
from regen.rewards.builtin import exact_match

EVAL_SEED_OFFSET = 7919  # eval draws from its own stream so it never shifts the training RNG


@torch.no_grad()
def evaluate(
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
) -> dict[str, float]:
    """Returns `accuracy` (exact match against each row's 'answer', when every row has one),
    `reward` (the mean combined reward, when one is given) and `length` (mean completion
    characters). The same seed gives the same sampling noise, so before/after numbers of a
    run are compared on equal terms."""
    gen = torch.Generator(device=policy.device).manual_seed(seed + EVAL_SEED_OFFSET)
    n = 1 if greedy else samples_per_prompt
    samples: list[Sample] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        ro = policy.sample([it.prompt for it in chunk], n, temperature, top_p, max_new_tokens, gen, greedy=greedy)
        fin = ro.finished.tolist()
        samples += [
            Sample(chunk[i // n].prompt, ro.completions[i], chunk[i // n].meta, fin[i]) for i in range(len(fin))
        ]
    out = {"length": sum(len(s.completion) for s in samples) / max(len(samples), 1)}
    if items and all("answer" in it.meta for it in items):
        out["accuracy"] = sum(exact_match(samples)) / len(samples)
    if reward is not None:
        total, _ = reward(samples)
        finite = [t for t in total if t == t]
        out["reward"] = sum(finite) / len(finite) if finite else float("nan")
    return out


def run_eval(policy, items: list[PromptItem], cfg, reward: CombinedReward | None) -> dict[str, float]:
    """Evaluate with the run's eval/rollout settings; keys prefixed 'eval/'."""
    e, r = cfg.eval, cfg.rollout
    common = dict(top_p=r.top_p, max_new_tokens=r.max_new_tokens, batch_size=e.batch_size, seed=cfg.run.seed)
    items = items[: e.num_prompts]
    sampled = evaluate(
        policy, items, temperature=e.temperature or r.temperature, samples_per_prompt=e.samples_per_prompt,
        reward=reward, **common,
    )
    out = {f"eval/{k}": v for k, v in sampled.items()}
    if e.greedy:
        greedy = evaluate(policy, items, temperature=1.0, greedy=True, **common)
        if "accuracy" in greedy:
            out["eval/greedy_accuracy"] = greedy["accuracy"]
    return out


def fmt_eval(m: dict[str, float]) -> str:
    return "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items())
