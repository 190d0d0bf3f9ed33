"""Flow-matching RL methods from one or more bases, over seeds: held-out reward and adherence against training wall-clock.

Runs each method's shapes RL example config as `python -m regen train CONFIG ...` from each flow
base (--base, repeatable; or --bases N built from the task's SFT config with run.seed 0..N-1), once
per seed (--seeds N: run.seed = 0..N-1), alternated in one process: seed 0 of every method on every
base, then seed 1 with the order rotated by one, and so on, so that drift of the machine hits all
methods alike. A base moves which seeds reach the target (bench/README.md): reach is over bases x
seeds. Methods (--only picks some): flow_grpo (Flow-GRPO, the reference),
flow_dppo (Flow-DPPO), nft (DiffusionNFT), awm (AWM) and dgpo (DGPO). Configs: --task image (the
default) `examples/shapes_<method>.yaml`, 16x16 images from a base of `regen sft
examples/shapes_sft.yaml`; --task video `examples/moving_shapes_<method>.yaml`, 8-frame videos from
a base of `examples/moving_shapes_sft.yaml`; --config METHOD=PATH runs another config for a method
(e.g. nft=examples/shapes_nft_fast.yaml). A method without a config for the task is skipped with a
printed line. Each run keeps its config's method settings, learning rate, reward and images per
step (rollout.global_batch_size). The only overrides: model.path, run.dir, run.seed, eval.every,
eval.num_prompts and eval.samples_per_prompt (--eval-prompts, default all 12 held-out prompts, x
--eval-samples, default 32: 384 ODE samples per evaluation, on noise fixed per seed),
checkpoint.every=0 (= eval.every where the config rolls back on alerts: health.rollback_on_alert
returns to a checkpoint), log.progress=none, log.tensorboard=false, run.overwrite=true, run.threads=2
where the config sets no thread count, and when asked train.steps (--steps), optim.lr (--lr) and any
key of one method (--set nft:train.ppo_epochs=2, repeatable).

Measures, from each run's metrics.jsonl: held-out reward (`eval/reward`) and prompt adherence
(`eval/adherence_accuracy`: the fraction of samples whose colour, shape and position or motion the
built-in classifier reads back) at step 0, every --eval-every steps and at the end, against training
wall-clock = cumulative `time/step_s` (evaluation, loading and export not counted) and images
sampled for training = step x rollout.global_batch_size (evaluation samples not counted).

Target, per base: Flow-GRPO's final eval/reward averaged over its seeds on that base (or --target,
one value or one per base). A run reaches it at the
first eval point after step 0 where the reward holds the target at two consecutive evaluations (that
point and the next; the final eval counts as a next one, so the final point alone never qualifies)
and the adherence is no lower than the run's step 0 (the base's); it holds it when its final
evaluation is at or above the target and its final adherence at or above step 0's. Per method, over
its runs (bases x seeds): how many reached it and how many held it, mean, std (n-1) and min..max of
training seconds, images and adherence at that point (over the runs that reached it), of final
reward and adherence and of training seconds; and the speed-ups: Flow-GRPO's mean whole-run
training seconds (images) / the method's mean seconds (images) to target, and the worst: / its
slowest run's seconds, "-" unless every run reached it. Also each run's own figures,
`git describe --always --dirty`, the runs' torch threads and the 1-min load average at the start,
before every run (a WARNING above the runs' thread count + 0.5: something else is running) and at
the end.
--png (default docs/flow_methods.png; needs matplotlib): reward and adherence against training
wall-clock, per method the mean over seeds at each eval point with the min..max shaded.
--out FILE: settings, every run's curves and the summary as JSON. --reuse METHOD=PATH takes METHOD's
runs from such a file instead of running them again (matched by base folder and seed; a run of a
base or seed the file lacks still runs), so that one more base or the reference can be added later
and the whole table summarised in one place.

Run from the repository root with the project's virtualenv:

    python bench/flow_methods.py --base runs/demo-shapes-sft/export        # 3 seeds, ~1 h on an idle 2-core machine
    python bench/flow_methods.py      # builds the base first (examples/shapes_sft.yaml, ~6 min on 2 cores)
    python bench/flow_methods.py --task video --base runs/demo-moving-shapes-sft/export
    python bench/flow_methods.py --bases 2 --only flow_grpo,nft --config nft=examples/shapes_nft_trust.yaml \\
        --eval-every 10 --set flow_grpo:eval.every=50      # two bases x 3 seeds, ~1 h 35 min
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
from _flow_report import plot, report
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


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def to_target(r: dict, target: float) -> int | None:
    """Index of the first eval point after step 0 whose reward and the next point's are >= target and whose
    adherence is >= step 0's; None if none (the final point has no next one)."""
    rew, adh = r["reward"], r["adherence"]
    for i in range(1, len(rew) - 1):
        if rew[i] >= target and rew[i + 1] >= target and adh[i] >= adh[0]:
            return i
    return None


