"""Flow-matching RL methods from one base: held-out reward and prompt adherence against training wall-clock.

Runs each shapes RL example config (`examples/shapes_flow_grpo.yaml`, `shapes_flow_dppo.yaml`,
`shapes_nft.yaml`, `shapes_awm.yaml`: Flow-GRPO, Flow-DPPO, DiffusionNFT, AWM) as
`python -m regen train CONFIG ...` from the same flow base model (the built-in 16x16 shapes
UNet after `regen sft examples/shapes_sft.yaml`), each with the config's own method settings and
learning rate and the same reward (prompt adherence + JPEG compressibility) and images per step
(rollout.global_batch_size). The only overrides: model.path, run.dir, eval.every,
checkpoint.every=0, log.progress=none, log.tensorboard=false, run.overwrite=true, and, when asked,
train.steps (--steps) and optim.lr (--lr).

Measures, from each run's metrics.jsonl: held-out reward (`eval/reward`: 12 unseen prompts x 4
ODE samples, fixed noise) and prompt adherence (`eval/adherence_accuracy`: the fraction of those samples
whose colour, shape and position the built-in classifier reads back) at step 0, every
--eval-every steps and at the end, against training wall-clock = cumulative `time/step_s`
(evaluation, model loading and export are not counted) and against images sampled for training
= step x rollout.global_batch_size (evaluation samples not counted).

Target: Flow-GRPO's final eval/reward (or --target). For each method it reports the first eval
point after step 0 with eval/reward >= target and eval/adherence_accuracy >= the base's (that run's step
0), its training seconds and images, and the speed-up against Flow-GRPO's whole run (Flow-GRPO's
training seconds / the method's seconds to target; images likewise), "-" if never reached. Prints
a table (lr, steps, reward at step 0, final reward and adherence, training seconds, median step
time, seconds and images to target, both speed-ups), the 1-min load average before every run
(timings mean something only on an otherwise idle machine) and `git describe --always --dirty`;
draws reward and adherence against wall-clock into one PNG (default docs/flow_methods.png).

Run from the repository root with the project's virtualenv (needs matplotlib):

    python bench/flow_methods.py --base runs/demo-shapes-sft/export   # ~12 min on an idle 2-core machine
    python bench/flow_methods.py        # builds the base first (examples/shapes_sft.yaml, ~6 min on 2 cores)
    python bench/flow_methods.py --base runs/demo-shapes-sft/export --only flow_grpo,nft --lr nft=3e-4 --out /tmp/fm.json
    python bench/flow_methods.py --base runs/demo-shapes-sft/export --steps 2 --eval-every 1 --png /tmp/fm.png  # smoke, ~2 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from _runs import ROOT, eval_points, regen

REF = "flow_grpo"  # the method whose final reward is the target and whose whole run is the baseline
METHODS = {  # name -> (config, label); the reference first
    "flow_grpo": ("examples/shapes_flow_grpo.yaml", "Flow-GRPO"),
    "flow_dppo": ("examples/shapes_flow_dppo.yaml", "Flow-DPPO"),
    "nft": ("examples/shapes_nft.yaml", "DiffusionNFT"),
    "awm": ("examples/shapes_awm.yaml", "AWM"),
}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def curve(run_dir: Path) -> dict:
    """Eval points of one run against training seconds and images sampled, plus its resolved settings."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    batch = cfg["rollout"]["global_batch_size"]
    c = eval_points(run_dir / "metrics.jsonl", ["eval/reward", "eval/adherence_accuracy"])
    steps = c["steps"]
    if not steps or steps[0] != 0:
        sys.exit(f"{run_dir / 'metrics.jsonl'}: no eval/reward at step 0 (is data.eval set?)")
    return {
        "lr": cfg["optim"]["lr"],
        "train_steps": cfg["train"]["steps"],
        "global_batch_size": batch,
        "group_size": cfg["rollout"]["group_size"],
        "steps": steps,
        "seconds": c["seconds"],
        "images": [s * batch for s in steps],
        "reward": c["eval/reward"],
        "adherence": c["eval/adherence_accuracy"],
        "train_s": c["train_s"],
        "train_images": c["last_step"] * batch,
        "median_step_ms": c["median_step_ms"],
    }


