"""A picture grid of flow models side by side for the README: each model draws the same held-out
prompts from the same noise (20-step Euler ODE, as the held-out evaluation samples), one row per
model, and each row is labelled with the adherence accuracy (the built-in classifier reads back
colour, shape and position) of all its images of the first --score-prompts prompts, of which the
first --prompts are shown.

    python bench/flow_picture.py --model base=runs/demo-shapes-sft/export \\
        --model Flow-GRPO=runs/demo-shapes-flow_grpo/export --model NFT=runs/demo-shapes-nft-fast/export \\
        --out docs/flow_samples_fast.png
    python bench/flow_picture.py --model A=FOLDER --model B=FOLDER --prompts 3 --samples 6 --seed 1 --out x.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch


def draw(folder: str, prompts: list[str], samples: int, seed: int, steps: int) -> np.ndarray:
    """(len(prompts) * samples, H, W, 3) uint8: `samples` images of each prompt, noise from `seed`."""
    from regen.policies.flow import FlowPolicy
    from regen.tasks.shapes import to_uint8

    policy = FlowPolicy.load(folder, torch.device("cpu"))
    policy.unet.eval()
    with torch.no_grad():  # a latent model's decode too
        out = policy.sample_ode(prompts, samples, torch.Generator().manual_seed(seed), steps)
        return to_uint8(policy.decode(out.x0)).numpy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="LABEL=FOLDER",
                   help="a flow model folder (a run's export/), one row; repeat for each model")
    p.add_argument("--data", default="builtin:shapes:test", help="prompts (default: the 12 held-out ones)")
    p.add_argument("--prompts", type=int, default=2, help="prompts shown, from the start of --data")
    p.add_argument("--score-prompts", type=int, default=12, help="prompts scored for the row's label (>= --prompts)")
    p.add_argument("--samples", type=int, default=8, help="images per prompt")
    p.add_argument("--seed", type=int, default=7, help="the noise, the same for every model")
    p.add_argument("--steps", type=int, default=20, help="Euler ODE steps")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    try:
        import matplotlib
    except ImportError:
        p.exit(2, "flow_picture.py needs matplotlib: pip install matplotlib\n")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from regen.data import load_prompts
    from regen.rewards import Sample
    from regen.rewards.adherence import AdherenceAccuracy

    models = [m.split("=", 1) for m in a.model]
    if any(len(m) != 2 for m in models):
        p.error("--model takes LABEL=FOLDER")
    items = load_prompts(a.data, None, "--data")[: max(a.score_prompts, a.prompts)]
    judge = AdherenceAccuracy()
    shown = a.prompts * a.samples
    fig, axes = plt.subplots(len(models), 1, figsize=(0.75 * shown, 1.1 * len(models)), squeeze=False)
    for ax, (label, folder) in zip(axes[:, 0], models):
        pix = draw(folder, [it.prompt for it in items], a.samples, a.seed, a.steps)
        right = judge([Sample(items[i // a.samples].prompt, "", items[i // a.samples].meta, True, pix[i])
                       for i in range(len(pix))])
        gap = np.full((pix.shape[1], 1, 3), 255, np.uint8)  # a white line between images
        ax.imshow(np.concatenate([np.concatenate([img, gap], 1) for img in pix[:shown]], 1), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_ylabel(f"{label}\n{sum(right):.0f}/{len(right)} right", rotation=0, ha="right", va="center",
                      fontsize=9)
    names = ", ".join(f"'{it.prompt}'" for it in items[: a.prompts])
    fig.suptitle(f"{names} ({a.samples} samples each, the same noise in every row); right: adherence over "
                 f"{len(items)} prompts x {a.samples}", fontsize=9)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
