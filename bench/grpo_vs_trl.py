"""regen vs TRL GRPOTrainer for GRPO, DAPO and GSPO: same model, task and settings, one process.

Two configurations (--config):
  tiny     the built-in arithmetic task ("a+b=" -> the sum) and the 0.4M-parameter character-level
           GPT-2 of `regen.tasks.arithmetic` after a short SFT: per-call overhead dominates;
  compute  a random-init GPT-2 of 8 layers x 512 (bench/_lm_compute.py), prompts of 64 tokens
           shared by each group of 8, completions of 32 tokens, a dense reward: the model's
           forward and backward passes dominate.

Measures, for each trainer and algorithm (--algo):

  * completions per second = completions trained / training wall-clock (model loading,
    reference copy and trainer construction excluded; see "clock" below);
  * the median step time of each, and the ratio regen / TRL of both throughput figures
    (with --rounds N the two trainers alternate N times; each one's median round is reported);
  * the wall-clock each needs until its 10-step moving average of the per-step task reward
    first reaches a common target (default: the lower of the two final moving averages; tiny only);
  * each stage's share of the step (sample, old / reference log-probs, score, update) and the
    model FLOPs utilisation (MFU) of each trainer against this machine's fp32 matmul peak,
    measured by a probe in the same run (bench/_lm_compute.py: what is counted).

The per-algorithm settings of both trainers live in ALGOS below, and each run checks that the
trainer resolved them as asked (regen's config, TRL's trainer attributes) before it starts.

Clock. regen: sum of its own per-step `time/step_s` (sample + score + advantage + update),
read from metrics.jsonl; the whole `train()` call (which also loads the model, copies the
reference and writes a final checkpoint and export) is reported beside it. TRL: from the
`on_train_begin` callback to the last `on_step_end` (generation, scoring, reference
log-probs, update, TRL's own per-step logging); the whole `trainer.train()` call too.

Run (from the repository root, with the project's virtualenv active):

    python bench/grpo_vs_trl.py                      # GRPO; builds a 1500-step SFT base first
    python bench/grpo_vs_trl.py --config compute     # GRPO and GSPO at 8 x 512, 64 + 32 tokens
    python bench/grpo_vs_trl.py --algo all --base runs/sft/export --out /tmp/grpo_vs_trl.json
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
from _lm_compute import make_task, matmul_peak, step_flops

WINDOW = 10  # moving-average window of the per-step mean reward
# each trainer's step split into the same stages (TRL's from timers on its methods: _trl_common.py)
REGEN_STAGES = {"sample": "sample", "logprobs": "logprob", "score": "score", "update": "update"}
# settings whose default depends on --config (tiny, compute)
CONFIG_DEFAULTS = {"algo": ("grpo", "grpo,gspo"), "steps": (150, 12), "rounds": (3, 2), "max_len": (8, 32),
                   "lr": (5e-5, 1e-5)}

# Per-algorithm settings, the one place both trainers read them from.
#   name      regen algorithm.name
#   level     TRL importance_sampling_level ("sequence" is TRL's GSPO)
#   clip      (eps_low, eps_high): regen clip_low / clip_high, TRL epsilon / epsilon_high
#   loss      TRL loss_type; regen's algorithm.loss_agg is its counterpart in LOSS_AGG
#   beta      KL coefficient, k3 on both sides; 0 loads no reference model on either side
#   overlong  DAPO soft overlong punishment with L_max = --max-len, L_cache = --max-len // 2:
#             regen algorithm.overlong, TRL trl.rewards.get_soft_overlong_punishment
#   dynamic   regen algorithm.dynamic_sampling; TRL has none, so such a row runs regen only
# GSPO's loss "grpo" is TRL's per-sequence mean (what its docs recommend for GSPO); regen's
# gspo_loss averages over sequences (loss_agg only shapes a KL or entropy term, and is refused without one).
_COLUMNS = ("name", "level", "clip", "loss", "beta", "overlong", "dynamic")
ALGOS: dict[str, dict] = {algo: dict(zip(_COLUMNS, row)) for algo, row in {
    #            name    level       clip          loss    beta  overlong dynamic
    "grpo":     ("grpo", "token",    (0.2, 0.2),   "dapo", 0.04, False,   False),
    "dapo":     ("grpo", "token",    (0.2, 0.28),  "dapo", 0.0,  True,    False),
    "dapo-dyn": ("grpo", "token",    (0.2, 0.28),  "dapo", 0.0,  True,    True),
    "gspo":     ("gspo", "sequence", (3e-4, 4e-4), "grpo", 0.0,  False,   False),
}.items()}
# TRL loss_type -> the regen loss_agg that reduces the same way with one process, no gradient
# accumulation and one optimizer step per generation batch (as run here).
LOSS_AGG = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
            "dr_grpo": "seq-mean-token-sum-norm"}


def resolve(a, algo: str) -> dict:
    """The table row with the command line's overrides (--beta, --trl-loss) and lengths applied."""
    spec = dict(ALGOS[algo], algo=algo)
    if a.beta is not None:
        spec["beta"] = a.beta
    if a.trl_loss is not None:
        spec["loss"] = a.trl_loss
    spec["loss_agg"] = LOSS_AGG[spec["loss"]]
    spec["overlong"] = (a.max_len, max(1, a.max_len // 2)) if spec["overlong"] else None
    return spec


def run_regen(a, spec: dict, task: dict, workdir: Path) -> dict:
    from regen.config import RLConfig, load_config
    from regen.runtime.metrics import read_metrics
    from regen.train import train

    run_dir = workdir / "regen"
    algo = [f"algorithm.name={spec['name']}", f"algorithm.clip_low={spec['clip'][0]!r}",
            f"algorithm.clip_high={spec['clip'][1]!r}", f"algorithm.kl_coef={spec['beta']!r}",
            f"algorithm.dynamic_sampling={str(spec['dynamic']).lower()}"]
    # keys the method reads only in some settings are refused otherwise (regen/config/reads.py)
    if spec["beta"] > 0:
        algo.append("algorithm.kl_estimator=k3")
    if spec["name"] != "gspo" or spec["beta"] > 0:  # GSPO's aggregation reaches only its KL term
        algo.append(f"algorithm.loss_agg={spec['loss_agg']}")
    if spec["overlong"]:
        algo.append(f"algorithm.overlong={{max_len: {spec['overlong'][0]}, cache_len: {spec['overlong'][1]}, "
                    "factor: 1.0}")
    cfg = load_config(RLConfig, None, [
        *task["regen"], f"model.path={task['base']}", f"run.dir={run_dir}", "run.overwrite=true", f"run.threads={a.threads}",
        f"run.seed={a.seed}", f"rollout.global_batch_size={a.batch}", f"rollout.group_size={a.group}",
        f"rollout.max_new_tokens={a.max_len}", f"rollout.temperature={a.temperature}", f"train.steps={a.steps}",
        f"train.global_minibatch_size={a.batch}", f"optim.lr={a.lr}", *algo, "data.eval=null",
        "log.progress=none", "log.tensorboard=false", "checkpoint.every=0",
    ])
    c = cfg.algorithm
    resolved = {"name": c.name, "clip_low": c.clip_low, "clip_high": c.clip_high, "loss_agg": c.loss_agg,
                "kl_coef": c.kl_coef, "kl_estimator": c.kl_estimator, "advantage": c.advantage,
                "std_normalize": c.std_normalize, "kl_placement": getattr(c, "kl_placement", "loss"),
                "overlong": c.overlong and [c.overlong.max_len, c.overlong.cache_len, c.overlong.factor],
                "dynamic_sampling": c.dynamic_sampling, "ppo_epochs": cfg.train.ppo_epochs,
                "minibatch": cfg.train.global_minibatch_size}
    want = {"name": spec["name"], "clip_low": spec["clip"][0], "clip_high": spec["clip"][1],
            "loss_agg": spec["loss_agg"], "kl_coef": spec["beta"], "kl_estimator": "k3", "advantage": "grpo",
            "std_normalize": "group", "kl_placement": "loss",  # TRL: group-std advantages, KL in the loss
            "overlong": spec["overlong"] and [*spec["overlong"], 1.0], "dynamic_sampling": spec["dynamic"],
            "ppo_epochs": 1, "minibatch": a.batch}  # one update per batch, as TRL here
    if spec["name"] == "gspo" and spec["beta"] == 0:
        want.pop("loss_agg")  # not read (see above)
    bad = {k: (resolved[k], v) for k, v in want.items() if resolved[k] != v}
    if bad:
        raise RuntimeError(f"regen settings differ from the table (got, wanted): {bad}")
    t0 = time.perf_counter()
    train(cfg)
    call_s = time.perf_counter() - t0
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    step_s = [r["time/step_s"] for r in rows]

    def mean(key):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None

    # Logged evidence that the settings act (None: not logged, i.e. off).
    resolved["observed"] = {"overlong_penalty": mean("reward/overlong_penalty"), "clip_frac": mean("clip_frac"),
                            "kl": mean("kl"), "dynamic_extra_rounds": mean("dynamic/extra_rounds")}
    # the task reward, not reward/mean: the latter includes the overlong penalty under DAPO.
    stages = {stage: [r.get(f"time/{key}_s", 0.0) for r in rows] for stage, key in REGEN_STAGES.items()}
    return {"rewards": [r[f"reward/{task['reward_key']}"] for r in rows], "clock": list(accumulate(step_s)),
            "stages": stages, "length": mean("response_length/mean"),
            "train_s": sum(step_s), "call_s": call_s, "threads": torch.get_num_threads(),
            "extra_rounds": sum(r.get("dynamic/extra_rounds", 0.0) for r in rows), "resolved": resolved}


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
                             cwd=Path(__file__).resolve().parent, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def summarize(runs: list[dict], completions: int) -> dict:
    """Figures of the round with the median throughput (the lower middle one for an even count)."""
    cps = [completions / r["train_s"] for r in runs]
    r = runs[sorted(range(len(runs)), key=cps.__getitem__)[(len(runs) - 1) // 2]]
    steps = sorted(t1 - t0 for t0, t1 in zip([0.0] + r["clock"], r["clock"]))
    out = {"completions_per_s": completions / r["train_s"], "completions_per_s_whole_call": completions / r["call_s"],
           "median_step_ms": 1000 * steps[len(steps) // 2], "train_s": r["train_s"], "call_s": r["call_s"],
           "threads": r["threads"], "rewards": r["rewards"], "clock": r["clock"],
           "moving_avg": moving_average(r["rewards"]), "rounds_completions_per_s": cps,
           "same_rewards_every_round": all(x["rewards"] == r["rewards"] for x in runs),
           "completion_len": r["length"],
           # share of the summed step time each stage took (what is left: the loop's own books)
           "stage_share": {k: sum(v) / r["train_s"] for k, v in r["stages"].items()}}
    if r.get("extra_rounds"):  # dynamic sampling: each extra round samples one more batch
        n_steps = len(r["clock"])
        out["generated_completions_per_s"] = completions * (n_steps + r["extra_rounds"]) / n_steps / r["train_s"]
    return out


def compare(a, spec: dict, runs: dict[str, list[dict]], task: dict, peak: float) -> dict:
    """One algorithm's figures: each side's summary, MFU, the ratios and the time to a common target."""
    res = {"settings": {"table": {k: v for k, v in spec.items() if k != "algo"},
                        **{side: rs[0]["resolved"] for side, rs in runs.items()}}}
    res |= {side: summarize(rs, a.batch * a.steps) for side, rs in runs.items()}
    # one FLOP count for both trainers (the mean completion length both generated): MFU ratios are speed ratios
    length = sum(res[side]["completion_len"] for side in runs) / len(runs)
    res["flops_per_step"] = step_flops(task["shape"], a.batch, task["prompt_len"], length, spec["beta"] > 0)
    for side in runs:
        res[side]["mfu"] = res["flops_per_step"] / (res[side]["median_step_ms"] / 1000) / peak
    # what regen executes: each group's prompt once (sampling, reference and update); TRL runs every copy
    res["regen_executed_flops_per_step"] = step_flops(task["shape"], a.batch, task["prompt_len"], length,
                                                      spec["beta"] > 0, a.group)
    res["regen"]["mfu_executed"] = res["regen_executed_flops_per_step"] / (res["regen"]["median_step_ms"] / 1000) / peak
    if "trl" in res:
        res["trl"]["mfu_executed"] = res["trl"]["mfu"]
    if "trl" not in runs or a.config == "compute":  # regen only (dynamic sampling): its batch reward is over
        # the kept groups alone; compute: a random-init model, no target to reach
        return ratios(res) if "trl" in runs else res
    target = a.target if a.target is not None else min(res[s]["moving_avg"][-1] for s in ("regen", "trl"))
    for s in ("regen", "trl"):
        res[s]["target_step"], res[s]["target_s"] = time_to_target(res[s]["moving_avg"], res[s]["clock"], target)
    res["target"] = target
    return ratios(res)


def ratios(res: dict) -> dict:
    res["ratio_regen_over_trl"] = res["regen"]["completions_per_s"] / res["trl"]["completions_per_s"]
    res["ratio_per_round"] = [x / y for x, y in zip(res["regen"]["rounds_completions_per_s"],
                                                    res["trl"]["rounds_completions_per_s"])]
    res["ratio_from_median_steps"] = res["trl"]["median_step_ms"] / res["regen"]["median_step_ms"]
    return res


def report(results: dict, settings: dict, load: list, trl_samples) -> None:
    print("\nsettings (both trainers)")
    for k, v in settings.items():
        print(f"  {k:<14} {v}")
    print(f"  {'(load avg)':<14} 1-min load at start / before training / end: {load} on {os.cpu_count()} CPUs")
    print(f"  TRL decoded completions (completion, answer): {trl_samples}")
    print("\nresolved per algorithm (read back from each trainer; observed = per-step means of its logs)")
    for algo, res in results.items():
        for side in ("regen", "trl"):
            if side in res["settings"]:
                print(f"  {algo:<9}{side:<6}{res['settings'][side]}")
    print(f"\n{'':<15}{'train s':>9}{'compl/s':>9}{'median step ms':>16}{'whole call s':>14}{'compl/s':>9}"
          f"{'final MA10':>12}{'to target':>22}")
    for algo, res in results.items():
        for side in ("regen", "trl"):
            if side not in res:
                continue
            r = res[side]
            reach = ("n/a" if "target_s" not in r else "not reached" if r["target_s"] is None
                     else f"{r['target_s']:.1f} s (step {r['target_step']})")
            print(f"{algo + ' ' + side:<15}{r['train_s']:>9.1f}{r['completions_per_s']:>9.0f}"
                  f"{r['median_step_ms']:>16.1f}{r['call_s']:>14.1f}{r['completions_per_s_whole_call']:>9.0f}"
                  f"{r['moving_avg'][-1]:>12.3f}{reach:>22}")
            if not r["same_rewards_every_round"]:
                print(f"{'':<15}(reward curves differ between rounds; the median-throughput round's is used)")
    print(f"\n{'algorithm':<10}{'regen compl/s':>14}{'TRL compl/s':>12}{'ratio':>8}  {'(per round)':<20}"
          f"{'regen ms':>9}{'TRL ms':>8}{'ratio from ms':>14}{'target':>8}")
    for algo, res in results.items():
        g, t = res["regen"], res.get("trl")
        if t is None:
            gen = g.get("generated_completions_per_s")
            extra = f"regen only; {gen:.0f} generated/s" if gen else "regen only"
            print(f"{algo:<10}{g['completions_per_s']:>14.0f}{'-':>12}{'-':>8}  {'':<20}"
                  f"{g['median_step_ms']:>9.1f}{'-':>8}{'-':>14}{'-':>8}  ({extra})")
            continue
        per_round = "(" + ", ".join(f"{x:.2f}" for x in res["ratio_per_round"]) + ")"
        print(f"{algo:<10}{g['completions_per_s']:>14.0f}{t['completions_per_s']:>12.0f}"
              f"{res['ratio_regen_over_trl']:>7.2f}x  {per_round:<20}{g['median_step_ms']:>9.1f}"
              f"{t['median_step_ms']:>8.1f}{res['ratio_from_median_steps']:>13.2f}x"
              + (f"{res['target']:>8.3f}" if "target" in res else f"{'-':>8}"))
    print(f"\nshare of the step per stage (median round), mean completion tokens, MFU against the matmul peak of "
          f"{settings['matmul_peak_gflops']:.1f} GFLOP/s ({settings['threads']} threads): of the model FLOPs "
          "(every completion its own sequence) and of the FLOPs each executes (regen: each prompt once per group)")
    print(f"{'':<15}" + "".join(f"{k:>10}" for k in REGEN_STAGES)
          + f"{'tokens':>8}{'GFLOP/step':>12}{'MFU':>8}{'executed GFLOP':>16}{'its MFU':>9}")
    for algo, res in results.items():
        for side in ("regen", "trl"):
            if side in res:
                r = res[side]
                ex = res["regen_executed_flops_per_step"] if side == "regen" else res["flops_per_step"]
                print(f"{algo + ' ' + side:<15}" + "".join(f"{r['stage_share'][k]:>10.0%}" for k in REGEN_STAGES)
                      + f"{r['completion_len']:>8.1f}{res['flops_per_step'] / 1e9:>12.2f}{r['mfu']:>8.1%}"
                      + f"{ex / 1e9:>16.2f}{r['mfu_executed']:>9.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=("tiny", "compute"), default="tiny",
                   help="tiny: the 0.4M arithmetic GPT-2 after SFT (per-call overhead); compute: a random-init "
                        "GPT-2 of --layers x --width, 64-token prompts, 32-token completions (the model's compute)")
    p.add_argument("--algo", help=f"comma-separated rows of ALGOS ({', '.join(ALGOS)}) or 'all' (every row); "
                                  "dapo-dyn is DAPO with dynamic sampling, regen only (default: tiny grpo, "
                                  "compute grpo,gspo)")
    p.add_argument("--base", help="tiny: SFT export folder to start from (default: build one with --sft-steps)")
    p.add_argument("--sft-steps", type=int, default=1500)
    p.add_argument("--layers", type=int, default=8, help="compute: GPT-2 layers")
    p.add_argument("--width", type=int, default=512, help="compute: GPT-2 width (8 heads)")
    p.add_argument("--steps", type=int, help="steps per run (default: tiny 150, compute 12)")
    p.add_argument("--rounds", type=int, help="alternate regen/TRL runs this many times; report medians "
                                              "(default: tiny 3, compute 2)")
    p.add_argument("--batch", type=int, default=32, help="completions per step (= per optimizer step)")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-len", type=int, help="max completion tokens (EOS included); DAPO's L_max "
                                               "(default: tiny 8, compute 32)")
    p.add_argument("--lr", type=float, help="learning rate (default: tiny 5e-5, compute 1e-5)")
    p.add_argument("--beta", type=float, help="KL coefficient (k3) for every algorithm run (default: ALGOS', "
                   "grpo 0.04, dapo and gspo 0)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-loss", choices=sorted(LOSS_AGG), help="TRL loss_type for every algorithm run, with "
                   "regen's matching loss_agg (default: ALGOS'; dapo = token-mean over the batch here)")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="keep TRL's default gradient_checkpointing=True (off by default here: it only costs time)")
    p.add_argument("--target", type=float, help="reward target (default: lower final 10-step moving average)")
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    for key, defaults in CONFIG_DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, defaults[a.config == "compute"])
    if a.config == "compute" and a.base:
        p.error("--base is the tiny configuration's SFT base; compute builds its own random-init model")
    algos = list(ALGOS) if a.algo == "all" else a.algo.split(",")
    if unknown := [x for x in algos if x not in ALGOS]:
        p.error(f"--algo: unknown {unknown}; known: {', '.join(ALGOS)}, all")
    specs = {algo: resolve(a, algo) for algo in algos}
    warnings.filterwarnings("ignore")
    # bench/ is on sys.path when this file is run as a script
    from _trl_common import run_trl
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (import time off the clocks)
    import trl  # noqa: F401

    import regen.train  # noqa: F401
    torch.set_num_threads(a.threads)
    load = [round(os.getloadavg()[0], 2)]

    runs = {algo: {"regen": []} | ({} if spec["dynamic"] else {"trl": []}) for algo, spec in specs.items()}
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        work = Path(tmp)
        task = make_task(a, work)
        load.append(round(os.getloadavg()[0], 2))
        # Rounds outside, algorithms inside: a drift in the machine's speed hits every algorithm
        # alike. regen first in even rounds, TRL first in odd ones.
        for i in range(a.rounds):
            for algo, spec in specs.items():
                for side in list(runs[algo])[:: 1 if i % 2 == 0 else -1]:
                    run = run_regen if side == "regen" else run_trl
                    runs[algo][side].append(run(a, spec, task, work / f"{algo}-{side}{i}"))
        load.append(round(os.getloadavg()[0], 2))

        peak = matmul_peak(a.threads)  # the roof, measured right after the runs on the same threads
    results = {algo: compare(a, specs[algo], rs, task, peak) for algo, rs in runs.items()}
    settings = {k: getattr(a, k) for k in ("config", "algo", "steps", "rounds", "batch", "group", "max_len", "lr", "beta",
                                           "temperature", "threads", "seed", "trl_loss",
                                           "trl_gradient_checkpointing")}
    settings["base"] = (f"random init GPT-2 {a.layers} x {a.width}" if a.config == "compute"
                        else a.base or f"fresh SFT, {a.sft_steps} steps")
    settings |= {"config": a.config, "matmul_peak_gflops": peak / 1e9, "prompt_len": task["prompt_len"],
                 "matmul_params": task["shape"]["matmul_params"]}
    settings["regen_git"] = git_state()
    settings["threads_seen"] = {f"{algo} {side}": rs[0]["threads"] for algo, r in runs.items() for side, rs in r.items()}
    trl_samples = next((r["trl"][0]["sample_completions"] for r in runs.values() if "trl" in r), None)
    report(results, settings, load, trl_samples)

    if a.out:
        out = {"settings": settings, "load_avg_1min": load,
               "algorithms": {algo: {k: ({kk: vv for kk, vv in v.items() if kk != "moving_avg"}
                                         | {"final_moving_avg": v["moving_avg"][-1]}
                                         if k in ("regen", "trl") else v) for k, v in res.items()}
                              for algo, res in results.items()}}
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
