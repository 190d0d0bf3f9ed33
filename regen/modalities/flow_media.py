"""Flow samples kept in the run directory: PNG images and GIF videos under samples/, with a
JSONL row each (what `regen report` shows beside each sample's reward)."""

from __future__ import annotations

from pathlib import Path

from regen.policies.flow import FlowPolicy, FlowSample


def save_media(run_dir: Path, step: int, sample: FlowSample, rewards: list[float] | None = None, limit: int = 16,
               policy: FlowPolicy | None = None, task: str | None = None, rows: list[dict] | None = None,
               pick: list[int] | None = None):
    """The first `limit` samples as PNG (images) or GIF (videos) under samples/step_N/, with a
    samples/step_N.jsonl row each (prompt, reward, image path relative to the run dir).
    `policy` decodes sample.x0 to pixels (latent models); without it x0 must be pixels. task: a
    multi-task run's task, whose files go to samples/step_N/TASK/ and rows carry "task". rows:
    fields that replace each kept sample's defaults (a joint run: the user's prompt and the rewrite).
    pick: the samples kept, by index (default: the first `limit`)."""
    from PIL import Image

    from regen.modalities.lm_eval import write_samples
    from regen.tasks.shapes import to_uint8

    folder = run_dir / "samples" / f"step_{step:08d}" / (task or "")
    folder.mkdir(parents=True, exist_ok=True)
    pick = list(range(min(limit, len(sample.prompts)))) if pick is None else pick
    x0 = sample.x0[pick]
    pix = to_uint8((x0 if policy is None else policy.decode(x0)).detach().cpu())
    up = max(1, 64 // pix.shape[-2])  # small samples upscaled to 64 px so they can be seen, large ones kept
    size = (pix.shape[-2] * up, pix.shape[-3] * up)  # PIL: (width, height)
    out = []
    for i, (j, arr) in enumerate(zip(pick, pix)):
        row = {"prompt": sample.prompts[j], **(rows[i] if rows else {}), "reward": None if rewards is None else rewards[j]}
        if arr.dim() == 4:  # video: an animated GIF
            frames = [Image.fromarray(f.numpy()).resize(size, Image.NEAREST) for f in arr]
            path = folder / f"{i}.gif"
            frames[0].save(path, save_all=True, append_images=frames[1:], duration=120, loop=0)
            row["video"] = str(path.relative_to(run_dir))
        else:
            path = folder / f"{i}.png"
            Image.fromarray(arr.numpy()).resize(size, Image.NEAREST).save(path)
            row["image"] = str(path.relative_to(run_dir))
        out.append(row)
    write_samples(run_dir, step, out, task)
