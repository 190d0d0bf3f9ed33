"""Rehearsal at realistic size: a 0.5B language model and a 0.6B flow transformer through the whole loop.

Each model runs a few RL steps in each placement, every run through the real command line (`python -m regen
train`, or torchrun's launcher) in a child process, and ends with a kill -9 and a resume:

- models (random weights, real shapes; the same shapes bench/gpu_throughput.py measures on a GPU):
  `lm`: GRPO on a Qwen2ForCausalLM of Qwen2.5-0.5B's shape (494M parameters, its full 151936-token
  vocabulary, a character tokenizer padded to it), arithmetic prompts, exact-match reward;
  `flow`: DiffusionNFT on an SD3Transformer2DModel of 16 joint blocks x 1024 wide (596M trained
  parameters) at 128x128 pixels, 4 sampling steps, JPEG-compressibility reward.
- placements: `one` (one process), `torchrun` (2 ranks, FSDP2), `group` (a Ray trainer group of 2,
  FSDP2), `actor` and `actor_collective` (this trainer plus one Ray rollout actor; weights synced
  through Ray's object store, or broadcast over a gloo group: `distributed.sync: collective`; every
  tensor at every sync, `sync_changed_only: false`).
- each run: `--steps` steps with a checkpoint after every step (`checkpoint.keep_last=1`). Once its
  second step is logged one process is SIGKILLed (torchrun: rank 1; group: a trainer actor, which
  the group replaces and restarts from its last checkpoint by itself; `actor_collective`: the
  rollout actor, replaced and regrouped in the run; otherwise the trainer), and where the run died
  the same command runs again and resumes from the last checkpoint.
- recorded per run: each phase's median time over the steps after each process's first (sample,
  score, update, sync; `time/checkpoint_s` gather + write + fsync; `time/resume_s` reading the
  checkpoint and rebuilding), checkpoint size on disk and the most checkpoint folders seen at once
  (`keep_last` says 1, plus the one being written), sync megabytes, and every process's peak RSS
  (polled every 0.2 s, and the trainer's per phase) beside what it must hold by design: the
  interpreter with its libraries imported (measured) plus 16 bytes per trained parameter for a
  trainer (fp32 weights, gradients and AdamW's two moments), 16/2 + 4 for an FSDP2 rank (its half,
  and the whole weights gathered for sampling and checkpoints), 4 for a rollout actor.

Writes a JSON file (--out) and prints a markdown table for bench/README.md. Run from the repository
root with the project's virtualenv; on 2 CPU cores and 24 GiB the whole rehearsal takes about 30
minutes (`--only lm` about half):

    python bench/rehearsal.py --out bench/results/rehearsal.json
    python bench/rehearsal.py --only lm --placements one,actor,actor_collective --steps 3
    python bench/rehearsal.py --tiny --work /tmp/r   # the same runs on tiny models: a smoke test
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_throughput import QWEN25_05B, SD3_MEDIUM, TINY_LM, build_lm, environment, write_prompts  # noqa: E402
from regen.policies.flow_sd3 import TINY as TINY_SD3  # noqa: E402

FLOW_SHAPE = {**SD3_MEDIUM, "size": 128, "text_len": 16}  # the same transformer; fewer pixels and text tokens
PLACEMENTS = {
    "one": [],
    "torchrun": ["distributed.mode=torchrun", "distributed.strategy=fsdp"],
    "group": ["distributed.mode=ray", "distributed.trainer_workers=2", "distributed.strategy=fsdp",
              "distributed.ray_address=null"],
    # every tensor travels at every sync, as in a real run where AdamW moves each trained tensor every
    # step (the random LM's exact-match reward is 0 everywhere: its weights would not move at all)
    "actor": ["distributed.mode=ray", "distributed.rollout_workers=1", "distributed.reward_workers=1",
              "distributed.ray_address=null", "distributed.sync_changed_only=false"],
    "actor_collective": ["distributed.mode=ray", "distributed.rollout_workers=1", "distributed.reward_workers=1",
                         "distributed.ray_address=null", "distributed.sync_changed_only=false",
                         "distributed.sync=collective"],
    "sync": [],  # not a run: both weight-sync paths side by side in this process (sync_compare)
}
SYNC_DTYPES = ("float32", "bfloat16")
PHASES = ("time/sample_s", "time/score_s", "time/logprob_s", "time/update_s", "sync/s", "time/step_s")


def build(model: str, work: Path, seed: int, tiny: bool) -> tuple[Path, int, list[str]]:
    """The model folder, its trained parameter count, and the run's overrides."""
    if model == "lm":
        n = build_lm(work / "lm", TINY_LM if tiny else QWEN25_05B, "float32", seed)
        return work / "lm", n, ["algorithm.name=grpo", "data.train=builtin:arithmetic:train", "rollout.group_size=4",
                                "rollout.global_batch_size=8", "rollout.max_new_tokens=16",
                                "reward=[{name: exact_match}]"]
    from regen.policies.flow_sd3 import random_sd3

    n = random_sd3(work / "sd3", seed, False, **(TINY_SD3 if tiny else FLOW_SHAPE))
    prompts = write_prompts(work / "prompts.jsonl")
    return work / "sd3", n, ["algorithm.name=nft", f"data.train={prompts}", "rollout.group_size=2",
                             "rollout.global_batch_size=4", "flow.steps=4", "reward=[{name: jpeg_compressibility}]"]


