"""The TRL side of bench/grpo_vs_trl.py: one GRPOTrainer run from a resolved algorithm spec.

Kept apart so the benchmark file holds the settings table, the regen side and the report,
and this one everything that needs TRL's names. `spec` is a row of grpo_vs_trl.ALGOS after
resolve(): name, clip (eps_low, eps_high), loss (TRL loss_type), level (importance sampling
level), beta, overlong ((L_max, L_cache) or None).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from _lm_compute import even_fraction

STAGES = ("sample", "logprobs", "score", "update")  # as bench/grpo_vs_trl.py's REGEN_STAGES


def time_calls(obj, name: str, into: list) -> None:
    """Append the wall time of every call of obj.<name> to `into` (an instance attribute wraps the method)."""
    method = getattr(obj, name)

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return method(*args, **kw)
        finally:
            into.append(time.perf_counter() - t0)

    setattr(obj, name, timed)


def trl_settings(trainer) -> dict:
    """What the trainer actually runs with, read back from the trainer (not from our own args),
    so a renamed or ignored GRPOConfig field shows up as a mismatch."""
    return {
        "importance_sampling_level": trainer.importance_sampling_level, "epsilon": trainer.epsilon_low,
        "epsilon_high": trainer.epsilon_high, "loss_type": trainer.loss_type, "beta": trainer.beta,
        "reference_model": trainer.ref_model is not None, "reward_funcs": list(trainer.reward_func_names),
        "reward_weights": [float(w) for w in trainer.reward_weights], "scale_rewards": trainer.scale_rewards,
        "multi_objective_aggregation": trainer.args.multi_objective_aggregation,
        "num_iterations": trainer.num_iterations, "steps_per_generation": trainer.args.steps_per_generation,
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
    }


def check_trl(got: dict, spec: dict, reward: str) -> None:
    """Stop the benchmark when TRL does not run the settings the table asks for."""
    funcs = [reward] + (["soft_overlong_punishment_reward"] if spec["overlong"] else [])
    want = {"importance_sampling_level": spec["level"], "epsilon": spec["clip"][0], "epsilon_high": spec["clip"][1],
            "loss_type": spec["loss"], "beta": spec["beta"], "reference_model": spec["beta"] != 0.0,
            "reward_funcs": funcs, "reward_weights": [1.0] * len(funcs), "scale_rewards": "group",
            "multi_objective_aggregation": "sum_then_normalize", "num_iterations": 1, "steps_per_generation": 1}
    bad = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    if bad:
        raise RuntimeError(f"TRL settings differ from the table (got, wanted): {bad}")


def run_trl(a, spec: dict, task: dict, workdir: Path) -> dict:
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
    )
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import get_soft_overlong_punishment

    from regen.config import TaskConfig
    from regen.data import load_prompts

    torch.set_num_threads(a.threads)
    items = load_prompts(task["data"], TaskConfig(), "data.train")
    columns = {"prompt": [it.prompt for it in items]}
    if task["reward"] == "exact_match":
        columns["answer"] = [it.meta["answer"] for it in items]
    data = Dataset.from_dict(columns)
    rec = {"rewards": [], "clock": [], "samples": None, "threads": None, "sizes": set(), "logs": [],
           "stages": {k: [] for k in STAGES}, "prep": []}

    def scored(completions, scores, answer):
        if rec["samples"] is None:  # keep a few decoded completions to show what TRL hands the reward
            rec["samples"] = list(zip([c[:40] for c in completions[:4]], answer[:4]))
        rec["sizes"].add(len(completions))
        # The curve compared with regen's reward/<task reward>: the task reward alone, without
        # the overlong penalty, so the three algorithms' curves are on one scale.
        rec["rewards"].append(sum(scores) / len(scores))
        return scores

    def exact_match(completions, answer, **_):
        return scored(completions, [float("".join(c.split()) == str(t)) for c, t in zip(completions, answer)], answer)

    def even_words(completions, **_):
        return scored(completions, [even_fraction(c) for c in completions], [None] * len(completions))

    rewards = [exact_match if task["reward"] == "exact_match" else even_words]
    if spec["overlong"]:
        # TRL's own DAPO eq. 13 (factor 1), summed with the task reward before the group
        # normalisation, as regen adds algorithm.overlong's penalty. Both count the completion's
        # tokens up to and including EOS.
        rewards.append(get_soft_overlong_punishment(max_completion_len=spec["overlong"][0],
                                                    soft_punish_cache=spec["overlong"][1]))

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            rec["t0"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            rec["clock"].append(time.perf_counter() - rec["t0"])
            rec["threads"] = torch.get_num_threads()

        def on_log(self, *_, logs=None, **__):
            rec["logs"].append(dict(logs or {}))

    args = GRPOConfig(
        output_dir=str(workdir / "trl"), seed=a.seed, use_cpu=True, report_to="none", save_strategy="no",
        eval_strategy="no", logging_steps=1, disable_tqdm=True, max_steps=a.steps,
        per_device_train_batch_size=a.batch, gradient_accumulation_steps=1, num_generations=a.group,
        steps_per_generation=1, num_iterations=1, max_completion_length=a.max_len, temperature=a.temperature,
        top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=1.0, beta=spec["beta"],
        epsilon=spec["clip"][0], epsilon_high=spec["clip"][1], importance_sampling_level=spec["level"],
        loss_type=spec["loss"], scale_rewards="group", mask_truncated_completions=False, disable_dropout=True,
        gradient_checkpointing=a.trl_gradient_checkpointing, bf16=False, log_completions=False,
        dataloader_num_workers=0,
    )
    tok = AutoTokenizer.from_pretrained(task["base"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(task["base"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    # stage timers on the trainer's own methods: sampling, scoring, and the whole batch preparation
    # (what it spends there besides those two is the old / reference log-probs)
    time_calls(trainer, "_generate", rec["stages"]["sample"])
    time_calls(trainer, "_calculate_rewards", rec["stages"]["score"])
    time_calls(trainer, "_generate_and_score_completions", rec["prep"])
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts would flood stdout
    resolved = trl_settings(trainer)
    check_trl(resolved, spec, task["reward"])
    t0 = time.perf_counter()
    trainer.train()
    call_s = time.perf_counter() - t0
    if len(rec["rewards"]) != a.steps or len(rec["clock"]) != a.steps or rec["sizes"] != {a.batch}:
        raise RuntimeError(f"TRL: {len(rec['rewards'])} reward calls of sizes {rec['sizes']}, {len(rec['clock'])} "
                           f"steps; expected {a.steps} calls of {a.batch} and {a.steps} steps")
    steps = [lg for lg in rec["logs"] if "loss" in lg]  # per-step logs (the final summary has train_loss)

    def mean(key):
        vals = [lg[key] for lg in steps if key in lg]
        return sum(vals) / len(vals) if vals else None

    # Logged evidence that the settings act: the overlong penalty's mean (None when off), the
    # fraction of clipped tokens / sequences, the KL (logged only with beta > 0).
    resolved["observed"] = {"overlong_penalty": mean("rewards/soft_overlong_punishment_reward/mean"),
                            "clip_frac": mean("clip_ratio/region_mean"), "kl": mean("kl")}
    st = rec["stages"]
    st["logprobs"] = [p - g - r for p, g, r in zip(rec["prep"], st["sample"], st["score"])]
    st["update"] = [t1 - t0 - p for t0, t1, p in zip([0.0] + rec["clock"], rec["clock"], rec["prep"])]
    return {"rewards": rec["rewards"], "clock": rec["clock"], "train_s": rec["clock"][-1], "call_s": call_s,
            "stages": {k: st[k] for k in STAGES}, "length": mean("completions/mean_length"),
            "threads": rec["threads"], "sample_completions": rec["samples"], "resolved": resolved}
