"""Joint training of a prompt enhancer and its painter against training either alone, over seeds.

The task (regen/tasks/shapes_paraphrase.py): user prompts for the 16x16 shapes painter written in
synonyms its prompt encoder does not know ("draw a crimson disc on the west side ->"), evaluated on
48 held-out user prompts (--eval-data): by default the training attribute combinations in phrasings
training never uses (builtin:shapes-paraphrase:phrasings), or the held-out combinations in those
phrasings (builtin:shapes-paraphrase:test). Four arms, each a `python -m
regen train` run from the same two bases, alternated in one process (seed 0 of every arm, then seed
1 with the order rotated by one, ...), so that machine drift hits all alike:

  joint          examples/shapes_joint.yaml: the enhancer (GRPO) rewrites, the painter (NFT) draws,
                 one adherence reward trains both
  joint_staged   the same with a schedule: the enhancer alone for the first half of the steps
                 (models.painter.train_at), then both
  joint_own      joint with models.painter.reward_against=rewrite: the painter's advantage judges its
                 images against its own prompt (the rewrite), the enhancer's against the user's
  enhancer_only  the same with models.painter.frozen=true (an enhancer trained for a fixed painter)
  painter_only   the painter alone (NFT, the same settings) on the users' raw prompts

Every arm samples the same images per step (rollout.global_batch_size, 128) with the same painter
settings and reward (examples/shapes_joint.yaml's, `adherence_accuracy` since 2026-12-03, `adherence`
before: judged against the user's prompt; joint_own's painter against its rewrite; painter_only
keeps `adherence`: alone on prompts it cannot read, its reward barely matters). Overrides: the
bases, data.eval (--eval-data), run.dir, run.seed, train.steps (--steps; --arm-steps ARM=N for one
arm), eval.every (--eval-every, scaled with an arm's steps), eval.samples_per_prompt
(--eval-samples, default 8: 384 held-out images per evaluation), checkpoint.every=0, log.progress=none,
log.tensorboard=false, run.overwrite=true.

Measures from each run's metrics.jsonl: held-out reward (`eval/reward`: with `adherence`, the mean
probability of the asked colour, shape and position; with `adherence_accuracy`, the same as the
adherence) and prompt adherence (`eval/adherence_accuracy`:
the fraction of images whose three attributes the built-in classifier reads back as asked) at step 0,
every --eval-every steps and at the end, against training wall-clock (cumulative `time/step_s`). The
same wall-clock budget: the smallest whole-run training time over all runs; each run is read at its
last evaluation within it. Per arm, over seeds: mean, std (n-1), min..max of both metrics at the
budget and at the end, and of training seconds; `git describe`, threads and the 1-min load average.

    python bench/joint.py --painter runs/demo-joint-painter/export --enhancer runs/demo-enhancer-sft/export \
        --steps 200 --arm-steps enhancer_only=320 --only joint_own,enhancer_only,painter_only --seeds 5
    python bench/joint.py                # builds both bases first (~2-3 min + ~30 s on 2 cores)
    python bench/joint.py --steps 2 --eval-every 1 --seeds 1 --eval-samples 1 --out /tmp/j.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import ROOT, eval_points, git_describe, load_avg, regen, spread  # noqa: E402

KEYS = ["eval/reward", "eval/adherence_accuracy"]
ARMS = ("joint", "joint_staged", "joint_own", "enhancer_only", "painter_only")


def arm_args(arm: str, painter: str, enhancer: str, steps: int, eval_data: str) -> list[str]:
    if arm == "painter_only":  # the painter of shapes_joint.yaml, alone, on the raw prompts
        return ["train", f"model.path={painter}", "algorithm.name=nft", "data.train=builtin:shapes-paraphrase:train",
                f"data.eval={eval_data}", "rollout.global_batch_size=128", "rollout.group_size=2",
                "flow.steps=6", "flow.eval_steps=10", "optim.lr=1.0e-4", "reward=[{name: adherence}]",
                "eval.num_prompts=48", "run.threads=2"]
    args = ["train", str(ROOT / "examples" / "shapes_joint.yaml"), f"models.enhancer.model.path={enhancer}",
            f"models.painter.model.path={painter}", f"data.eval={eval_data}"]
    if arm == "joint_staged":  # stage 1: the enhancer alone; stage 2 (the second half): both
        return args + [f"models.painter.train_at=[[{steps // 2 + 1}, null]]"]
    if arm == "enhancer_only":  # a frozen painter has no advantage to judge: reward_against is refused with it
        return args + ["models.painter.frozen=true", "models.painter.reward_against=user"]
    return args + [f"models.painter.reward_against={'rewrite' if arm == 'joint_own' else 'user'}"]


def at_budget(points: dict, budget: float) -> list[float]:
    """Each metric at the last evaluation whose training seconds are within the budget."""
    i = max(j for j, s in enumerate(points["seconds"]) if s <= budget + 1e-9)
    return [points[k][i] for k in KEYS]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--painter", help="the painter's base (default: built from examples/shapes_sft.yaml sft.steps=300, "
                   "as scripts/demo_joint.sh does)")
    p.add_argument("--enhancer", help="the enhancer's base (default: built from examples/shapes_enhancer_sft.yaml)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0, help="run.seed F..F+N-1 (default 0), to add seeds to a benchmark")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--eval-data", default="builtin:shapes-paraphrase:phrasings",
                   help="held-out user prompts (default: the training combinations in held-out phrasings; "
                        "builtin:shapes-paraphrase:test: held-out combinations in held-out phrasings)")
    p.add_argument("--only", default=",".join(ARMS), help=f"comma-separated arms among {', '.join(ARMS)}")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more overrides for every arm but painter_only, e.g. models.painter.optim.lr=3e-5")
    p.add_argument("--arm-steps", nargs="*", default=[], metavar="ARM=N",
                   help="another step count for an arm (its evaluations every --eval-every x N / --steps steps), "
                        "e.g. enhancer_only=440 to give the frozen painter the joint runs' wall-clock")
    p.add_argument("--out", help="write settings, curves and summary as JSON")
    a = p.parse_args()
    arm_steps = {}
    for kv in a.arm_steps:
        arm, _, n = kv.partition("=")
        if arm not in ARMS or not n.isdigit() or int(n) < 1:
            p.error(f"--arm-steps {kv}: expected ARM=N with ARM among {', '.join(ARMS)} and N a positive integer")
        arm_steps[arm] = int(n)
    work = Path(tempfile.mkdtemp(prefix="regen-joint-"))
    for name, cfg, more in (("painter", "shapes_sft.yaml", ["sft.steps=300"]), ("enhancer", "shapes_enhancer_sft.yaml", [])):
        if getattr(a, name) is None:  # the bases of scripts/demo_joint.sh
            print(f"building the {name} base: regen sft examples/{cfg} {' '.join(more)}", flush=True)
            regen("sft", str(ROOT / "examples" / cfg), *more, f"run.dir={work / name}", "log.progress=none")
            setattr(a, name, str(work / name / "export"))
    arms = [x for x in ARMS if x in a.only.split(",")]
    print(f"regen {git_describe()}, threads 2 per run, load average {load_avg()} at the start", flush=True)
    runs: dict[str, list[dict]] = {x: [] for x in arms}
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for arm in arms[seed % len(arms):] + arms[: seed % len(arms)]:
            run = work / f"{arm}-{seed}"
            load = load_avg()
            steps = arm_steps.get(arm, a.steps)
            regen(*arm_args(arm, a.painter, a.enhancer, steps, a.eval_data), *([] if arm == "painter_only" else a.set),
                  f"run.dir={run}", f"run.seed={seed}", f"train.steps={steps}",
                  f"eval.every={max(1, round(a.eval_every * steps / a.steps))}", f"eval.samples_per_prompt={a.eval_samples}",
                  "checkpoint.every=0", "log.progress=none", "log.tensorboard=false", "run.overwrite=true")
            pts = eval_points(run / "metrics.jsonl", KEYS)
            runs[arm].append({"seed": seed, "load_before": load, **pts})
            print(f"{arm:14s} seed {seed}: reward {pts[KEYS[0]][0]:.3f} -> {pts[KEYS[0]][-1]:.3f}, adherence "
                  f"{pts[KEYS[1]][0]:.3f} -> {pts[KEYS[1]][-1]:.3f}, {pts['train_s']:.0f} s training "
                  f"(load {load})", flush=True)
    budget = min(r["train_s"] for rs in runs.values() for r in rs)
    summary = {}
    for arm, rs in runs.items():
        summary[arm] = {
            "start": {k: spread([r[k][0] for r in rs]) for k in KEYS},
            "at_budget": {k: spread([at_budget(r, budget)[i] for r in rs]) for i, k in enumerate(KEYS)},
            "end": {k: spread([r[k][-1] for r in rs]) for k in KEYS},
            "train_s": spread([r["train_s"] for r in rs]),
        }
    fmt = lambda s: "-" if s is None else f"{s['mean']:.3f} ± {s['std']:.3f} ({s['min']:.3f}..{s['max']:.3f})"  # noqa: E731
    print(f"\nsame wall-clock budget: {budget:.0f} s of training; load average {load_avg()} at the end")
    print(f"{'arm':14s} {'reward / adherence at step 0':32s} {'reward @budget':30s} {'adherence @budget':30s} "
          f"{'reward end':30s} {'adherence end':30s} train s")
    for arm, s in summary.items():
        first = f"{s['start'][KEYS[0]]['mean']:.3f} / {s['start'][KEYS[1]]['mean']:.3f}"
        print(f"{arm:14s} {first:32s} {fmt(s['at_budget'][KEYS[0]]):30s} {fmt(s['at_budget'][KEYS[1]]):30s} "
              f"{fmt(s['end'][KEYS[0]]):30s} {fmt(s['end'][KEYS[1]]):30s} {s['train_s']['mean']:.0f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": vars(a), "budget_s": budget, "runs": runs, "summary": summary},
                                          indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x)
                                          else x))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
