"""What a weight sync sends to Ray rollout actors: the trained tensors, each once, cast to the
sync dtype, in buckets of bounded size.

- Once: tensors that share storage (GPT-2's tied input and output embeddings) are sent under
  their first name only; the actor's model, built from the same config, ties them too.
- dtype: `distributed.sync_dtype: bfloat16` halves the bytes of float32 weights (as verl and
  OpenRLHF send bf16 to their rollout engines); the actors then sample with the weights rounded
  to bf16, while the loss still takes its log-probs from the trainer's own weights. float32 (the
  default) sends them exactly, so a Ray run samples the batches one process samples.
- Buckets: each bucket is its own object in Ray's object store and an actor loads them one at a
  time, so an actor holds at most one bucket beside its model (not a second copy of the model).
"""

from __future__ import annotations

import torch


def pack(state: dict[str, torch.Tensor], dtype: torch.dtype, bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """`state`'s tensors on the CPU, storage-sharing duplicates dropped, floating ones cast to
    `dtype`, in order, split into buckets of at most `bucket_bytes` (a larger tensor alone)."""
    seen: set[tuple] = set()
    buckets: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        out = t.detach().to("cpu", dtype=dtype if t.is_floating_point() else t.dtype)
        n = out.numel() * out.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = out
        size += n
    return buckets if buckets[0] else []


def nbytes(buckets: list[dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for b in buckets for t in b.values())
