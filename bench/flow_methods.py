"""Flow-matching RL methods from one base, over several seeds: held-out reward and prompt adherence against training wall-clock.

Runs each method's shapes RL example config as `python -m regen train CONFIG ...` from one flow base,
once per seed (--seeds N: run.seed = 0..N-1), alternated in one process: seed 0 of every method,
then seed 1 of every method with the order rotated by one, and so on, so that drift of the machine
hits all methods alike. Methods (--only picks some): flow_grpo (Flow-GRPO, the reference),
flow_dppo (Flow-DPPO), nft (DiffusionNFT), awm (AWM) and dgpo (DGPO). Configs: --task image (the
default) `examples/shapes_<method>.yaml`, 16x16 images from a base of `regen sft
examples/shapes_sft.yaml`; --task video `examples/moving_shapes_<method>.yaml`, 8-frame videos from
a base of `examples/moving_shapes_sft.yaml`. A method without a config for the task is skipped with
a printed line. Each run keeps its config's method settings, learning rate, reward and images per
step (rollout.global_batch_size). The only overrides: model.path, run.dir, run.seed, eval.every,
eval.num_prompts and eval.samples_per_prompt (--eval-prompts, default all 12 held-out prompts, x
--eval-samples, default 32: 384 ODE samples per evaluation, on noise fixed per seed),
checkpoint.every=0, log.progress=none, log.tensorboard=false, run.overwrite=true, run.threads=2
where the config sets no thread count, and when asked train.steps (--steps), optim.lr (--lr) and any
key of one method (--set nft:train.ppo_epochs=2, repeatable).

Measures, from each run's metrics.jsonl: held-out reward (`eval/reward`) and prompt adherence
(`eval/adherence_accuracy`: the fraction of samples whose colour, shape and position or motion the
built-in classifier reads back) at step 0, every --eval-every steps and at the end, against training
wall-clock = cumulative `time/step_s` (evaluation, loading and export not counted) and images
sampled for training = step x rollout.global_batch_size (evaluation samples not counted).

Target: Flow-GRPO's final eval/reward averaged over its seeds (or --target). A run reaches it at the
first eval point after step 0 where the reward holds the target at two consecutive evaluations (that
point and the next; the final eval counts as a next one, so the final point alone never qualifies)
and the adherence is no lower than the run's step 0 (the base's). Per method, over its seeds: how
many reached it, mean, std (n-1) and min..max of training seconds, images and adherence at that
point (over the seeds that reached it), of final reward and adherence and of training seconds; and
the speed-ups: Flow-GRPO's mean whole-run training seconds (images) / the method's mean seconds
(images) to target, "-" unless every seed reached it. Also each run's own figures,
`git describe --always --dirty`, the runs' torch threads and the 1-min load average at the start,
before every run (a WARNING above the runs' thread count + 0.5: something else is running) and at
the end.
--png (default docs/flow_methods.png; needs matplotlib): reward and adherence against training
wall-clock, per method the mean over seeds at each eval point with the min..max shaded.
--out FILE: settings, every run's curves and the summary as JSON.

Run from the repository root with the project's virtualenv:

    python bench/flow_methods.py --base runs/demo-shapes-sft/export        # 3 seeds, ~1 h on an idle 2-core machine
    python bench/flow_methods.py      # builds the base first (examples/shapes_sft.yaml, ~6 min on 2 cores)
    python bench/flow_methods.py --task video --base runs/demo-moving-shapes-sft/export
    python bench/flow_methods.py --base runs/demo-shapes-sft/export --steps 2 --eval-every 1 --seeds 2 \\
        --eval-prompts 4 --eval-samples 2 --only flow_grpo,nft --png /tmp/fm.png --out /tmp/fm.json  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import tempfile
from pathlib import Path

import yaml
from _runs import ROOT, eval_points, git_describe, load_avg, regen, spread

REF = "flow_grpo"  # the method whose mean final reward is the target and whose mean whole run is the baseline
METHODS = {"flow_grpo": "Flow-GRPO", "flow_dppo": "Flow-DPPO", "nft": "DiffusionNFT", "awm": "AWM", "dgpo": "DGPO"}
PREFIX = {"image": "shapes", "video": "moving_shapes"}  # examples/<prefix>_<method>.yaml, <prefix>_sft.yaml
THREADS = 2  # run.threads where a config sets none
MIN_EVAL = 384  # held-out samples per evaluation below which a mean reward is too noisy to rank methods


@functools.cache
def held_out(spec: str) -> int:
    """How many prompts the eval split `spec` has (regen evaluates the first eval.num_prompts of them)."""
    from regen.data import load_prompts

    return len(load_prompts(spec, None, "data.eval"))


def curve(run_dir: Path) -> dict:
    """One run's eval points against training seconds and images sampled, plus its resolved settings."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    batch, e = cfg["rollout"]["global_batch_size"], cfg["eval"]
    c = eval_points(run_dir / "metrics.jsonl", ["eval/reward", "eval/adherence_accuracy"])
    if not c["steps"] or c["steps"][0] != 0:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no eval/reward at step 0 (is data.eval set?)")
    prompts = min(e["num_prompts"], held_out(cfg["data"]["eval"]))
    rew, adh = c["eval/reward"], c["eval/adherence_accuracy"]
    return {
        "lr": cfg["optim"]["lr"], "train_steps": cfg["train"]["steps"], "global_batch_size": batch,
        "group_size": cfg["rollout"]["group_size"], "threads": cfg["run"]["threads"],
        "eval_prompts": prompts, "eval_samples_per_prompt": e["samples_per_prompt"],
        "eval_count": prompts * e["samples_per_prompt"],
        "steps": c["steps"], "seconds": c["seconds"], "images": [s * batch for s in c["steps"]], "reward": rew,
        "adherence": adh, "reward_at_0": rew[0], "adherence_at_0": adh[0], "final_reward": rew[-1],
        "final_adherence": adh[-1], "train_s": c["train_s"], "train_images": c["last_step"] * batch,
        "median_step_ms": c["median_step_ms"],
    }


