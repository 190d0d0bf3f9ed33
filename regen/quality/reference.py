"""Reference media for FID / KID / precision-recall and SSIM / PSNR (eval.reference):

  shapes        the shapes task's own drawings of each held-out prompt (the true distribution
                of the prompts evaluated; aligned with the samples, so SSIM/PSNR apply)
  base          the starting model's samples on the same prompts and noise: drift from where
                training began (kept from a run's first evaluation, see Quality)
  DIR           a folder of images (.png .jpg .jpeg .webp), sorted by name
  hf:NAME[:SPLIT]  a Hugging Face dataset with an 'image' column
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from regen.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def shapes_reference(metas: list[dict], seed: int) -> np.ndarray:
    """uint8 drawings of the given prompts' attributes (one per sample), from a fixed stream."""
    import torch

    from regen.tasks import shapes

    if not metas or not all("colour" in m for m in metas):
        raise UserError("eval.reference=shapes draws the built-in shapes prompts; these held-out rows are not "
                        "shapes prompts (no 'colour' field): give a folder or hf: dataset of reference images")
    g = torch.Generator().manual_seed(seed)
    return shapes.to_uint8(shapes.draw([dict(m) for m in metas], generator=g)).numpy()


def _as_array(images, where: str) -> np.ndarray:
    from PIL import Image

    arrays = []
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise UserError(f"{where}: item {i} is not an image")
        arrays.append(np.asarray(im.convert("RGB")))
    if len({a.shape for a in arrays}) > 1:
        raise UserError(f"{where}: the reference images differ in size ({sorted({a.shape for a in arrays})[:3]}...); "
                        "resize them to one size")
    return np.stack(arrays)


def folder_reference(spec: str, limit: int | None = None) -> np.ndarray:
    from PIL import Image

    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise UserError(f"eval.reference: '{spec}' is not a folder (expected shapes, base, a folder of images or "
                        "hf:NAME[:SPLIT])")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    if len(files) < 2:
        raise UserError(f"eval.reference: '{spec}' holds {len(files)} images ({', '.join(IMAGE_SUFFIXES)}); "
                        "distribution metrics need at least 2, and more than a few hundred to mean much")
    images = []
    for p in files:
        try:
            images.append(Image.open(p))
        except OSError as e:
            raise UserError(f"eval.reference: cannot read image '{p}': {e}") from None
    return _as_array(images, f"eval.reference '{spec}'")


def hf_reference(spec: str, limit: int | None = None) -> np.ndarray:
    from regen.data.hf import read_hf

    rows = read_hf(spec, ("image",), "eval.reference")[:limit]
    return _as_array([r["image"] for r in rows], f"eval.reference '{spec}' (column 'image')")
