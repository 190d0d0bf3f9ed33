"""Distribution quality through RL: FID, KID, precision and recall of held-out shapes samples
before and after each flow method, and for a reward-hacking run.

Each method's example config (`examples/shapes_<method>.yaml`: flow_grpo, nft, awm, dgpo; --only
picks some) runs from one flow base with `eval.metrics=[fid, kid, precision_recall]` measured
against the shapes task's own drawings of the held-out prompts (`eval.reference=shapes`, features
of the built-in shapes classifier), on --eval-prompts (default all 12) x --eval-samples (default
32) = 384 ODE samples per evaluation. The `hack` run is Flow-GRPO with the JPEG-compressibility
term weighted up (--hack-weight, default 4, against adherence 1): its reward rises by drawing
flatter, emptier images, which FID should show while the reward alone does not.

FID is biased upward at a finite sample count, so the table also gives the floor: the FID
between two independent sets of true drawings of the same prompts at the same count, over
--floor-draws (default 5) pairs, as mean and std. A model at the floor is as close to the
true drawings as another set of true drawings is.

Settings overridden in each config: model.path, run.dir, run.seed (--seed), train.steps (--steps,
default 100), eval.every (--eval-every, default 25), the eval counts above, checkpoint.every=0,
log.progress=none, log.tensorboard=false, run.overwrite=true. Prints per run the step-0 and final
reward, adherence, FID, KID, precision and recall, the git revision, load average and threads;
--out FILE writes every eval point as JSON, --png FILE (needs matplotlib) plots reward and FID
against steps.

    python bench/quality_drift.py --base runs/demo-shapes-sft/export        # ~30 min on 2 idle cores
    python bench/quality_drift.py --base runs/demo-shapes-sft/export --steps 2 --eval-every 1 \\
        --eval-samples 4 --only flow_grpo --floor-draws 2                  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import yaml
from _runs import ROOT, eval_points, git_describe, load_avg, regen, spread

METHODS = ("flow_grpo", "nft", "awm", "dgpo")
KEYS = ["eval/reward", "eval/adherence_accuracy", "eval/fid", "eval/kid", "eval/precision", "eval/recall"]


def floor(prompts: int, samples: int, draws: int) -> dict:
    """FID/KID between two independent sets of true drawings of the held-out prompts."""
    from regen.quality.distribution import fid, kid
    from regen.quality.features import ShapesFeatures
    from regen.quality.reference import shapes_reference
    from regen.tasks import shapes

    metas = [dict(it.meta) for it in shapes.prompts("image", "test")[:prompts] for _ in range(samples)]
    feats = ShapesFeatures("image")
    fids, kids = [], []
    for d in range(draws):
        a = feats(shapes_reference(metas, 1000 + 2 * d))
        b = feats(shapes_reference(metas, 1001 + 2 * d))
        fids.append(fid(a, b))
        kids.append(kid(a, b)[0])
    return {"fid": spread(fids), "kid": spread(kids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="Flow base (export/ of `regen sft examples/shapes_sft.yaml`).")
    ap.add_argument("--only", default=",".join((*METHODS, "hack")), help="Comma-separated runs (default: all + hack).")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--hack-weight", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--floor-draws", type=int, default=5)
    ap.add_argument("--work", help="Folder for the runs (default: a temporary folder).")
    ap.add_argument("--out", help="Write settings, eval points and the summary as JSON here.")
    ap.add_argument("--png", help="Plot reward and FID against steps here (needs matplotlib).")
    ap.add_argument("--replot", metavar="JSON", help="Only draw --png again from an earlier --out file.")
    args = ap.parse_args()
    if args.replot:
        d = json.loads(Path(args.replot).read_text())
        st = d["settings"]
        plot(d["runs"], d["floor"], st["eval_prompts"] * st["eval_samples"], args.png)
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="quality_drift_"))
    print(f"git {git_describe()}  started {datetime.datetime.now():%Y-%m-%d %H:%M}  load {load_avg()}  "
          f"eval {args.eval_prompts} prompts x {args.eval_samples} samples, seed {args.seed}, {args.steps} steps")
    runs = {}
    for name in args.only.split(","):
        method = "flow_grpo" if name == "hack" else name
        config = ROOT / "examples" / f"shapes_{method}.yaml"
        sets = [f"model.path={Path(args.base).resolve()}", f"run.dir={work / name}", f"run.seed={args.seed}",
                f"train.steps={args.steps}", f"eval.every={args.eval_every}", f"eval.num_prompts={args.eval_prompts}",
                f"eval.samples_per_prompt={args.eval_samples}", "eval.metrics=[fid, kid, precision_recall]",
                "eval.reference=shapes", "checkpoint.every=0", "log.progress=none", "log.tensorboard=false",
                "run.overwrite=true"]
        threads = (yaml.safe_load(config.read_text()).get("run") or {}).get("threads")
        if threads is None:
            sets.append("run.threads=2")
        if name == "hack":
            sets.append(f"reward=[{{name: adherence, weight: 1.0}}, {{name: jpeg_compressibility, "
                        f"weight: {args.hack_weight}}}]")
        print(f"{name}: load {load_avg()} before the run", flush=True)
        wall = regen("train", str(config), *sets)
        runs[name] = eval_points(work / name / "metrics.jsonl", KEYS) | {"call_s": wall}
    fl = floor(args.eval_prompts, args.eval_samples, args.floor_draws)
    n = args.eval_prompts * args.eval_samples
    print(f"\nFID floor (two sets of true drawings, {n} each, {args.floor_draws} pairs): "
          f"{fl['fid']['mean']:.2f} +- {fl['fid']['std']:.2f}; KID {fl['kid']['mean']:.2f} +- {fl['kid']['std']:.2f}")
    print(f"\n{'run':<10} {'reward':>15} {'adherence':>13} {'FID':>15} {'KID':>17} {'precision':>13} {'recall':>13}")
    for name, r in runs.items():
        cells = [f"{r[k][0]:.3f}->{r[k][-1]:.3f}" if "fid" not in k and "kid" not in k
                 else f"{r[k][0]:.1f}->{r[k][-1]:.1f}" for k in KEYS]
        print(f"{name:<10} {cells[0]:>15} {cells[1]:>13} {cells[2]:>15} {cells[3]:>17} {cells[4]:>13} {cells[5]:>13}")
    print(f"load {load_avg()} at the end")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "git": git_describe(), "floor": fl,
                                              "runs": runs}, indent=1))
    if args.png:
        plot(runs, fl, n, args.png)


def plot(runs: dict, fl: dict, n: int, png: str) -> None:
    """Reward gained since step 0 (runs optimise differently scaled rewards) and FID, against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in runs.items():
        a.plot(r["steps"], [x - r["eval/reward"][0] for x in r["eval/reward"]], marker="o", label=name)
        b.plot(r["steps"], r["eval/fid"], marker="o", label=name)
    b.axhline(fl["fid"]["mean"], color="grey", ls="--", label="floor (true vs true)")
    a.set(xlabel="step", ylabel="held-out reward - step 0", title="reward gained (each run's own reward)")
    b.set(xlabel="step", ylabel=f"FID to true drawings (N={n})", title="FID (lower is closer)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)

if __name__ == "__main__":
    main()
