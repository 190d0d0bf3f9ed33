"""A safetensors file written one tensor at a time.

safetensors' own `save_file` takes the whole dict at once, so a writer must first hold every tensor
in memory. Gathering FSDP2's sharded optimizer state that way put a second full copy of AdamW's
moments (8 bytes per parameter) on rank 0 beside its shard (measured in bench/rehearsal.py: 9.6 GiB
on rank 0 for a 0.5B model whose shard is 3.7 GiB). Here the header (every name, dtype and shape,
known before any data) is written first and each tensor's bytes follow as it arrives, in the format
safetensors reads (an 8-byte little-endian header length, the JSON header padded to 8 bytes, then
the data at the header's offsets): the writer holds one tensor at a time.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


class StreamWriter:
    """Write `entries` ((name, dtype, shape), in file order) to `path`; then `write` each tensor in
    that order and `close`."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, offset = {}, 0
        for name, dtype, shape in entries:
            if dtype not in DTYPES:
                raise ValueError(f"tensor '{name}': dtype {dtype} cannot be written to safetensors")
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.entries, self.done = [(n, d, tuple(s)) for n, d, s in entries], 0
        self.f = open(path, "wb")  # noqa: SIM115  (closed by close(), also on a failed write)
        self.f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.done >= len(self.entries):
            raise ValueError(f"tensor '{name}': all {len(self.entries)} declared tensors were already written")
        want = self.entries[self.done]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != want:
            raise ValueError(f"tensor {self.done} written as {got}, declared as {want}")
        t = tensor.detach().cpu().contiguous().reshape(-1)
        self.f.write(t.view(torch.uint8).numpy().data)  # the tensor's own bytes, no copy
        self.done += 1

    def close(self) -> None:
        try:
            if self.done != len(self.entries):
                raise ValueError(f"{self.done} of {len(self.entries)} declared tensors written")
        finally:
            self.f.close()
