"""What a weight sync sends to Ray rollout actors: the trained tensors, each once, cast to the
sync dtype, only those that changed since the last sync, in buckets of bounded size.

- Once: tensors that share storage (GPT-2's tied input and output embeddings) are sent under
  their first name only; the actor's model, built from the same config, ties them too.
- dtype: `distributed.sync_dtype: bfloat16` halves the bytes of float32 weights (as verl and
  OpenRLHF send bf16 to their rollout engines); the actors then sample with the weights rounded
  to bf16, while the loss still takes its log-probs from the trainer's own weights. float32 (the
  default) sends them exactly, so a Ray run samples the batches one process samples.
- Changed only (`distributed.sync_changed_only`, default on): a tensor whose value, after the
  cast, equals what the last sync sent is not sent again: a VLM's frozen vision tower, a joint
  run's frozen member, and (in bf16) weights an update moved less than bf16's resolution travel
  once. The comparison is exact (torch.equal against a kept copy of what was sent), so an actor
  that took every sync holds exactly the weights a full sync would give it. A replaced actor
  (a new one, built from model.path) instead loads the `Chain`: every earlier bucket that still
  holds a current tensor, in the order they were sent.
- Buckets: each bucket is its own object in Ray's object store and an actor loads them one at a
  time, so an actor holds at most one bucket beside its model (not a second copy of the model).
"""

from __future__ import annotations

import torch


class Packer:
    """Successive syncs of one trainer's weights. `changed_only` keeps a copy of what each sync
    sent (in the sync dtype, in CPU memory: the size of the synced weights) to compare with."""

    def __init__(self, dtype: torch.dtype, bucket_bytes: int, changed_only: bool):
        self.dtype, self.bucket_bytes, self.changed_only = dtype, bucket_bytes, changed_only
        self.sent: dict[str, torch.Tensor] = {}
        self.skipped = 0  # tensors the last pack left out, unchanged

    def pack(self, state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """`state`'s tensors on the CPU, storage-sharing duplicates dropped, floating ones cast to
        the sync dtype, unchanged ones left out (changed_only), in order, split into buckets of at
        most bucket_bytes (a larger tensor alone)."""
        seen: set[tuple] = set()
        buckets: list[dict[str, torch.Tensor]] = [{}]
        size, self.skipped = 0, 0
        for name, t in state.items():
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key in seen:
                continue
            seen.add(key)
            out = t.detach().to("cpu", dtype=self.dtype if t.is_floating_point() else t.dtype)
            if self.changed_only:
                last = self.sent.get(name)
                if last is not None and last.dtype == out.dtype and torch.equal(last, out):
                    self.skipped += 1
                    continue
                if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                    out = out.clone()  # a CPU parameter comes back as itself: keep what was sent, not what it becomes
                self.sent[name] = out
            n = out.numel() * out.element_size()
            if buckets[-1] and size + n > self.bucket_bytes:
                buckets.append({})
                size = 0
            buckets[-1][name] = out
            size += n
        return buckets if buckets[0] else []


class Chain:
    """The buckets a new actor loads, in order, to hold the current weights after delta syncs:
    each bucket sent, with the names it holds whose latest value it still carries; a bucket left
    with none is dropped (its tensors were all sent again later). Older buckets may still carry
    stale values of tensors sent again since: the later bucket, loaded after, overwrites them."""

    def __init__(self):
        self.links: list[tuple[object, set[str]]] = []  # (bucket or its object reference, current names)

    def add(self, handles: list, buckets: list[dict[str, torch.Tensor]]) -> list:
        """Record a sync (each bucket's handle beside the bucket); returns the handles to load."""
        new = {name for b in buckets for name in b}
        self.links = [(h, live - new) for h, live in self.links if live - new]
        self.links += [(h, set(b)) for h, b in zip(handles, buckets, strict=True)]
        return [h for h, _ in self.links]


def nbytes(buckets: list[dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for b in buckets for t in b.values())
