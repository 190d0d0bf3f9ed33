"""Placement overhead on one machine: the same GRPO job (arith config, random-init tiny GPT-2)
in one process, under torchrun with 2 processes (DDP, FSDP2), as a Ray trainer group of 2 actors,
and with 2 Ray rollout actors and 1 reward actor (max_staleness 0 and 1).

Every process runs with the same number of torch threads (--threads, default 1), and each
placement is compared with one process with that many threads: the ratio says what the
placement costs or gains per step, not what a second thread would. The modes are run in turn
--repeats times (round-robin, so drift of the machine hits every mode alike); the table gives the
median step time over the repeats, the ratio to the single process of the same round, and its
spread over rounds. The machine's load average is printed before and after: figures taken with
a busy machine are not comparable.

On a 2-core CPU this measures what the placements cost (process groups, gathers, object
store, actor calls), not what they gain: the gain needs more devices than one process can use.
Usage: python bench/scaleout.py [--steps 20] [--repeats 3] [--threads 1] [--out results.json]
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
JOB = ["model.init=arith-char-gpt2", "model.path=null", "data.eval=null",
       "log.progress=none", "log.tensorboard=false", "checkpoint.every=0", "rollout.global_batch_size=64",
       "rollout.group_size=8", "rollout.max_new_tokens=8"]
RAY_ACTORS = ["distributed.mode=ray", "distributed.rollout_workers=2", "distributed.reward_workers=1"]
MODES = {  # name: (started by torchrun, overrides); every process gets --threads threads
    "single": (False, ["distributed.mode=single"]),
    "torchrun-ddp x2": (True, ["distributed.mode=torchrun", "distributed.strategy=ddp"]),
    "torchrun-fsdp x2": (True, ["distributed.mode=torchrun", "distributed.strategy=fsdp"]),
    "ray trainer group x2 (ddp)": (False, ["distributed.mode=ray", "distributed.trainer_workers=2"]),
    "ray trainer group x2 + 2 rollout": (False, ["distributed.mode=ray", "distributed.trainer_workers=2",
                                                 "distributed.group_sampling=actors", "distributed.rollout_workers=2"]),
    "ray 2 rollout + 1 reward": (False, RAY_ACTORS),
    "ray, max_staleness=1": (False, [*RAY_ACTORS, "distributed.max_staleness=1"]),
}


def job_file(folder: Path) -> Path:
    """examples/arith_grpo.yaml without its `distributed` section (each mode sets its own: a key a
    placement does not read, such as strategy in one process, is refused)."""
    import yaml

    tree = yaml.safe_load((ROOT / "examples" / "arith_grpo.yaml").read_text())
    tree.pop("distributed", None)
    path = folder / "arith_grpo.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def run(mode: str, steps: int, threads: int, run_dir: Path) -> dict:
    torchrun, extra = MODES[mode]
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "regen"] \
        if torchrun else [sys.executable, "-m", "regen"]
    actors = [f"distributed.actor_threads={threads}"] if extra[:len(RAY_ACTORS)] == RAY_ACTORS else []
    cmd = [*prefix, "train", str(job_file(run_dir.parent)), *JOB, f"train.steps={steps}", f"run.dir={run_dir}",
           f"run.threads={threads}", *extra, *actors]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
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
    p.add_argument("--repeats", type=int, default=3, help="rounds over every mode (round-robin)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every process, the baseline's too")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    load_before = os.getloadavg()
    print(f"{os.cpu_count()} CPUs; load average before: {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}; {args.threads} torch thread(s) per process", file=sys.stderr)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            rounds.append({})
            for mode in MODES:
                rounds[r][mode] = run(mode, args.steps, args.threads, Path(tmp) / f"{r}_{mode.replace(' ', '_')}")
                print(f"round {r + 1}: {mode:28s} {rounds[r][mode]['median_step_s']:.3f} s/step", file=sys.stderr)
    load_after = os.getloadavg()
    print(f"\n{os.cpu_count()} CPUs, {args.threads} thread(s) per process, {args.repeats} rounds of {args.steps} steps; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print(f"{'placement':28s} {'step s':>8s} {'x single':>9s} {'(min-max)':>12s} {'samples/s':>10s} {'wall s':>8s}")
    table = {}
    for mode in MODES:
        step = statistics.median(rd[mode]["median_step_s"] for rd in rounds)
        ratios = [rd[mode]["median_step_s"] / rd["single"]["median_step_s"] for rd in rounds]
        table[mode] = {"median_step_s": step, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                       "ratio_max": max(ratios),
                       "samples_per_s": statistics.median(rd[mode]["samples_per_s"] for rd in rounds),
                       "wall_s": statistics.median(rd[mode]["wall_s"] for rd in rounds)}
        t = table[mode]
        print(f"{mode:28s} {step:8.3f} {t['ratio_median']:9.2f} {t['ratio_min']:5.2f}-{t['ratio_max']:<6.2f} "
              f"{t['samples_per_s']:10.0f} {t['wall_s']:8.1f}")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "steps": args.steps, "repeats": args.repeats,
                                        "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after,
                                        "table": table, "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