def summarize(runs: list[dict], names: list[str], targets: dict[str, float]) -> dict:
    """Marks each run's target point (its base's target) and speed-ups; per method the spread over
    its runs, every base and seed (see the docstring)."""
    ref = [r for r in runs if r["name"] == REF]
    ref_s, ref_img = spread([r["train_s"] for r in ref]), spread([r["train_images"] for r in ref])
    out = {}
    for name in names:
        rs = [r for r in runs if r["name"] == name]
        for r in rs:
            target = targets[r["base"]]
            i = to_target(r, target)
            r["target"] = target
            r["target_step"], r["target_s"], r["target_images"], r["target_adherence"] = (
                (None,) * 4 if i is None else (r["steps"][i], r["seconds"][i], r["images"][i], r["adherence"][i]))
            r["speedup_time"] = ref_s["mean"] / r["target_s"] if ref_s and r["target_s"] else None
            r["speedup_images"] = ref_img["mean"] / r["target_images"] if ref_img and r["target_images"] else None
            # held: it ends at or above its base's target and at or above its own step 0's adherence
            r["held"] = r["final_reward"] >= target and r["final_adherence"] >= r["adherence_at_0"]
        keys = ("target_s", "target_images", "target_adherence", "final_reward", "final_adherence", "train_s",
                "train_images", "median_step_ms", "reward_at_0", "adherence_at_0")
        s = out[name] = {"label": METHODS[name], "config": rs[0]["config"], "lr": sorted({r["lr"] for r in rs}),
                         "steps": rs[0]["train_steps"], "seeds": len(rs),
                         "reached": sum(r["target_s"] is not None for r in rs), "held": sum(r["held"] for r in rs),
                         **{k: spread([r[k] for r in rs]) for k in keys}}
        every = s["reached"] == len(rs)
        s["speedup_time"] = ref_s["mean"] / s["target_s"]["mean"] if every and ref_s else None
        s["speedup_images"] = ref_img["mean"] / s["target_images"]["mean"] if every and ref_img else None
        # the slowest run against the reference's mean: what a user who cannot pick seeds gets at worst
        s["speedup_worst"] = ref_s["mean"] / s["target_s"]["max"] if every and ref_s else None
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Without --base the benchmark first trains a base "
                                "with examples/<shapes|moving_shapes>_sft.yaml (about 6 min on 2 CPU cores for images).")
    p.add_argument("--task", choices=list(PREFIX), default="image", help="image (default): examples/shapes_*.yaml; "
                   "video: examples/moving_shapes_*.yaml")
    p.add_argument("--base", action="append", default=[], help="flow model folder with flow_policy.json; repeat for "
                   "several bases (each method x seed runs on each; default: build --bases of them)")
    p.add_argument("--bases", type=int, default=1, help="without --base: build this many bases from the task's SFT "
                   "config, run.seed 0..N-1 (default 1)")
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
    p.add_argument("--config", action="append", default=[], metavar="METHOD=PATH",
                   help="another config for one method, e.g. nft=examples/shapes_nft_fast.yaml (default: "
                   "examples/<task prefix>_<method>.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="an extra override for one method's runs, e.g. nft:train.ppo_epochs=2 (repeatable)")
    p.add_argument("--reuse", action="append", default=[], metavar="METHOD=PATH",
                   help="take METHOD's runs from an earlier --out JSON instead of running them again: a run of the "
                   "same base folder and seed counts as if run here (its config and settings are the earlier "
                   "invocation's, listed there); e.g. flow_grpo=bench/results/x.json (repeatable)")
    p.add_argument("--target", help="eval/reward to reach, one value or one per base comma-separated (default: "
                   "Flow-GRPO's mean final eval/reward on each base)")
    p.add_argument("--png", default=str(ROOT / "docs" / "flow_methods.png"), help="figure (default docs/flow_methods.png)")
    p.add_argument("--out", help="write settings, every run's curves and the summary as JSON here")
    a = p.parse_args()
    wanted = list(dict.fromkeys(a.only.split(","))) if a.only else list(METHODS)
    if unknown := set(wanted) - set(METHODS):
        p.error(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}")
    if a.seeds < 1 or a.eval_samples < 1 or a.bases < 1 or (a.eval_prompts is not None and a.eval_prompts < 1):
        p.error("--seeds, --bases, --eval-prompts and --eval-samples must be >= 1")
    n_bases = len(a.base) or a.bases
    try:
        fixed = [float(x) for x in a.target.split(",")] if a.target else None
    except ValueError:
        p.error(f"--target {a.target!r}: numbers, one or one per base, comma-separated")
    if fixed is not None and len(fixed) not in (1, n_bases):
        p.error(f"--target has {len(fixed)} values for {n_bases} bases: give one, or one per base")
    lrs = parse_lr(a.lr, p)
    for kv in a.set:
        if ":" not in kv or "=" not in kv or kv.split(":", 1)[0] not in METHODS:
            p.error(f"--set {kv}: write METHOD:KEY=VALUE with METHOD one of {list(METHODS)}")
    chosen = {}
    for kv in a.config:
        name, sep, path = kv.partition("=")
        if not sep or name not in METHODS or not Path(path).is_file():
            p.error(f"--config {kv}: write METHOD=PATH with METHOD one of {list(METHODS)} and PATH an existing file")
        chosen[name] = Path(path).resolve()
    reuse = {}  # (method, base folder, seed) -> an earlier run's record
    for kv in a.reuse:
        name, sep, path = kv.partition("=")
        if not sep or name not in METHODS or not Path(path).is_file():
            p.error(f"--reuse {kv}: write METHOD=PATH with METHOD one of {list(METHODS)} and PATH an --out JSON")
        try:
            earlier = json.loads(Path(path).read_text())
            folders = [str(Path(b).resolve()) for b in earlier["settings"]["bases"]]
            for r in earlier["runs"]:
                if r["name"] == name:
                    reuse[name, folders[r["base"]], r["seed"]] = {**r, "reused_from": path}
        except (ValueError, KeyError, IndexError, TypeError) as e:
            p.error(f"--reuse {kv}: not a flow_methods.py --out JSON ({type(e).__name__}: {e})")
    configs = {}
    for name in wanted:
        path = chosen.get(name, ROOT / "examples" / f"{PREFIX[a.task]}_{name}.yaml")
        if path.exists():
            configs[name] = path
        else:
            print(f"{METHODS[name]}: no {shown(path)}, skipped")
    names = list(configs)
    if not names:
        p.error(f"no method has a {a.task} config")
    if unused := sorted({n for n, _, _ in reuse} - set(names)):
        p.error(f"--reuse {', '.join(unused)}: not among the methods run here ({', '.join(names)}); add it to --only")
    if REF not in names and fixed is None:
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
    for b in a.base:
        meta = Path(b) / "flow_policy.json"
        if not meta.is_file():
            p.error(f"--base {b}: not a regen flow model folder (no flow_policy.json)")
        if (len(json.loads(meta.read_text()).get("sample_shape", [])) == 4) != (a.task == "video"):
            p.error(f"--base {b}: not a{'' if a.task == 'video' else 'n'} {a.task} model (its sample_shape)")
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
    bases = list(a.base)
    for k in range(0 if bases else a.bases):
        sft = f"examples/{PREFIX[a.task]}_sft.yaml"
        print(f"building base {k} ({sft}, run.seed={k}) ...", flush=True)
        regen("sft", sft, f"run.dir={work / f'sft{k}'}", f"run.seed={k}", "run.overwrite=true", "log.progress=none",
              "log.tensorboard=false")
        bases.append(str(work / f"sft{k}" / "export"))
    bases = [Path(b).resolve() for b in bases]
    for k, b in enumerate(bases):
        print(f"base {k}: {b}")

    runs, busy, total = [], 0, a.seeds * len(names) * len(bases)
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for k, base in enumerate(bases):
            turn = (seed + k) % len(names)
            for name in names[turn:] + names[:turn]:  # rotated each round
                if (earlier := reuse.get((name, str(base), seed))) is not None:
                    runs.append({**earlier, "base": k})
                    print(f"[{len(runs)}/{total}] {METHODS[name]} base {k} seed {seed}: reused from "
                          f"{earlier['reused_from']} ({earlier['config']}, {earlier['run_dir']}): eval/reward "
                          f"{earlier['reward_at_0']:.4f} -> {earlier['final_reward']:.4f}", flush=True)
                    continue
                run_dir, run_load = work / f"{name}-base{k}-seed{seed}", load_avg()
                # no checkpoints unless the config rolls back to them (health.rollback_on_alert)
                every = "checkpoint.every=0" if not (yamls[name].get("health") or {}).get("rollback_on_alert") \
                    else f"checkpoint.every={a.eval_every}"
                sets = [f"model.path={base}", f"run.dir={run_dir}", "run.overwrite=true", "log.progress=none",
                        "log.tensorboard=false", every, f"run.seed={seed}", f"eval.every={a.eval_every}",
                        f"eval.num_prompts={n_prompts}", f"eval.samples_per_prompt={a.eval_samples}", *extra[name]]
                if a.steps is not None:
                    sets.append(f"train.steps={a.steps}")
                sets += [kv.split(":", 1)[1] for kv in a.set if kv.split(":", 1)[0] == name]
                if name in lrs:
                    sets.append(f"optim.lr={lrs[name]}")
                print(f"[{len(runs) + 1}/{total}] {METHODS[name]} base {k} seed {seed}: "
                      f"{shown(configs[name])} {' '.join(sets[6:])} (load average before: {run_load}) ...",
                      flush=True)
                if run_load > busy_load:
                    busy += 1
                    print(f"WARNING: load average {run_load} > {busy_load} (the runs' threads + 0.5) before this run: "
                          "something else is running, its timings are not comparable", flush=True)
                call_s = regen("train", str(configs[name]), *sets, stopped_ok=True)  # its last evaluation is its final
                r = {"name": name, "label": METHODS[name], "base": k, "seed": seed,
                     "config": shown(configs[name]), "run_dir": str(run_dir), "call_s": call_s,
                     "load_before": run_load, **curve(run_dir)}
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
    for k in range(len(bases)):
        for seed in range(a.first_seed, a.first_seed + a.seeds):
            rs = [r for r in runs if r["seed"] == seed and r["base"] == k]
            if any(abs(r["reward_at_0"] - rs[0]["reward_at_0"]) > 1e-6
                   or abs(r["adherence_at_0"] - rs[0]["adherence_at_0"]) > 1e-6 for r in rs):
                warnings.append(f"base {k} seed {seed}: the methods' step-0 evals differ ("
                                + ", ".join(f"{r['name']} {r['reward_at_0']:.6f}/{r['adherence_at_0']:.4f}" for r in rs)
                                + "): not the same base or eval")
    targets = {}
    for k in range(len(bases)):
        ref = [r for r in runs if r["name"] == REF and r["base"] == k]
        targets[k] = fixed[k if len(fixed) > 1 else 0] if fixed else statistics.fmean(r["final_reward"] for r in ref)
        first = [r for r in runs if r["name"] == names[0] and r["base"] == k]
        base_rew, base_adh = (statistics.fmean(r[key] for r in first) for key in ("reward_at_0", "adherence_at_0"))
        if targets[k] <= base_rew:
            warnings.append(f"base {k}: the target {targets[k]:.4f} is not above the base's eval/reward {base_rew:.4f} "
                            "(mean over seeds): time to target measures little")
        if ref and statistics.fmean(r["final_adherence"] for r in ref) < base_adh:
            warnings.append(f"base {k}: {METHODS[REF]}'s mean final eval/adherence_accuracy is below the base's "
                            f"{base_adh:.3f}: its own end point fails the adherence condition")
    source = "--target" if fixed else f"{METHODS[REF]}'s final eval/reward, mean of its seeds on that base"
    base_adh = statistics.fmean(r["adherence_at_0"] for r in runs if r["name"] == names[0])
    target = statistics.fmean(targets.values())
    for w in warnings:
        print(f"WARNING: {w}")
    summary = summarize(runs, names, targets)
    print(f"\ntarget per base: eval/reward >= {', '.join(f'{t:.4f}' for t in targets.values())} ({source}) at two "
          f"consecutive evaluations, and eval/adherence_accuracy >= the run's step 0 (mean {base_adh:.3f}); "
          f"{len(bases)} base(s) x {a.seeds} seeds, {n_eval} held-out samples per evaluation; reached: runs that hit "
          "it; held: runs that end at or above it and at or above their step-0 adherence; speed-ups: "
          f"{METHODS[REF]}'s mean whole run / the mean to target (worst: / the slowest run's), '-' unless every run "
          f"reached it; to-target columns over the runs that reached it; {rev}")
    report(summary, runs)

    today = datetime.date.today().isoformat()
    batches = sorted({(r["global_batch_size"], r["group_size"]) for r in runs})
    per_step = ", ".join(f"{b} {a.task}s per step ({b // g} prompts x {g})" for b, g in batches)
    steps = a.steps if a.steps is not None else "configs'"
    if a.out:
        settings = {"date": today, "task": a.task, "bases": [str(b) for b in bases], "work": str(work), "seeds": a.seeds,
                    "first_seed": a.first_seed,
                    "methods": names, "steps": a.steps, "eval_every": a.eval_every, "eval_prompts": n_prompts,
                    "eval_samples_per_prompt": a.eval_samples, "eval_count": n_eval, "lr_overrides": lrs,
                    "sets": a.set, "reused": a.reuse,
                    "targets": targets, "target_source": source, "base_adherence": base_adh,
                    "warnings": warnings, "load_avg_1min": loads, "threads": threads_used, "cpu_count": cpus, "git": rev}
        Path(a.out).write_text(json.dumps({"settings": settings, "runs": runs, "summary": summary}, indent=1))
        print(f"results written to {a.out}")
    plot(a.png, runs, summary, target, source, base_adh,
         f"regen flow RL methods on {a.task} shapes from {len(bases)} base(s): {per_step}, {steps} "
         f"steps, eval every {a.eval_every} on {n_eval} held-out samples, {a.seeds} seeds per base\n{today}, {cpus} CPU cores, "
         f"{threads_used} threads per run, load {loads[0]}->{loads[1]}, {rev}")


if __name__ == "__main__":
    main()