def to_target(r: dict, target: float) -> int | None:
    """Index of the first eval point after step 0 with reward >= target and adherence >= step 0's."""
    base_adh = r["adherence"][0]
    for i in range(1, len(r["steps"])):
        if r["reward"][i] >= target and r["adherence"][i] >= base_adh:
            return i
    return None


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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Without --base the benchmark first trains a base with examples/shapes_sft.yaml "
        "(about 6 min on 2 CPU cores). The four runs at the configs' 200 steps take about 12 min on an "
        "idle 2-core machine.",
    )
    p.add_argument("--base", help="flow model folder with flow_policy.json (default: build one from examples/shapes_sft.yaml)")
    p.add_argument("--work", help="folder for the run folders (default: a new temporary folder); kept afterwards")
    p.add_argument("--steps", type=int, help="train.steps of every run (default: each config's own, 200)")
    p.add_argument("--eval-every", type=int, default=25, help="eval.every of every run (default 25)")
    p.add_argument("--only", help="comma-separated subset of: " + ",".join(METHODS))
    p.add_argument("--lr", help="optim.lr overrides, e.g. nft=3e-4,awm=3e-4 (default: each config's own)")
    p.add_argument("--target", type=float, help="eval/reward to reach (default: Flow-GRPO's final eval/reward)")
    p.add_argument("--png", default=str(ROOT / "docs" / "flow_methods.png"), help="figure (default docs/flow_methods.png)")
    p.add_argument("--out", help="write settings, curves and the table as JSON here")
    a = p.parse_args()
    names = list(dict.fromkeys(a.only.split(","))) if a.only else list(METHODS)
    if unknown := set(names) - set(METHODS):
        p.error(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}")
    if REF not in names and a.target is None:
        p.error(f"without {REF} in --only there is no target: give --target")
    lrs = parse_lr(a.lr, p)
    if a.base is not None and not (Path(a.base) / "flow_policy.json").is_file():
        p.error(f"--base {a.base}: not a regen flow model folder (no flow_policy.json)")
    git = ["git", "describe", "--always", "--dirty"]
    rev = subprocess.run(git, check=False, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    loads = [load()]
    print(f"git describe: {rev}\nload average (1 min) at start: {loads[0]}", flush=True)
    work = Path(a.work).resolve() if a.work else Path(tempfile.mkdtemp(prefix="regen-flow-methods-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"run folders (kept, for their metrics.jsonl): {work}", flush=True)
    base = a.base
    if base is None:
        print("building the base (examples/shapes_sft.yaml, ~6 min on 2 cores) ...", flush=True)
        regen(
            "sft",
            "examples/shapes_sft.yaml",
            f"run.dir={work / 'sft'}",
            "run.overwrite=true",
            "log.progress=none",
            "log.tensorboard=false",
        )
        base = str(work / "sft" / "export")
    base = Path(base).resolve()

    results = {}
    for name in names:
        config, label = METHODS[name]
        run_dir, run_load = work / name, load()
        sets = [
            f"model.path={base}",
            f"run.dir={run_dir}",
            "run.overwrite=true",
            "log.progress=none",
            "log.tensorboard=false",
            f"eval.every={a.eval_every}",
            "checkpoint.every=0",
        ]
        if a.steps is not None:
            sets.append(f"train.steps={a.steps}")
        if name in lrs:
            sets.append(f"optim.lr={lrs[name]}")
        print(f"{label}: {config} {' '.join(sets[5:])} (load average before: {run_load}) ...", flush=True)
        call_s = regen("train", config, *sets)
        r = results[name] = {"label": label, "config": config, **curve(run_dir), "call_s": call_s, "load_before": run_load}
        print(
            f"  eval/reward {r['reward'][0]:.4f} -> {r['reward'][-1]:.4f}, eval/adherence_accuracy {r['adherence'][0]:.3f} -> "
            f"{r['adherence'][-1]:.3f}, {r['train_s']:.1f} s training ({call_s:.1f} s whole command)",
            flush=True,
        )
    loads.append(load())
    print(f"load average (1 min) at end: {loads[1]}")

    # checks: one base for all, a target above it
    first = next(iter(results.values()))
    base_reward, base_adh = first["reward"][0], first["adherence"][0]
    for name, r in results.items():
        if abs(r["reward"][0] - base_reward) > 1e-6 or abs(r["adherence"][0] - base_adh) > 1e-6:
            print(
                f"WARNING: {name}'s step-0 eval (reward {r['reward'][0]:.6f}, adherence {r['adherence'][0]:.4f}) differs "
                f"from {first['label']}'s ({base_reward:.6f}, {base_adh:.4f}): not the same base or eval"
            )
    ref = results.get(REF)
    target = a.target if a.target is not None else ref["reward"][-1]
    source = "--target" if a.target is not None else f"{METHODS[REF][1]}'s final eval/reward"
    warnings = []
    if target <= base_reward:
        warnings.append(
            f"the target {target:.4f} is not above the base's eval/reward {base_reward:.4f}: the base already "
            "has it, only eval points after step 0 count, and time to target measures little"
        )
    if ref is not None and ref["adherence"][-1] < ref["adherence"][0]:
        warnings.append(
            f"{METHODS[REF][1]}'s final eval/adherence_accuracy {ref['adherence'][-1]:.3f} is below the base's "
            f"{ref['adherence'][0]:.3f}: its own end point fails the adherence condition"
        )
    for w in warnings:
        print(f"WARNING: {w}")

    table = []
    for name, r in results.items():
        i = to_target(r, target)
        hit_s = r["seconds"][i] if i is not None else None
        hit_img = r["images"][i] if i is not None else None
        row = {
            "method": r["label"],
            "name": name,
            "lr": r["lr"],
            "steps": r["train_steps"],
            "reward_at_0": r["reward"][0],
            "final_reward": r["reward"][-1],
            "final_adherence": r["adherence"][-1],
            "train_s": r["train_s"],
            "median_step_ms": r["median_step_ms"],
            "target_step": r["steps"][i] if i is not None else None,
            "target_s": hit_s,
            "target_images": hit_img,
            "speedup_time": ref["train_s"] / hit_s if ref and hit_s else None,
            "speedup_images": ref["train_images"] / hit_img if ref and hit_img else None,
        }
        r["target_s"], r["target_images"] = hit_s, hit_img
        table.append(row)

    def fmt(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(
        f"\ntarget: eval/reward >= {target:.4f} ({source}) and eval/adherence_accuracy >= the base's ({base_adh:.3f}); "
        f"speed-ups against {METHODS[REF][1]}'s whole run; {rev}"
    )
    head = [
        "method",
        "lr",
        "steps",
        "reward@0",
        "final rew",
        "final adh",
        "train s",
        "med step ms",
        "s to tgt",
        "img to tgt",
        "speedup t",
        "speedup img",
    ]
    widths = [14, 8, 7, 10, 11, 11, 9, 13, 10, 12, 11, 13]
    print("".join(f"{h:<{w}}" if j == 0 else f"{h:>{w}}" for j, (h, w) in enumerate(zip(head, widths))))
    for row in table:
        cells = [
            row["method"],
            f"{row['lr']:g}",
            str(row["steps"]),
            f"{row['reward_at_0']:.4f}",
            f"{row['final_reward']:.4f}",
            f"{row['final_adherence']:.3f}",
            f"{row['train_s']:.1f}",
            f"{row['median_step_ms']:.1f}",
            fmt(row["target_s"], ".1f"),
            fmt(row["target_images"], "d"),
            fmt(row["speedup_time"], ".2f") + ("x" if row["speedup_time"] else ""),
            fmt(row["speedup_images"], ".2f") + ("x" if row["speedup_images"] else ""),
        ]
        print("".join(f"{c:<{w}}" if j == 0 else f"{c:>{w}}" for j, (c, w) in enumerate(zip(cells, widths))))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    today = datetime.date.today().isoformat()
    batches = sorted({(r["global_batch_size"], r["group_size"]) for r in results.values()})
    per_step = ", ".join(f"{b} images per step ({b // g} prompts x {g})" for b, g in batches)
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(14, 6), dpi=120)
    for i, r in enumerate(results.values()):
        style = {"color": f"C{i}", "marker": "os^D"[i % 4], "lw": 1.8, "ms": 4}
        ax_r.plot(r["seconds"], r["reward"], **style, label=f"{r['label']}, lr {r['lr']:g} ({r['reward'][-1]:.3f})")
        ax_a.plot(r["seconds"], r["adherence"], **style, label=f"{r['label']} ({r['adherence'][-1]:.3f})")
        if r["target_s"] is not None:
            j = r["seconds"].index(r["target_s"])
            ax_r.plot([r["target_s"]], [r["reward"][j]], "*", color=f"C{i}", ms=16, mec="black", zorder=5)
    ax_r.axhline(target, color="grey", lw=1, ls="--", label=f"target {target:.3f} ({source})")
    ax_a.axhline(base_adh, color="grey", lw=1, ls="--", label=f"base {base_adh:.3f}")
    ax_r.set_ylabel("held-out eval/reward (adherence + JPEG compressibility)")
    ax_a.set_ylabel("held-out eval/adherence_accuracy (fraction drawn as prompted)")
    for ax in (ax_r, ax_a):
        ax.set_xlabel("training wall-clock, s (sum of time/step_s; evaluation not counted)")
        ax.grid(alpha=0.3)
    ax_r.legend(title="method (final); * = target reached", fontsize=8)
    ax_a.legend(title="method (final)", fontsize=8)
    steps = a.steps if a.steps is not None else "configs'"
    fig.suptitle(
        f"regen flow RL methods on 16x16 shapes from one base ({base.parent.name}/{base.name}): {per_step}, "
        f"{steps} steps, eval every {a.eval_every}\n{today}, {os.cpu_count()} CPU cores, "
        f"load {loads[0]}->{loads[1]}, {rev}",
        fontsize=10,
    )
    Path(a.png).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.png)
    print(f"figure written to {a.png}")
    if a.out:
        meta = {
            "date": today,
            "base": str(base),
            "work": str(work),
            "steps": a.steps,
            "eval_every": a.eval_every,
            "lr_overrides": lrs,
            "target": target,
            "target_source": source,
            "base_reward": base_reward,
            "base_adherence": base_adh,
            "warnings": warnings,
            "load_avg_1min": loads,
            "cpu_count": os.cpu_count(),
            "git": rev,
        }
        Path(a.out).write_text(json.dumps({"settings": meta, "results": results, "table": table}, indent=1))
        print(f"figures written to {a.out}")


if __name__ == "__main__":
    main()