class Watch(threading.Thread):
    """Every 0.2 s: each process of the tree under `root` (its RSS, peak kept per process) and the
    checkpoint folders on disk (the most at once, and the largest total)."""

    def __init__(self, root: int, ckpts: Path):
        super().__init__(daemon=True)
        self.root, self.ckpts, self.stop = root, ckpts, threading.Event()
        self.peak: dict[int, dict] = {}
        self.most_folders, self.most_bytes = 0, 0
        self.series: dict[int, list[tuple[float, int]]] = {}  # pid -> (time, RSS) of every trainer process
        self.logged: dict[int, float] = {}  # step -> when its metrics row appeared (rows of this process)
        last = rows_of(ckpts.parent)
        self.last_step = last[-1]["step"] if last else None

    def phase_peaks(self, rows: list[dict]) -> dict[str, float]:
        """The trainer's peak RSS (GiB) in each phase, from the row times and each row's phase durations:
        a step's phases run sample, score, update back from its row; its checkpoint follows the row."""
        if not self.series:
            return {}
        # the trainer process that held the most (the trainer, or the busiest rank)
        series = max(self.series.values(), key=lambda x: max(rss for _, rss in x))
        spans: list[tuple[str, float, float]] = []
        by_step = {r["step"]: r for r in rows}
        for step, t in self.logged.items():
            r, end = by_step.get(step, {}), t
            for k in ("time/update_s", "time/logprob_s", "time/score_s", "time/sample_s"):
                if k in r:
                    spans.append((k.split("/")[1].removesuffix("_s"), end - r[k], end))
                    end -= r[k]
        for step, t in self.logged.items():
            if "time/checkpoint_s" in by_step.get(step + 1, {}):
                spans.append(("checkpoint", t, t + by_step[step + 1]["time/checkpoint_s"]))
        out: dict[str, float] = {}
        for name, a, b in spans:
            inside = [rss for t, rss in series if a - 0.2 <= t <= b + 0.2]
            if inside:
                out[name] = max(out.get(name, 0.0), max(inside) / 2**30)
        if self.logged:  # before the first row's sampling: loading (and a resume's reading)
            step = min(self.logged)
            first = self.logged[step] - by_step.get(step, {}).get("time/step_s", 0.0)
            start = [rss for t, rss in series if t < first]
            if start:
                out["start"] = max(start) / 2**30
        return out

    def run(self):
        import psutil

        while not self.stop.is_set():
            try:
                top = psutil.Process(self.root)
                procs = [top, *top.children(recursive=True)]
            except psutil.Error:
                procs = []
            now = time.time()
            for p in procs:
                try:
                    rss, r = p.memory_info().rss, role(p)
                    if rss > self.peak.get(p.pid, {}).get("rss", 0):
                        self.peak[p.pid] = {"rss": rss, "role": r}
                    if r in ("trainer", "rank 0", "rank 1", "TrainerWorker"):
                        self.series.setdefault(p.pid, []).append((now, rss))
                except psutil.Error:
                    pass
            rows = rows_of(self.ckpts.parent)
            if rows and rows[-1]["step"] != self.last_step:
                self.last_step = rows[-1]["step"]
                self.logged[self.last_step] = now
            if self.ckpts.is_dir():
                folders = [f for f in self.ckpts.iterdir() if f.is_dir()]
                size = sum(f.stat().st_size for d in folders for f in d.rglob("*") if f.is_file())
                self.most_folders, self.most_bytes = max(self.most_folders, len(folders)), max(self.most_bytes, size)
            time.sleep(0.2)