def to_target(r: dict, target: float) -> int | None:
    """Index of the first eval point after step 0 whose reward and the next point's are >= target and whose
    adherence is >= step 0's; None if none (the final point has no next one)."""
    rew, adh = r["reward"], r["adherence"]
    for i in range(1, len(rew) - 1):
        if rew[i] >= target and rew[i + 1] >= target and adh[i] >= adh[0]:
            return i
    return None


def summarize(runs: list[dict], names: list[str], target: float) -> dict:
    """Marks each run's target point and speed-ups; per method the spread over seeds (see the docstring)."""
    ref = [r for r in runs if r["name"] == REF]
    ref_s, ref_img = spread([r["train_s"] for r in ref]), spread([r["train_images"] for r in ref])
    out = {}
    for name in names:
        rs = [r for r in runs if r["name"] == name]
        for r in rs:
            i = to_target(r, target)
            r["target_step"], r["target_s"], r["target_images"], r["target_adherence"] = (
                (None,) * 4 if i is None else (r["steps"][i], r["seconds"][i], r["images"][i], r["adherence"][i]))
            r["speedup_time"] = ref_s["mean"] / r["target_s"] if ref_s and r["target_s"] else None
            r["speedup_images"] = ref_img["mean"] / r["target_images"] if ref_img and r["target_images"] else None
        keys = ("target_s", "target_images", "target_adherence", "final_reward", "final_adherence", "train_s",
                "train_images", "median_step_ms", "reward_at_0", "adherence_at_0")
        s = out[name] = {"label": METHODS[name], "config": rs[0]["config"], "lr": sorted({r["lr"] for r in rs}),
                         "steps": rs[0]["train_steps"], "seeds": len(rs),
                         "reached": sum(r["target_s"] is not None for r in rs), **{k: spread([r[k] for r in rs]) for k in keys}}
        every = s["reached"] == len(rs)
        s["speedup_time"] = ref_s["mean"] / s["target_s"]["mean"] if every and ref_s else None
        s["speedup_images"] = ref_img["mean"] / s["target_images"]["mean"] if every and ref_img else None
    return out


def parse_lr(text: str | None, p: argparse.ArgumentParser) -> dict[str, float]:
    out = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        if not sep or name not in METHODS:
            p.error(f"--lr wants name=value,... with names from {list(METHODS)}; got {item!r}")
        try:
            out[name] = float(value)
        except ValueError:
            p.error(f"--lr {name}: {value!r} is not a number")
    return out


