"""`distributed.sync: collective`: weights go from the trainer to its rollout actors by a broadcast
over a process group of their own (gloo on CPU, NCCL when the trainer and the actors are on GPUs),
as verl and OpenRLHF move weights to their rollout engines, instead of through Ray's object store.

- The group: the trainer is rank 0, rollout actor i is rank i + 1. It is a stateless group (a
  TCPStore the trainer serves, a ProcessGroupGloo / ProcessGroupNCCL built on it), apart from any
  default group the process has (torchrun's, a Ray trainer group's), so it can be rebuilt alone.
- A sync: every actor is told the buckets' names and layouts (a small Ray call, queued after its
  earlier calls), then each bucket travels as one packed byte buffer (regen/runtime/tensor_tree.py)
  broadcast from rank 0, and the actor copies it into its model (or vLLM engine) bucket by bucket:
  it holds one bucket's buffer beside its model, as with the object store. What a sync sends (the
  dtype, only changed tensors, bucket size) is the object-store path's (regen/placement/sync.py).
- Faults: a rank that dies breaks the group for everyone (gloo reports the closed connection at
  once). A sync that fails replaces the dead actors (they load the current weights through the
  object store, as on the other path), builds a new group (a new generation: its own store prefix)
  and sends the sync again to every actor; an actor replaced between syncs joins the new group the
  next sync builds.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import torch

from regen.errors import RunStopped
from regen.runtime import tensor_tree as tt


def connect(host: str, port: int, tag: int, rank: int, world: int, backend: str, timeout_s: float, store=None):
    """This process's member of group generation `tag` (rank 0 passes the store it serves)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"regen-sync-{tag}", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def device_of(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def broadcast(group, buf: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def receive(group, meta, backend: str) -> list[torch.Tensor]:
    """One bucket from rank 0: views of the received buffer (the caller copies them into its model)."""
    dev = device_of(backend)
    buf = tt.empty_bytes(meta, dev)
    broadcast(group, buf)
    return tt.unpack_bytes(buf, meta, dev, copy=False)


def backend_for(cfg) -> str:
    """NCCL when this trainer and the rollout actors are on GPUs, else gloo."""
    on_gpus = cfg.distributed.rollout_resources.get("num_gpus", 0) > 0
    return "nccl" if torch.cuda.is_available() and on_gpus else "gloo"


class CollectiveSync:
    """The trainer's side: the group's store, its current generation, and the sends."""

    def __init__(self, workers, backend: str, timeout_s: float, max_restarts: int):
        import ray
        import torch.distributed as dist

        self.workers, self.backend, self.timeout_s, self.max_restarts = workers, backend, timeout_s, max_restarts
        self.host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        self.group, self.tag, self.formed = None, 0, None  # formed: the actors' generation the group holds
        self.regroups = 0

    def send(self, buckets: list[dict[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Every actor takes `buckets` as `version`; returns when each has them in its model."""
        metas = [(list(b), tt.layout(list(b.values()))) for b in buckets]
        t0, tries = time.perf_counter(), 0
        while (failure := self._try(buckets, metas, version)) is not None:
            tries += 1
            if tries > self.max_restarts:
                raise RunStopped(f"weight sync over the collective group failed {tries} times in one step "
                                 f"(last: {failure}); see distributed.max_restarts")
            # out of the except block, so no traceback holds the group: destroying it closes this
            # end's connections, which is what wakes the survivors still waiting for a bucket
            # (gloo's abort() does not; measured: they waited out the group's timeout)
            self._drop()
            k = len(self.workers.actors)  # the dead are replaced (and load the weights); then a new group
            self.workers.get([self.workers.call(i, "ready") for i in range(k)], "ready", [()] * k)
        return {"sync/broadcast_s": time.perf_counter() - t0, "sync/regroups": float(self.regroups)}

    def _try(self, buckets, metas, version: int) -> str | None:
        """One attempt at a whole sync; None when every actor has it, else what failed."""
        import ray
        from ray.exceptions import RayError

        try:
            if self.formed != self.workers.generation:
                self._form()
            refs = [self.workers.call(i, "recv_weights", metas, version) for i in range(len(self.workers.actors))]
            for b in buckets:
                broadcast(self.group, tt.pack_bytes(list(b.values()), device_of(self.backend)))
            ray.get(refs)  # each actor has copied the last bucket in: a sample after this sees them all
            return None
        except (RuntimeError, RayError) as e:  # a rank died mid-sync (gloo: "Connection closed by peer")
            return str(e).splitlines()[0][:200] if str(e) else type(e).__name__

    def _form(self) -> None:
        """A new generation of the group: every current actor and this trainer."""
        import ray

        self._drop()
        self.tag += 1
        world = len(self.workers.actors) + 1
        refs = [self.workers.call(i, "join_group", self.host, self.store.port, self.tag, i + 1, world, self.backend,
                                  self.timeout_s) for i in range(world - 1)]
        self.group = connect(self.host, self.store.port, self.tag, 0, world, self.backend, self.timeout_s, self.store)
        ray.get(refs)
        self.formed = self.workers.generation
        self.regroups += self.tag > 1

    def _drop(self) -> None:
        # dropped explicitly, before the store: a group left to interpreter exit can abort the process
        self.group, self.formed = None, None
        gc.collect()  # a reference cycle must not keep the old group's connections open

    def close(self) -> None:
        self._drop()
        self.store = None