def role(p) -> str:
    """What a process of the tree is: trainer, rank N, or a Ray actor's class (Ray's own daemons: ray)."""
    cmd = " ".join(p.cmdline())
    if cmd.startswith("ray::"):
        name = cmd.split()[0].removeprefix("ray::").split(".")[0]
        return {"IDLE": "ray-idle"}.get(name, name)
    if "torch.distributed.run" in cmd:
        return "torchrun-launcher"
    if "-m regen" in cmd:
        rank = p.environ().get("RANK")
        return f"rank {rank}" if rank is not None else "trainer"
    return "ray"


def victim(root: int, placement: str) -> tuple[int, str] | None:
    """The process the rehearsal kills in this placement (see the module docstring)."""
    import psutil

    want = {"one": "trainer", "actor": "trainer", "torchrun": "rank 1", "group": "TrainerWorker",
            "actor_collective": "RolloutWorker"}[placement]
    top = psutil.Process(root)
    for p in [top, *top.children(recursive=True)]:
        try:
            if role(p) == want:
                return p.pid, want
        except psutil.Error:
            pass
    return None


def rows_of(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


def command(placement: str, overrides: list[str]) -> list[str]:
    if placement == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "regen",
                "train", *overrides]
    return [sys.executable, "-m", "regen", "train", *overrides]


