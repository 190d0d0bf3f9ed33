"""The training loop's step time, this tree against another revision, side by side in one run.

For a change to the loop's structure (the one-loop refactor, a new bookkeeping step) the
question is whether the step got slower. Both trees run the same short jobs as
`python -m regen train ...` subprocesses from the same virtualenv, alternated round by round
(base, this, base, this, ...) so that drift of the machine hits both alike; each job's median
`time/step_s` is read from its metrics.jsonl, and the ratio this / base is printed per job
with the spread over rounds. Jobs (on the built-in tasks, one thread per process):

  grpo      GRPO on arithmetic, 32 completions of 8 tokens per step, KL 0.04 (a reference model)
  flow_grpo Flow-GRPO on 16x16 shapes, 32 images per step, 10 SDE steps
  nft       DiffusionNFT on the same, ODE rollouts

Only keys both revisions accept are used (the flow KL key was renamed in between). The 1-min
load average before every run is printed: a timing is only worth something on an otherwise
idle machine.

    python bench/loop_overhead.py --base-rev HEAD~3 --lm-base runs/demo-sft/export \\
        --flow-base runs/demo-shapes-sft/export --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

JOBS = {
    "grpo": lambda a: [f"model.path={a.lm_base}", "rollout.global_batch_size=32", "rollout.group_size=8",
                       "rollout.max_new_tokens=8", "algorithm.kl_coef=0.04", f"train.steps={a.lm_steps}",
                       "optim.lr=5e-5"],
    "flow_grpo": lambda a: [f"model.path={a.flow_base}", "algorithm.name=flow_grpo", "data.train=builtin:shapes:train",
                            "rollout.global_batch_size=32", "rollout.group_size=8", "flow.steps=10",
                            f"train.steps={a.flow_steps}", "optim.lr=5e-5", "reward=[{name: adherence}]"],
    "nft": lambda a: [f"model.path={a.flow_base}", "algorithm.name=nft", "data.train=builtin:shapes:train",
                      "rollout.global_batch_size=32", "rollout.group_size=8", "flow.steps=10",
                      f"train.steps={a.flow_steps}", "optim.lr=1e-4", "reward=[{name: adherence}]"],
}
COMMON = ["data.eval=null", "log.progress=none", "log.tensorboard=false", "checkpoint.every=0",
          "run.overwrite=true", "run.threads=1"]


def median_step(tree: Path, job: str, args, run_dir: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "regen", "train", *JOBS[job](args), *COMMON, f"run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{tree}: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["time/step_s"] for r in rows if "time/step_s" in r][1:]  # the first step warms up
    return statistics.median(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-rev", required=True, help="git revision to compare against (e.g. HEAD~1)")
    p.add_argument("--lm-base", required=True, help="an SFT'd arithmetic model (regen sft examples/arith_sft.yaml)")
    p.add_argument("--flow-base", required=True, help="a shapes flow model (regen sft examples/shapes_sft.yaml)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lm-steps", type=int, default=60)
    p.add_argument("--flow-steps", type=int, default=12)
    p.add_argument("--only", default=",".join(JOBS), help="comma-separated jobs")
    a = p.parse_args()
    a.lm_base, a.flow_base = str(Path(a.lm_base).resolve()), str(Path(a.flow_base).resolve())
    work = Path(tempfile.mkdtemp(prefix="regen-overhead-"))
    base_tree = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), a.base_rev], check=True,
                   capture_output=True)
    rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip()
    try:
        times: dict = {(t, j): [] for t in ("base", "this") for j in a.only.split(",")}
        for r in range(a.rounds):
            for job in a.only.split(","):
                for name, tree in (("base", base_tree), ("this", ROOT)):
                    load = os.getloadavg()[0]
                    t = median_step(tree, job, a, work / f"{name}-{job}-{r}")
                    times[(name, job)].append(t)
                    print(f"round {r + 1} {job:9s} {name:4s} median step {1000 * t:7.1f} ms  (load {load:.2f})",
                          flush=True)
        print(f"\nthis tree: {rev}; base: {a.base_rev}; {a.rounds} rounds, alternated; medians of per-step times")
        print(f"{'job':10s} {'base ms':>9s} {'this ms':>9s} {'this/base':>10s} {'per-round ratios':>30s}")
        for job in a.only.split(","):
            b, t = times[("base", job)], times[("this", job)]
            ratios = [y / x for x, y in zip(b, t)]
            print(f"{job:10s} {1000 * statistics.median(b):9.1f} {1000 * statistics.median(t):9.1f} "
                  f"{statistics.median(t) / statistics.median(b):10.3f} {' '.join(f'{x:.3f}' for x in ratios):>30s}")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], capture_output=True)


if __name__ == "__main__":
    main()
