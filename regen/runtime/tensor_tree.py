"""A batch as a small skeleton plus its tensors, so that a trainer group's ranks receive the tensors
over the process group (one broadcast of raw bytes) and only the skeleton is pickled.

`split` walks lists, tuples, dicts, dataclasses and regen's own classes (their attributes),
replacing every tensor by a `Slot` numbered in order of first appearance; a tensor that occurs
twice (a group's rows sharing one prompt image) is one slot, so it travels once and arrives
shared. `join` puts tensors back into a skeleton. `pack_bytes` / `unpack_bytes` turn the tensors
into one uint8 buffer and back, each tensor's bytes starting at a multiple of 16 so that every
dtype can be viewed in place.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

ALIGN = 16  # bytes: the largest element size (complex128) divides it


class Slot:
    """Where tensor number `i` of a split batch goes."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return Slot, (self.i,)


def _walked(x) -> bool:
    """Objects whose attributes are walked: dataclasses and regen's own classes (not types)."""
    if isinstance(x, type):
        return False
    return dataclasses.is_dataclass(x) or (type(x).__module__.startswith("regen.") and hasattr(x, "__dict__"))


def _map(x, fn):
    if isinstance(x, torch.Tensor | Slot):
        return fn(x)
    if type(x) in (list, tuple):
        return type(x)(_map(v, fn) for v in x)
    if type(x) is dict:
        return {k: _map(v, fn) for k, v in x.items()}
    if _walked(x):
        y = copy.copy(x)
        for k, v in vars(x).items():
            object.__setattr__(y, k, _map(v, fn))  # frozen dataclasses too
        return y
    return x


def split(obj) -> tuple[object, list[torch.Tensor]]:
    """(skeleton, tensors): `obj` with each tensor replaced by a Slot, and the tensors in slot order."""
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    def slot(t: torch.Tensor) -> Slot:
        if id(t) not in seen:
            seen[id(t)] = len(tensors)
            tensors.append(t)
        return Slot(seen[id(t)])

    return _map(obj, slot), tensors


def join(skeleton, tensors: list[torch.Tensor]):
    """The inverse of `split`: the skeleton with each Slot replaced by its tensor."""
    return _map(skeleton, lambda s: tensors[s.i])


def layout(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], str, str]]:
    """What a receiver needs to cut the buffer: each tensor's shape, dtype name and device type."""
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type) for t in tensors]


def _spans(meta) -> tuple[list[tuple[int, int]], int]:
    spans, at = [], 0
    for shape, dtype, _ in meta:
        n = torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        spans.append((at, n))
        at += -(-n // ALIGN) * ALIGN
    return spans, at


def pack_bytes(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """One uint8 buffer on `device` holding every tensor's bytes (layout(tensors) cuts it)."""
    spans, total = _spans(layout(tensors))
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    for t, (at, n) in zip(tensors, spans):
        if n:
            buf[at:at + n] = t.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
    return buf


def empty_bytes(meta, device) -> torch.Tensor:
    """The buffer a receiver fills (by a broadcast) before unpack_bytes."""
    return torch.empty(_spans(meta)[1], dtype=torch.uint8, device=device)


def unpack_bytes(buf: torch.Tensor, meta, device, copy: bool = True) -> list[torch.Tensor]:
    """The tensors of a packed buffer: each its own copy, with its shape and dtype, on the CPU when
    it was sent from the CPU, else on `device`. copy=False: views of `buf` where they are (for a
    receiver that copies them on at once, such as into its model)."""
    spans, _ = _spans(meta)
    out = []
    for (shape, dtype, where), (at, n) in zip(meta, spans):
        t = buf[at:at + n].view(getattr(torch, dtype)).reshape(shape)
        if copy:
            t = t.clone()
            t = t.cpu() if where == "cpu" else t.to(device)
        out.append(t)
    return out