def rehearse(placement: str, overrides: list[str], run_dir: Path, steps: int, limit_s: float) -> dict:
    """One placement's run with its kill -9 and (where the run died) the resume."""
    cmd = command(placement, [*overrides, *PLACEMENTS[placement], f"run.dir={run_dir}", f"train.steps={steps}"])
    out: dict = {"placement": placement, "processes": [], "kill": None}
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier rehearsal would be resumed
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    for attempt in range(3):
        log = open(run_dir.parent / f"{run_dir.name}-{attempt}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        watch = Watch(proc.pid, run_dir / "checkpoints")
        watch.start()
        deadline = time.time() + limit_s
        while proc.poll() is None and time.time() < deadline:
            if out["kill"] is None and len(rows_of(run_dir)) >= 2 and (v := victim(proc.pid, placement)):
                os.kill(v[0], signal.SIGKILL)
                out["kill"] = {"role": v[1], "after_step": len(rows_of(run_dir)), "attempt": attempt}
            time.sleep(0.2)
        if proc.poll() is None:  # past the limit: the whole tree goes
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
        watch.stop.set()
        watch.join()
        log.close()
        rows_now = rows_of(run_dir)
        out["processes"].append({"attempt": attempt, "rc": rc, "phase_peak_gib": watch.phase_peaks(rows_now),
                                 "peaks": sorted(
            ({"role": v["role"], "peak_gib": v["rss"] / 2**30} for v in watch.peak.values()),
            key=lambda x: -x["peak_gib"]), "most_checkpoint_folders": watch.most_folders,
            "most_checkpoint_gib": watch.most_bytes / 2**30})
        if rc == 0 or out["kill"] is None:
            break
        try:  # a run killed between its processes' starts leaves a Ray behind: the next attempt starts its own
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True,
                           timeout=60)
        except (OSError, subprocess.SubprocessError):
            pass
    out["wall_s"] = time.perf_counter() - t_all
    rows = rows_of(run_dir)
    out["steps_logged"] = [r["step"] for r in rows]
    out["completed"] = out["processes"][-1]["rc"] == 0 and rows and rows[-1]["step"] == steps
    # each process's first step warms up: medians over the others
    firsts = {0} | {i for i, r in enumerate(rows) if "time/resume_s" in r}
    warm = [r for i, r in enumerate(rows) if i not in firsts] or rows
    out["phases"] = {k: statistics.median(r[k] for r in warm) for k in PHASES if all(k in r for r in warm)}
    ck = [r["time/checkpoint_s"] for r in rows if "time/checkpoint_s" in r]
    out["checkpoint_s"] = statistics.median(ck) if ck else None
    out["resume_s"] = next((r["time/resume_s"] for r in rows if "time/resume_s" in r), None)
    out["sync_mb"] = statistics.median(r["sync/mb"] for r in warm) if all("sync/mb" in r for r in warm) else None
    folders = sorted((run_dir / "checkpoints").glob("step_*"))
    out["checkpoint_gib"] = sum(f.stat().st_size for f in folders[-1].rglob("*") if f.is_file()) / 2**30 \
        if folders else None
    for big in ("checkpoints", "export"):  # gigabytes each: the figures are taken (a full disk fails the next run)
        shutil.rmtree(run_dir / big, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    return out


def sync_compare(overrides: list[str], repeats: int) -> dict:
    """Both weight-sync paths side by side: this process is the trainer (the model, no optimizer)
    with one Ray rollout actor, the whole state sent `repeats` times per path and dtype. Per sync:
    how long the trainer is held (the sync call) and how long until the actor holds the weights (the
    call, then waiting for the actor to have run everything queued to it: the object-store path
    loads in the background, the collective path before it returns)."""
    import ray
    import torch

    from regen.config import RLConfig, load_config
    from regen.data import EpochSampler, load_prompts
    from regen.modalities import modality_class
    from regen.placement.ray import RayRollouts, start_ray
    from regen.runtime.dist import Dist

    out: dict = {"placement": "sync", "repeats": repeats, "paths": {}}
    for dtype in SYNC_DTYPES:
        for path in ("object_store", "collective"):
            cfg = load_config(RLConfig, None, [*overrides, *PLACEMENTS["actor"], f"distributed.sync={path}",
                                               f"distributed.sync_dtype={dtype}", "distributed.sync_bucket_mb=512"])
            start_ray(cfg)
            m = modality_class(cfg)(cfg, torch.device("cpu"), Dist())
            prompts = load_prompts(cfg.data.train, cfg.task, "data.train", False, cfg.data.columns)
            pool = RayRollouts(m, EpochSampler(len(prompts), 0), prompts, cfg, version=0)
            held, loaded, mb = [], [], 0.0
            try:
                for i in range(repeats):
                    t0 = time.perf_counter()
                    mb = pool.sync(i + 1)["sync/mb"]
                    t1 = time.perf_counter()
                    pool.workers.drain(600)
                    held.append(t1 - t0)
                    loaded.append(time.perf_counter() - t0)
            finally:
                pool.close()
                ray.shutdown()
            out["paths"][f"{path} {dtype}"] = {"mb": mb, "held_s": held, "loaded_s": loaded,
                                               "held_median_s": statistics.median(held),
                                               "loaded_median_s": statistics.median(loaded)}
            print(f"sync {path} {dtype}: {mb:.0f} MB, trainer held {statistics.median(held):.2f} s, actor holds "
                  f"them after {statistics.median(loaded):.2f} s (median of {repeats})", flush=True)
    out["completed"], out["load_after"] = True, os.getloadavg()
    return out


def sync_table(results: list[dict]) -> str:
    lines = ["| model | path | dtype | MB per sync | trainer held s | actor has them after s (median, min-max) |",
             "|" + "---|" * 6]
    for r in results:
        if r["placement"] != "sync":
            continue
        for name, v in r["paths"].items():
            path, dtype = name.split()
            lines.append(f"| {r['model']} | {path} | {dtype} | {v['mb']:.0f} | {v['held_median_s']:.2f} | "
                         f"{v['loaded_median_s']:.2f} ({min(v['loaded_s']):.2f}-{max(v['loaded_s']):.2f}) |")
    return "\n".join(lines)


def expected_gib(role: str, n: int, placement: str, base: float, model: str = "lm") -> float | None:
    """What a process must hold by design: `base` (Python, torch and the libraries imported, measured)
    plus, per trained parameter, a trainer's fp32 weights, gradients and AdamW moments (16 bytes); an
    FSDP2 rank its half of those 16 and the whole weights gathered for sampling and, on rank 0, for
    the checkpoint (4); a rollout actor its fp32 weights (4). DiffusionNFT (the flow model) keeps its
    old policy, a second copy of the weights (4 more, sharded alike)."""
    extra = 4 if model == "flow" else 0
    if role in ("rank 0", "rank 1", "TrainerWorker") or (role == "trainer" and placement in ("torchrun", "group")):
        per = 16 / 2 + 4 + extra / 2
    elif role == "trainer":
        per = 16 + extra
    elif role == "RolloutWorker":
        per = 4
    else:
        return None
    return base + per * n / 2**30


def import_baseline_gib() -> float:
    """Peak RSS of a fresh interpreter that imports what a run imports, before any model exists."""
    code = ("import resource, torch, transformers, diffusers, regen.train, regen.modalities.lm, "
            "regen.modalities.flow; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 2**20  # Linux: KiB


def table(results: list[dict], base: float) -> str:
    head = ("| model | placement | done | step s | sample s | update s | sync s (MB) | ckpt write s | ckpt GiB "
            "(most folders) | resume s | killed | peak RSS GiB / expected (role) |\n|" + "---|" * 12)
    lines = [head]
    for r in results:
        if r["placement"] == "sync":
            continue
        ph = r["phases"]
        peaks = {}
        for p in r["processes"]:
            for x in p["peaks"]:
                if x["role"] in ("trainer", "rank 0", "rank 1", "TrainerWorker", "RolloutWorker"):
                    peaks[x["role"]] = max(peaks.get(x["role"], 0), x["peak_gib"])
        mem = ", ".join(f"{v:.1f}/{expected_gib(k, r['params'], r['placement'], base, r['model']):.1f} ({k})"
                        for k, v in peaks.items())
        sync = f"{ph['sync/s']:.2f} ({r['sync_mb']:.0f})" if "sync/s" in ph else "-"
        f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        most = max(p["most_checkpoint_folders"] for p in r["processes"])
        lines.append(f"| {r['model']} | {r['placement']} | {'yes' if r['completed'] else 'NO'} | "
                     f"{f(ph.get('time/step_s'))} | {f(ph.get('time/sample_s'))} | {f(ph.get('time/update_s'))} | "
                     f"{sync} | {f(r['checkpoint_s'])} | {f(r['checkpoint_gib'])} ({most}) | {f(r['resume_s'])} | "
                     f"{(r['kill'] or {}).get('role', '-')} after step {(r['kill'] or {}).get('after_step', '-')} | "
                     f"{mem} |")
    return "\n".join(lines)


def phase_table(results: list[dict], base: float) -> str:
    """The busiest trainer process's peak RSS in each phase, GiB, the most over the run's processes."""
    names = ("start", "sample", "score", "logprob", "update", "checkpoint")
    lines = ["| model | placement | expected | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    for r in results:
        if r["placement"] == "sync":
            continue
        most: dict[str, float] = {}
        for p in r["processes"]:
            for k, v in p.get("phase_peak_gib", {}).items():
                most[k] = max(most.get(k, 0.0), v)
        role = "TrainerWorker" if r["placement"] == "group" else "trainer"
        exp = expected_gib(role, r["params"], r["placement"], base, r["model"])
        lines.append(f"| {r['model']} | {r['placement']} | {exp:.1f} | "
                     + " | ".join(f"{most[k]:.1f}" if k in most else "-" for k in names) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="lm,flow", help="models, comma-separated: lm, flow (default both)")
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="comma-separated subset of: "
                   + ", ".join(PLACEMENTS))
    p.add_argument("--steps", type=int, default=3, help="train.steps of each run (default 3)")
    p.add_argument("--tiny", action="store_true", help="tiny models of the same classes (a smoke test, not figures)")
    p.add_argument("--limit", type=float, default=900, help="seconds a run's process may take before it is killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-repeats", type=int, default=5, help="syncs per path and dtype in `sync` (default 5)")
    p.add_argument("--out", help="JSON file for the figures, rewritten after each run; the runs it already holds "
                   "of other models or placements are kept")
    p.add_argument("--work", help="folder for models and runs (default: a new temporary folder, kept)")
    p.add_argument("--table", metavar="JSON", help="print the tables of an earlier run's JSON file and stop")
    a = p.parse_args()
    if a.table:
        saved = json.loads(Path(a.table).read_text())
        base = saved["environment"].get("import_rss_gib") or import_baseline_gib()  # older files: measured now
        print(table(saved["runs"], base) + "\n\n" + phase_table(saved["runs"], base) + "\n\n"
              + sync_table(saved["runs"]))
        return
    models, placements = a.only.split(","), a.placements.split(",")
    bad = [x for x in models if x not in ("lm", "flow")] + [x for x in placements if x not in PLACEMENTS]
    if bad:
        p.error(f"unknown model or placement: {', '.join(bad)}")
    work = Path(a.work or tempfile.mkdtemp(prefix="regen-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    env = environment("cpu") | {"load_before": os.getloadavg(), "import_rss_gib": import_baseline_gib()}
    base = env["import_rss_gib"]
    print(f"work folder {work}; {env}", flush=True)
    common = ["run.device=cpu", "model.dtype=float32", f"run.seed={a.seed}", "data.eval=null", "checkpoint.every=1",
              "checkpoint.keep_last=1", "log.progress=lines", "log.every=1", "log.tensorboard=false"]
    # an earlier file's runs of other models or placements are kept: a rerun of some replaces only those
    earlier = json.loads(Path(a.out).read_text())["runs"] if a.out and Path(a.out).is_file() else []
    results = [r for r in earlier if r["model"] not in models or r["placement"] not in placements]
    for model in models:
        t0 = time.perf_counter()
        # built in a child process: the gigabytes a build leaves in this process's heap would count
        # against the runs' memory (Ray's memory monitor killed a rollout actor over them)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            folder, n, overrides = pool.apply(build, (model, work, a.seed, a.tiny))
        print(f"\n== {model}: {n / 1e6:.0f}M trained parameters, built and saved in {time.perf_counter() - t0:.0f} s",
              flush=True)
        for placement in placements:
            run_dir = work / f"{model}-{placement}"
            if placement == "sync":
                r = sync_compare([*common, f"model.path={folder}", f"run.dir={run_dir}", *overrides], a.sync_repeats)
            else:
                r = rehearse(placement, [*common, f"model.path={folder}", *overrides], run_dir, a.steps, a.limit)
            results.append({"model": model, "params": n, "date": time.strftime("%Y-%m-%d %H:%M"), **r})
            if placement != "sync":
                print(table(results[-1:], base).splitlines()[-1], f"({r['wall_s']:.0f} s)", flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps({"settings": vars(a), "environment": env, "runs": results},
                                                  indent=1))
    print("\n" + table(results, base) + "\n\n" + phase_table(results, base) + "\n\n" + sync_table(results))
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
