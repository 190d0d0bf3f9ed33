"""Every LM algorithm example from one SFT base: held-out accuracy against training wall-clock.

Runs each `examples/arith_*.yaml` RL config (GRPO, PPO, DAPO, Dr.GRPO, RLOO, REINFORCE++, GSPO,
DPO, GRPO+LoRA) as `python -m regen train CONFIG ...` from the same SFT export, with the
config's own algorithm settings and only these overrides: model.path, run.dir,
train.steps, eval.every, checkpoint.every=0, log.progress=none, log.tensorboard=false.

Measures, from each run's metrics.jsonl: held-out accuracy (`eval/accuracy`, 500 test prompts x
4 samples at the training temperature) at step 0, every --eval-every steps and at the end,
against training wall-clock = cumulative `time/step_s` (evaluation, loading and export are not
counted). Draws all curves in one PNG (default docs/algorithms.png) and prints a table:
accuracy at step 0, final accuracy, training seconds, seconds until accuracy first reaches
--target at an eval point ("-" if never), and the median step time (robust to stalls when other
processes compete for the cores; the 1-min load average is printed before each run).

Run from the repository root with the project's virtualenv (needs matplotlib):

    python bench/algorithms.py --base runs/demo-sft/export          # ~2 min on an idle 2-core machine
    python bench/algorithms.py                                      # builds an SFT base first (~100 s)
    python bench/algorithms.py --base runs/demo-sft/export --only grpo,dpo --steps 100 --out /tmp/alg.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import tempfile
from pathlib import Path

from _runs import ROOT, eval_points, regen

NAMES = ["grpo", "ppo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dpo", "grpo_lora"]


def curve(metrics: Path) -> dict:
    c = eval_points(metrics, ["eval/accuracy"])
    return {"steps": c["steps"], "seconds": c["seconds"], "accuracy": c["eval/accuracy"], "train_s": c["train_s"],
            "median_step_ms": c["median_step_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="SFT export folder (default: build one from examples/arith_sft.yaml)")
    p.add_argument("--steps", type=int, default=300, help="train.steps of every run")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--only", help="comma-separated subset of: " + ",".join(NAMES))
    p.add_argument("--target", type=float, default=0.7, help="accuracy for the time-to-target column")
    p.add_argument("--png", default=str(ROOT / "docs" / "algorithms.png"))
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args()
    names = list(dict.fromkeys(a.only.split(","))) if a.only else NAMES
    if unknown := set(names) - set(NAMES):
        p.error(f"unknown algorithm(s) {sorted(unknown)}; choose from {NAMES}")
    load = [round(os.getloadavg()[0], 2)]
    print(f"load average (1 min) at start: {load[0]}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="regen-algorithms-"))
    print(f"run folders (kept, for their metrics.jsonl): {tmp}", flush=True)
    base = a.base
    if base is None:
        print("building the SFT base (examples/arith_sft.yaml) ...", flush=True)
        regen("sft", "examples/arith_sft.yaml", f"run.dir={tmp / 'sft'}", "run.overwrite=true", "log.progress=none")
        base = str(tmp / "sft" / "export")
    base = str(Path(base).resolve())
    results = {}
    for name in names:
        run_dir, run_load = tmp / name, round(os.getloadavg()[0], 2)
        call_s = regen("train", f"examples/arith_{name}.yaml", f"model.path={base}", f"run.dir={run_dir}",
                       "run.overwrite=true", "log.progress=none", "log.tensorboard=false",
                       f"eval.every={a.eval_every}", f"train.steps={a.steps}", "checkpoint.every=0")
        results[name] = {**curve(run_dir / "metrics.jsonl"), "call_s": call_s, "load_before": run_load}
        r = results[name]
        hit = [s for s, acc in zip(r["seconds"], r["accuracy"]) if acc >= a.target]
        r["target_s"] = hit[0] if hit else None
        print(f"{name}: accuracy {r['accuracy'][0]:.3f} -> {r['accuracy'][-1]:.3f}, "
              f"{r['train_s']:.1f} s training ({call_s:.1f} s whole command; load before {run_load})", flush=True)
    load.append(round(os.getloadavg()[0], 2))
    print(f"load average (1 min) at end: {load[1]}")

    today = datetime.date.today().isoformat()
    git = ["git", "describe", "--always", "--dirty"]
    rev = subprocess.run(git, check=False, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"\n{'algorithm':<14}{'acc@0':>8}{'final':>8}{'train s':>9}{f's to {a.target:g}':>10}{'median step ms':>16}")
    for name, r in results.items():
        to = f"{r['target_s']:.1f}" if r["target_s"] is not None else "-"
        print(f"{name:<14}{r['accuracy'][0]:>8.3f}{r['accuracy'][-1]:>8.3f}{r['train_s']:>9.1f}{to:>10}"
              f"{r['median_step_ms']:>16.1f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    styles = ["-", "--", "-.", ":"]
    for i, (name, r) in enumerate(results.items()):
        ax.plot(r["seconds"], r["accuracy"], styles[i // 4 % 4], marker="os^Dv<>p"[i % 8], color=f"C{i}",
                lw=1.8, ms=5, label=f"{name} ({r['accuracy'][-1]:.3f})")
    ax.axhline(a.target, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("training wall-clock, s (sum of time/step_s; evaluation not counted)")
    ax.set_ylabel("held-out accuracy (500 prompts x 4 samples, T=1)")
    ax.set_title(f"regen LM algorithms from one SFT base: {a.steps} steps, eval every {a.eval_every}, "
                 f"examples/arith_*.yaml\n{today}, {os.cpu_count()} CPU cores, load {load[0]}->{load[1]}, {rev}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(title="algorithm (final accuracy)", loc="lower right", fontsize=9)
    Path(a.png).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(a.png)
    print(f"figure written to {a.png}")
    if a.out:
        meta = {"date": today, "base": base, "steps": a.steps, "eval_every": a.eval_every, "target": a.target,
                "load_avg_1min": load, "cpu_count": os.cpu_count(), "git": rev}
        Path(a.out).write_text(json.dumps({"settings": meta, "results": results}, indent=1))
        print(f"figures written to {a.out}")


if __name__ == "__main__":
    main()
