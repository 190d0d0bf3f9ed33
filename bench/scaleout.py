"""Placement overhead on one machine: the same GRPO job (arith config, random-init tiny GPT-2)
in one process, under torchrun with 2 processes (DDP, FSDP2), and with 2 Ray rollout actors
and 1 reward actor (max_staleness 0 and 1). Prints the median step time and its ratio to the
single process measured in the same run.

On a 2-core CPU this measures what the placements cost (process groups, gathers, object
store, actor calls), not what they gain: the gain needs more devices than one process can use.
Usage: python bench/scaleout.py [--steps 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ["examples/arith_grpo.yaml", "model.init=arith-char-gpt2", "model.path=null", "data.eval=null",
       "log.progress=none", "log.tensorboard=false", "checkpoint.every=0", "rollout.global_batch_size=64",
       "rollout.group_size=8", "rollout.max_new_tokens=8"]
MODES = {
    "single": ([], ["distributed.mode=single", "run.threads=2"]),
    "torchrun-ddp x2": (["torchrun"], ["distributed.mode=torchrun", "distributed.strategy=ddp", "run.threads=1"]),
    "torchrun-fsdp x2": (["torchrun"], ["distributed.mode=torchrun", "distributed.strategy=fsdp", "run.threads=1"]),
    "ray 2 rollout + 1 reward": ([], ["distributed.mode=ray", "run.threads=1"]),
    "ray, max_staleness=1": ([], ["distributed.mode=ray", "run.threads=1", "distributed.max_staleness=1"]),
}


def run(mode: str, steps: int, run_dir: Path) -> dict:
    launcher, extra = MODES[mode]
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "regen"] \
        if launcher else [sys.executable, "-m", "regen"]
    cmd = [*prefix, "train", *JOB, f"train.steps={steps}", f"run.dir={run_dir}", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_s = [r["time/step_s"] for r in rows[2:]]  # the first steps warm up allocators and actors
    return {"median_step_s": statistics.median(step_s), "wall_s": wall,
            "samples_per_s": statistics.median(r["throughput/samples_per_s"] for r in rows[2:]),
            "reward_last5": statistics.mean(r["reward/mean"] for r in rows[-5:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            results[mode] = run(mode, args.steps, Path(tmp) / mode.replace(" ", "_"))
            print(f"{mode:28s} done", file=sys.stderr)
    base = results["single"]["median_step_s"]
    print(f"{'placement':28s} {'step s':>8s} {'x single':>9s} {'samples/s':>10s} {'wall s':>8s}")
    for mode, r in results.items():
        print(f"{mode:28s} {r['median_step_s']:8.3f} {r['median_step_s'] / base:9.2f} {r['samples_per_s']:10.0f} "
              f"{r['wall_s']:8.1f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