def table(head: list[str], widths: list[int], rows: list[list[str]]) -> None:
    for cells in [head, *rows]:
        print("".join(f"{c:<{w}}" if j == 0 else f"{c:>{w}}" if len(c) < w else " " + c
                      for j, (c, w) in enumerate(zip(cells, widths))).rstrip())


def fmt(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def report(summary: dict, runs: list[dict]) -> None:
    """The per-method table (mean±std, min..max below) and the per-run one."""
    stats = [("target_s", ".1f"), ("target_images", ".0f"), ("target_adherence", ".3f"), ("final_reward", ".4f"),
             ("final_adherence", ".3f"), ("train_s", ".1f")]
    rows = []
    for s in summary.values():
        sp = [s[k] for k, _ in stats]
        rows.append([s["label"], "/".join(f"{v:g}" for v in s["lr"]), str(s["steps"]), f"{s['reached']}/{s['seeds']}",
                     *("-" if v is None else f"{v['mean']:{f}}±{v['std']:{f}}" for v, (_, f) in zip(sp, stats)),
                     fmt(s["speedup_time"], ".2f", "x"), fmt(s["speedup_images"], ".2f", "x")])
        rows.append(["", "", "", "", *("" if v is None else f"{v['min']:{f}}..{v['max']:{f}}" for v, (_, f) in zip(sp, stats)),
                     "", ""])
    table(["method", "lr", "steps", "reached", "s to tgt", "img to tgt", "adh@tgt", "final rew", "final adh", "train s",
           "speedup t", "speedup img"], [14, 8, 7, 9, 15, 13, 14, 18, 14, 13, 11, 13], rows)
    print("\nper run (speed-ups against the reference's mean whole run):")
    table(["method", "seed", "load", "rew@0", "adh@0", "final rew", "final adh", "train s", "med step ms", "tgt step",
           "s to tgt", "img to tgt", "adh@tgt", "speedup t", "speedup img"],
          [14, 5, 6, 9, 7, 11, 11, 9, 13, 10, 10, 12, 9, 11, 13],
          [[r["label"], str(r["seed"]), f"{r['load_before']:.2f}", f"{r['reward_at_0']:.4f}", f"{r['adherence_at_0']:.3f}",
            f"{r['final_reward']:.4f}", f"{r['final_adherence']:.3f}", f"{r['train_s']:.1f}", f"{r['median_step_ms']:.1f}",
            fmt(r["target_step"], "d"), fmt(r["target_s"], ".1f"), fmt(r["target_images"], "d"),
            fmt(r["target_adherence"], ".3f"), fmt(r["speedup_time"], ".2f", "x"), fmt(r["speedup_images"], ".2f", "x")]
           for r in sorted(runs, key=lambda r: (list(summary).index(r["name"]), r["seed"]))])


def plot(path: str, runs: list[dict], summary: dict, target: float, source: str, base_adh: float, title: str) -> None:
    """Per method the mean over seeds at each eval point (x: mean training seconds there), min..max shaded."""
    try:
        import matplotlib
    except ImportError:
        print(f"no figure ({path}): matplotlib is missing (pip install -e '.[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(14, 6), dpi=120)
    for i, (name, s) in enumerate(summary.items()):
        rs = [r for r in runs if r["name"] == name]
        n = min(len(r["steps"]) for r in rs)
        if any(r["steps"][:n] != rs[0]["steps"][:n] or len(r["steps"]) != n for r in rs):
            print(f"WARNING: {s['label']}'s seeds have different eval steps; plotting the first {n} points")
        x = [statistics.fmean(r["seconds"][j] for r in rs) for j in range(n)]
        style = {"color": f"C{i}", "marker": "os^Dv"[i % 5], "lw": 1.8, "ms": 4}
        for ax, key in ((ax_r, "reward"), (ax_a, "adherence")):
            ys = [[r[key][j] for r in rs] for j in range(n)]
            final = statistics.fmean(y for y in ys[-1])
            label = f"{s['label']}, lr {'/'.join(f'{v:g}' for v in s['lr'])} ({final:.3f}"
            label += f"; {s['reached']}/{s['seeds']} reached)" if key == "reward" else ")"
            ax.plot(x, [statistics.fmean(y) for y in ys], **style, label=label)
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=f"C{i}", alpha=0.15, lw=0)
        if s["reached"] == s["seeds"]:
            ax_r.plot([s["target_s"]["mean"]], [target], "*", color=f"C{i}", ms=16, mec="black", zorder=5)
    ax_r.axhline(target, color="grey", lw=1, ls="--", label=f"target {target:.3f} ({source})")
    ax_a.axhline(base_adh, color="grey", lw=1, ls="--", label=f"base {base_adh:.3f} (mean over seeds)")
    ax_r.set_ylabel("held-out eval/reward")
    ax_a.set_ylabel("held-out eval/adherence_accuracy (fraction drawn as prompted)")
    for ax in (ax_r, ax_a):
        ax.set_xlabel("training wall-clock, s (sum of time/step_s, mean over seeds; evaluation not counted)")
        ax.grid(alpha=0.3)
    ax_r.legend(title="method: mean over seeds (final), min..max shaded; * = mean s to target", fontsize=8)
    ax_a.legend(title="method (final mean)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    print(f"figure written to {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Without --base the benchmark first trains a base "
                                "with examples/<shapes|moving_shapes>_sft.yaml (about 6 min on 2 CPU cores for images).")
    p.add_argument("--task", choices=list(PREFIX), default="image", help="image (default): examples/shapes_*.yaml; "
                   "video: examples/moving_shapes_*.yaml")
    p.add_argument("--base", help="flow model folder with flow_policy.json (default: build one from the task's SFT config)")
    p.add_argument("--work", help="folder for the run folders (default: a new temporary folder); kept afterwards")
    p.add_argument("--seeds", type=int, default=3, help="runs per method, run.seed 0..N-1, alternated (default 3)")
    p.add_argument("--first-seed", type=int, default=0, help="start the seeds here: run.seed F..F+N-1 (default 0), "
                   "to add seeds to an earlier benchmark")
    p.add_argument("--steps", type=int, help="train.steps of every run (default: each config's own, 200)")
    p.add_argument("--eval-every", type=int, default=25, help="eval.every of every run (default 25)")
    p.add_argument("--eval-prompts", type=int, help="eval.num_prompts (default: every held-out prompt, 12)")
    p.add_argument("--eval-samples", type=int, default=32, help="eval.samples_per_prompt (default 32: 12 x 32 = 384)")
    p.add_argument("--only", help="comma-separated subset of: " + ",".join(METHODS))
    p.add_argument("--lr", help="optim.lr overrides, e.g. nft=3e-4,awm=3e-4 (default: each config's own)")
    p.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="an extra override for one method's runs, e.g. nft:train.ppo_epochs=2 (repeatable)")
    p.add_argument("--target", type=float, help="eval/reward to reach (default: Flow-GRPO's mean final eval/reward)")
    p.add_argument("--png", default=str(ROOT / "docs" / "flow_methods.png"), help="figure (default docs/flow_methods.png)")
    p.add_argument("--out", help="write settings, every run's curves and the summary as JSON here")
    a = p.parse_args()
    wanted = list(dict.fromkeys(a.only.split(","))) if a.only else list(METHODS)
    if unknown := set(wanted) - set(METHODS):
        p.error(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}")
    if a.seeds < 1 or a.eval_samples < 1 or (a.eval_prompts is not None and a.eval_prompts < 1):
        p.error("--seeds, --eval-prompts and --eval-samples must be >= 1")
    lrs = parse_lr(a.lr, p)
    for kv in a.set:
        if ":" not in kv or "=" not in kv or kv.split(":", 1)[0] not in METHODS:
            p.error(f"--set {kv}: write METHOD:KEY=VALUE with METHOD one of {list(METHODS)}")
    configs = {}
    for name in wanted:
        path = ROOT / "examples" / f"{PREFIX[a.task]}_{name}.yaml"
        if path.exists():
            configs[name] = path
        else:
            print(f"{METHODS[name]}: no {path.relative_to(ROOT)}, skipped")
    names = list(configs)
    if not names:
        p.error(f"no method has a {a.task} config")
    if REF not in names and a.target is None:
        p.error(f"without {REF} (examples/{PREFIX[a.task]}_{REF}.yaml) there is no target: give --target")
    yamls = {n: yaml.safe_load(c.read_text()) for n, c in configs.items()}
    extra = {n: [] if (y.get("run") or {}).get("threads") else [f"run.threads={THREADS}"] for n, y in yamls.items()}
    counts = sorted({(y.get("run") or {}).get("threads") or THREADS for y in yamls.values()})
    threads, busy_load = "/".join(map(str, counts)), max(counts) + 0.5  # a run's own threads keep the load near their count
    available = min(held_out(y["data"]["eval"]) for y in yamls.values())
    n_prompts = a.eval_prompts or available
    if n_prompts > available:
        p.error(f"--eval-prompts {n_prompts}: the eval split has only {available} held-out prompts")
    n_eval = n_prompts * a.eval_samples
    if a.base is not None:
        meta = Path(a.base) / "flow_policy.json"
        if not meta.is_file():
            p.error(f"--base {a.base}: not a regen flow model folder (no flow_policy.json)")
        if (len(json.loads(meta.read_text()).get("sample_shape", [])) == 4) != (a.task == "video"):
            p.error(f"--base {a.base}: not a{'' if a.task == 'video' else 'n'} {a.task} model (its sample_shape)")
    rev, cpus, loads = git_describe(), os.cpu_count(), [load_avg()]
    last_seed = a.first_seed + a.seeds - 1
    methods = ", ".join(METHODS[n] for n in names)
    print(f"git describe: {rev}\ntask: {a.task}; methods: {methods}; seeds {a.first_seed}..{last_seed}, "
          f"alternated\neval: {n_prompts} held-out prompts x {a.eval_samples} samples = {n_eval} per evaluation"
          f"{f' (under {MIN_EVAL}: too few to rank methods)' if n_eval < MIN_EVAL else ''}\n"
          f"torch threads per run (run.threads): {threads}; {cpus} CPU cores; load average (1 min) at start: {loads[0]}",
          flush=True)
    work = Path(a.work).resolve() if a.work else Path(tempfile.mkdtemp(prefix="regen-flow-methods-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"run folders (kept, for their metrics.jsonl): {work}", flush=True)
    base = a.base
    if base is None:
        sft = f"examples/{PREFIX[a.task]}_sft.yaml"
        print(f"building the base ({sft}) ...", flush=True)
        regen("sft", sft, f"run.dir={work / 'sft'}", "run.overwrite=true", "log.progress=none", "log.tensorboard=false")
        base = str(work / "sft" / "export")
    base = Path(base).resolve()

    runs, busy = [], 0
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        k = seed % len(names)
        for name in names[k:] + names[:k]:  # rotated each round
            run_dir, run_load = work / f"{name}-seed{seed}", load_avg()
            sets = [f"model.path={base}", f"run.dir={run_dir}", "run.overwrite=true", "log.progress=none",
                    "log.tensorboard=false", "checkpoint.every=0", f"run.seed={seed}", f"eval.every={a.eval_every}",
                    f"eval.num_prompts={n_prompts}", f"eval.samples_per_prompt={a.eval_samples}", *extra[name]]
            if a.steps is not None:
                sets.append(f"train.steps={a.steps}")
            sets += [kv.split(":", 1)[1] for kv in a.set if kv.split(":", 1)[0] == name]
            if name in lrs:
                sets.append(f"optim.lr={lrs[name]}")
            print(f"[{len(runs) + 1}/{a.seeds * len(names)}] {METHODS[name]} seed {seed}: {configs[name].relative_to(ROOT)} "
                  f"{' '.join(sets[6:])} (load average before: {run_load}) ...", flush=True)
            if run_load > busy_load:
                busy += 1
                print(f"WARNING: load average {run_load} > {busy_load} (the runs' threads + 0.5) before this run: something "
                      "else is running, its timings are not comparable", flush=True)
            call_s = regen("train", str(configs[name]), *sets)
            r = {"name": name, "label": METHODS[name], "seed": seed, "config": str(configs[name].relative_to(ROOT)),
                 "run_dir": str(run_dir), "call_s": call_s, "load_before": run_load, **curve(run_dir)}
            runs.append(r)
            print(f"  eval/reward {r['reward_at_0']:.4f} -> {r['final_reward']:.4f}, eval/adherence_accuracy "
                  f"{r['adherence_at_0']:.3f} -> {r['final_adherence']:.3f} ({len(r['steps'])} evaluations of "
                  f"{r['eval_count']} samples = {r['eval_prompts']} prompts x {r['eval_samples_per_prompt']}), "
                  f"{r['train_s']:.1f} s training ({call_s:.1f} s whole command)", flush=True)
    loads.append(load_avg())
    threads_used = "/".join(sorted({str(r["threads"]) for r in runs}))
    print(f"load average (1 min) at end: {loads[1]}; torch threads per run (run.threads): {threads_used}; git describe: "
          f"{git_describe()}")

    warnings = [f"{busy} of {len(runs)} runs started with a load average above {busy_load}"] if busy else []
    # one base and one eval noise per seed: the step-0 evals must agree
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        rs = [r for r in runs if r["seed"] == seed]
        if any(abs(r["reward_at_0"] - rs[0]["reward_at_0"]) > 1e-6 or abs(r["adherence_at_0"] - rs[0]["adherence_at_0"]) > 1e-6
               for r in rs):
            warnings.append(f"seed {seed}: the methods' step-0 evals differ ("
                            + ", ".join(f"{r['name']} {r['reward_at_0']:.6f}/{r['adherence_at_0']:.4f}" for r in rs)
                            + "): not the same base or eval")
    ref = [r for r in runs if r["name"] == REF]
    target = a.target if a.target is not None else statistics.fmean(r["final_reward"] for r in ref)
    source = "--target" if a.target is not None else f"{METHODS[REF]}'s final eval/reward, mean of {len(ref)} seeds"
    first = [r for r in runs if r["name"] == names[0]]
    base_rew, base_adh = (statistics.fmean(r[k] for r in first) for k in ("reward_at_0", "adherence_at_0"))
    if target <= base_rew:
        warnings.append(f"the target {target:.4f} is not above the base's eval/reward {base_rew:.4f} (mean over seeds): "
                        "time to target measures little")
    if ref and statistics.fmean(r["final_adherence"] for r in ref) < base_adh:
        warnings.append(f"{METHODS[REF]}'s mean final eval/adherence_accuracy is below the base's {base_adh:.3f}: "
                        "its own end point fails the adherence condition")
    for w in warnings:
        print(f"WARNING: {w}")
    summary = summarize(runs, names, target)
    print(f"\ntarget: eval/reward >= {target:.4f} ({source}) at two consecutive evaluations, and eval/adherence_accuracy "
          f">= the run's step 0 (mean {base_adh:.3f}); {a.seeds} seeds, {n_eval} held-out samples per evaluation; "
          f"speed-ups: {METHODS[REF]}'s mean whole run / the mean to target, '-' unless every seed reached it; "
          f"to-target columns over the seeds that reached it; {rev}")
    report(summary, runs)

    today = datetime.date.today().isoformat()
    batches = sorted({(r["global_batch_size"], r["group_size"]) for r in runs})
    per_step = ", ".join(f"{b} {a.task}s per step ({b // g} prompts x {g})" for b, g in batches)
    steps = a.steps if a.steps is not None else "configs'"
    if a.out:
        settings = {"date": today, "task": a.task, "base": str(base), "work": str(work), "seeds": a.seeds,
                    "first_seed": a.first_seed,
                    "methods": names, "steps": a.steps, "eval_every": a.eval_every, "eval_prompts": n_prompts,
                    "eval_samples_per_prompt": a.eval_samples, "eval_count": n_eval, "lr_overrides": lrs,
                    "target": target, "target_source": source, "base_reward": base_rew, "base_adherence": base_adh,
                    "warnings": warnings, "load_avg_1min": loads, "threads": threads_used, "cpu_count": cpus, "git": rev}
        Path(a.out).write_text(json.dumps({"settings": settings, "runs": runs, "summary": summary}, indent=1))
        print(f"results written to {a.out}")
    plot(a.png, runs, summary, target, source, base_adh,
         f"regen flow RL methods on {a.task} shapes from one base ({base.parent.name}/{base.name}): {per_step}, {steps} "
         f"steps, eval every {a.eval_every} on {n_eval} held-out samples, {a.seeds} seeds\n{today}, {cpus} CPU cores, "
         f"{threads_used} threads per run, load {loads[0]}->{loads[1]}, {rev}")


if __name__ == "__main__":
    main()
