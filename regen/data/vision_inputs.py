"""A batch's image inputs, kept per row so any subset of rows can be handed to the model.

Processors return image tensors in one of two layouts:
  - one entry per image (LLaVA: pixel_values (images, C, H, W));
  - packed (the Qwen-VL families: pixel_values (all patches, D) of every image one after the
    other, image_grid_thw (images, 3) saying how many patches each image has).
Either way, the inputs of a set of rows are the concatenation (dim 0) of each row's own piece, in
row order: the order in which the model meets the image tokens of its input. Keeping the pieces
per row makes selecting rows, repeating a prompt's row over its group, and sending a batch to
another process the same operation for both layouts, and lets a row hold several images or none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Rows' pieces one after the other. Idefics3's are (1, tiles, ...) padded to their own batch's
    most tiles with all-zero tiles, which the model drops: rows from different batches are padded
    the same way to the most tiles among them."""
    widest = max(p.shape[1] for p in pieces) if pieces[0].dim() >= 4 else None
    if widest is not None and any(p.shape[1] != widest for p in pieces):
        pieces = [F.pad(p, (0, 0) * (p.dim() - 2) + (0, widest - p.shape[1])) for p in pieces]
    return torch.cat(pieces)


class VisionInputs:
    """rows[i]: row i's image tensors by forward argument name ({} for a row without images)."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, idx) -> VisionInputs:
        keep = idx.tolist() if torch.is_tensor(idx) else list(idx)
        return VisionInputs([self.rows[i] for i in keep])

    def repeat(self, n: int) -> VisionInputs:
        """Each row n times in a row (a prompt's group); the tensors are shared, not copied."""
        return VisionInputs([r for r in self.rows for _ in range(n)])

    def to(self, device) -> VisionInputs:
        moved: dict[int, torch.Tensor] = {}  # a tensor shared by a group's rows moves once

        def mv(t):
            if id(t) not in moved:
                moved[id(t)] = t.to(device)
            return moved[id(t)]

        return VisionInputs([{k: mv(v) for k, v in r.items()} for r in self.rows])

    def kwargs(self, idx=None) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments for rows `idx` (all rows for None); no key when none of them has an image."""
        rows = self.rows if idx is None else self.select(idx).rows
        keys = list(dict.fromkeys(k for r in rows for k in r))
        return {k: _cat([r[k] for r in rows if k in r]) for k in keys}

    @staticmethod
    def cat(parts: list[VisionInputs]) -> VisionInputs:
        return VisionInputs([r for p in parts for r in p.rows])

    @staticmethod
    def split(rows: int, tensors: dict[str, torch.Tensor], counts: dict[str, list[int]]) -> VisionInputs:
        """Per-row pieces of a processor's batched tensors: counts[k][i] entries of tensors[k] belong to row i."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(rows)]
        for k, t in tensors.items():
            for i, piece in enumerate(torch.split(t, counts[k])):
                if counts[k][i]:
                    out[i][k] = piece
        return VisionInputs(out)
