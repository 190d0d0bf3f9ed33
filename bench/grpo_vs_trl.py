"""regen GRPO vs TRL GRPOTrainer: same tiny model, same task, same settings, one process.

Measures, for each trainer, on the built-in arithmetic task ("a+b=" -> the sum) and the
character-level GPT-2 of `regen.tasks.arithmetic`:

  * completions per second = completions generated / training wall-clock (model loading,
    reference copy and trainer construction excluded; see "clock" below);
  * the median step time of each, and the ratio regen / TRL of both throughput figures
    (with --rounds N the two trainers alternate N times; each one's median round is reported);
  * the wall-clock each needs until its 10-step moving average of the per-step mean reward
    first reaches a common target (default: the lower of the two final moving averages).

Clock. regen: sum of its own per-step `time/step_s` (sample + score + advantage + update),
read from metrics.jsonl; the whole `train()` call (which also loads the model, copies the
reference and writes a final checkpoint and export) is reported beside it. TRL: from the
`on_train_begin` callback to the last `on_step_end` (generation, scoring, reference
log-probs, update, TRL's own per-step logging); the whole `trainer.train()` call too.

Run (from the repository root, with the project's virtualenv active):

    python bench/grpo_vs_trl.py                      # builds a 1500-step SFT base first
    python bench/grpo_vs_trl.py --base runs/sft/export --steps 150 --out /tmp/grpo_vs_trl.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import warnings
from itertools import accumulate
from pathlib import Path

import torch

WINDOW = 10  # moving-average window of the per-step mean reward


def build_base(workdir: Path, steps: int, threads: int, seed: int) -> str:
    from regen.config import SFTConfig, load_config
    from regen.sft import sft

    cfg = load_config(SFTConfig, None, [
        "model.init=arith-char-gpt2", f"run.dir={workdir / 'sft'}", f"sft.steps={steps}", "run.overwrite=true",
        "log.progress=none", "log.tensorboard=false", f"run.threads={threads}", f"run.seed={seed}",
    ])
    return sft(cfg)["export"]


def run_regen(a, base: str, workdir: Path) -> dict:
    from regen.config import RLConfig, load_config
    from regen.loop import train
    from regen.runtime.metrics import read_metrics

    run_dir = workdir / "regen"
    cfg = load_config(RLConfig, None, [
        f"model.path={base}", f"run.dir={run_dir}", "run.overwrite=true", f"run.threads={a.threads}",
        f"run.seed={a.seed}", f"rollout.global_batch_size={a.batch}", f"rollout.group_size={a.group}",
        f"rollout.max_new_tokens={a.max_len}", f"rollout.temperature={a.temperature}", f"train.steps={a.steps}",
        f"train.global_minibatch_size={a.batch}", f"optim.lr={a.lr}", f"algorithm.kl_coef={a.beta}",
        "algorithm.kl_estimator=k3", "algorithm.loss_agg=token-mean", "data.eval=null", "log.progress=none",
        "log.tensorboard=false", "checkpoint.every=0",
    ])
    t0 = time.perf_counter()
    train(cfg)
    call_s = time.perf_counter() - t0
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    step_s = [r["time/step_s"] for r in rows]
    return {"rewards": [r["reward/mean"] for r in rows], "clock": list(accumulate(step_s)), "train_s": sum(step_s),
            "call_s": call_s, "threads": torch.get_num_threads()}


def run_trl(a, base: str, workdir: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from regen.config import TaskConfig
    from regen.data import load_prompts

    torch.set_num_threads(a.threads)
    items = load_prompts("builtin:arithmetic:train", TaskConfig(), "data.train")
    data = Dataset.from_dict({"prompt": [it.prompt for it in items], "answer": [it.meta["answer"] for it in items]})
    rec = {"rewards": [], "clock": [], "samples": None, "threads": None, "sizes": set()}

    def exact_match(completions, answer, **_):
        if rec["samples"] is None:  # keep a few decoded completions to show what TRL hands the reward
            rec["samples"] = list(zip(completions[:4], answer[:4]))
        rec["sizes"].add(len(completions))
        scores = [float("".join(c.split()) == str(t)) for c, t in zip(completions, answer)]
        rec["rewards"].append(sum(scores) / len(scores))
        return scores

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            rec["t0"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            rec["clock"].append(time.perf_counter() - rec["t0"])
            rec["threads"] = torch.get_num_threads()

    args = GRPOConfig(
        output_dir=str(workdir / "trl"), seed=a.seed, use_cpu=True, report_to="none", save_strategy="no",
        eval_strategy="no", logging_steps=1, disable_tqdm=True, max_steps=a.steps,
        per_device_train_batch_size=a.batch, gradient_accumulation_steps=1, num_generations=a.group,
        steps_per_generation=1, num_iterations=1, max_completion_length=a.max_len, temperature=a.temperature,
        top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=1.0, beta=a.beta, epsilon=0.2,
        loss_type=a.trl_loss, scale_rewards="group", mask_truncated_completions=False, disable_dropout=True,
        gradient_checkpointing=a.trl_gradient_checkpointing, bf16=False, log_completions=False, dataloader_num_workers=0,
    )
    tok = AutoTokenizer.from_pretrained(base, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts would flood stdout
    t0 = time.perf_counter()
    trainer.train()
    call_s = time.perf_counter() - t0
    if len(rec["rewards"]) != a.steps or len(rec["clock"]) != a.steps or rec["sizes"] != {a.batch}:
        raise RuntimeError(f"TRL: {len(rec['rewards'])} reward calls of sizes {rec['sizes']}, {len(rec['clock'])} "
                           f"steps; expected {a.steps} calls of {a.batch} and {a.steps} steps")
    return {"rewards": rec["rewards"], "clock": rec["clock"], "train_s": rec["clock"][-1], "call_s": call_s,
            "threads": rec["threads"], "sample_completions": rec["samples"]}


def moving_average(xs: list[float], w: int = WINDOW) -> list[float]:
    """Trailing mean over the last w steps (fewer at the start)."""
    return [sum(xs[max(0, i + 1 - w): i + 1]) / (i + 1 - max(0, i + 1 - w)) for i in range(len(xs))]


def time_to_target(ma: list[float], clock: list[float], target: float, w: int = WINDOW):
    """(step, seconds) where the w-step moving average first reaches target, counting only full windows."""
    for i in range(w - 1, len(ma)):
        if ma[i] >= target - 1e-9:
            return i + 1, clock[i]
    return None, None


def git_state() -> str:
    """Commit of the checkout this file sits in, '-dirty' when the working tree has changes."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def summarize(runs: list[dict], completions: int) -> dict:
    """Figures of the round with the median throughput (the lower middle one for an even count)."""
    cps = [completions / r["train_s"] for r in runs]
    r = runs[sorted(range(len(runs)), key=cps.__getitem__)[(len(runs) - 1) // 2]]
    steps = sorted(t1 - t0 for t0, t1 in zip([0.0] + r["clock"], r["clock"]))
    return {"completions_per_s": completions / r["train_s"], "completions_per_s_whole_call": completions / r["call_s"],
            "median_step_ms": 1000 * steps[len(steps) // 2], "train_s": r["train_s"], "call_s": r["call_s"],
            "threads": r["threads"], "rewards": r["rewards"], "clock": r["clock"],
            "moving_avg": moving_average(r["rewards"]), "rounds_completions_per_s": cps,
            "same_rewards_every_round": all(x["rewards"] == r["rewards"] for x in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="SFT export folder to start from (default: build one with --sft-steps)")
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3, help="alternate regen/TRL runs this many times; report medians")
    p.add_argument("--batch", type=int, default=32, help="completions per step (= per optimizer step)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-len", type=int, default=8, help="max completion tokens (EOS included)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (k3 estimator on both sides)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-loss", default="dapo", help="TRL loss_type; dapo = token-mean over the batch here")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="keep TRL's default gradient_checkpointing=True (off by default here: it only costs time)")
    p.add_argument("--target", type=float, help="reward target (default: lower final 10-step moving average)")
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars
    import regen.loop, transformers.models.gpt2.modeling_gpt2, trl  # noqa: F401,E401  (import time off the clocks)
    torch.set_num_threads(a.threads)
    load = [round(os.getloadavg()[0], 2)]

    runs: dict[str, list[dict]] = {"regen": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        work = Path(tmp)
        base = a.base
        if base is None:
            t0 = time.perf_counter()
            base = build_base(work, a.sft_steps, a.threads, a.seed)
            print(f"built SFT base ({a.sft_steps} steps) in {time.perf_counter() - t0:.0f} s")
        load.append(round(os.getloadavg()[0], 2))
        for i in range(a.rounds):  # regen first in even rounds, TRL first in odd ones
            for name in ("regen", "trl")[:: 1 if i % 2 == 0 else -1]:
                runs[name].append((run_regen if name == "regen" else run_trl)(a, base, work / f"{name}{i}"))
        load.append(round(os.getloadavg()[0], 2))

    res = {name: summarize(rs, a.batch * a.steps) for name, rs in runs.items()}
    target = a.target if a.target is not None else min(r["moving_avg"][-1] for r in res.values())
    for r in res.values():
        r["target_step"], r["target_s"] = time_to_target(r["moving_avg"], r["clock"], target)
    rounds = [x / y for x, y in zip(res["regen"]["rounds_completions_per_s"], res["trl"]["rounds_completions_per_s"])]
    ratio = res["regen"]["completions_per_s"] / res["trl"]["completions_per_s"]
    median_ratio = res["trl"]["median_step_ms"] / res["regen"]["median_step_ms"]

    settings = {k: getattr(a, k) for k in ("steps", "rounds", "batch", "group", "max_len", "lr", "beta",
                                           "temperature", "threads", "seed", "trl_loss",
                                           "trl_gradient_checkpointing")}
    settings["base"] = a.base or f"fresh SFT, {a.sft_steps} steps"
    settings["regen_git"] = git_state()
    print("\nsettings (both trainers)")
    for k, v in settings.items():
        print(f"  {k:<12} {v}")
    print(f"  {'(threads seen)':<12} regen {res['regen']['threads']}, TRL {res['trl']['threads']}")
    print(f"  {'(load avg)':<12} 1-min load at start / before training / end: {load} on {os.cpu_count()} CPUs")
    print(f"  TRL decoded completions (completion, answer): {runs['trl'][0]['sample_completions']}")
    if not all(r["same_rewards_every_round"] for r in res.values()):
        print("  note: reward curves differ between rounds; the median-throughput round's is used")
    print(f"\n{'':<7}{'train s':>9}{'compl/s':>9}{'median step ms':>16}{'whole call s':>14}{'compl/s':>9}"
          f"{'final MA10':>12}{'to target':>22}")
    for name, r in res.items():
        reach = "not reached" if r["target_s"] is None else f"{r['target_s']:.1f} s (step {r['target_step']})"
        print(f"{name:<7}{r['train_s']:>9.1f}{r['completions_per_s']:>9.0f}{r['median_step_ms']:>16.1f}"
              f"{r['call_s']:>14.1f}{r['completions_per_s_whole_call']:>9.0f}{r['moving_avg'][-1]:>12.3f}{reach:>22}")
    per_round = ", ".join(f"{x:.2f}" for x in rounds)
    print(f"\nthroughput ratio regen / TRL: {ratio:.2f}x  (per round: {per_round}; "
          f"from median step times: {median_ratio:.2f}x)")
    print(f"target reward (10-step moving average): {target:.3f}")

    if a.out:
        out = {"settings": settings, "load_avg_1min": load, "target": target, "ratio_regen_over_trl": ratio,
               "ratio_per_round": rounds, "ratio_from_median_steps": median_ratio,
               **{n: {k: v for k, v in r.items() if k != "moving_avg"} | {"final_moving_avg": r["moving_avg"][-1]}
                  for n, r in res.items()}}
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
