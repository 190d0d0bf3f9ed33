"""Data parallelism under torchrun (`distributed.mode: torchrun`), on torch.distributed.

Every rank holds the whole rollout batch of a step (tokens, rewards, log-probs are small)
and computes the same advantages; the heavy work is split by rows: each rank samples, scores
and scores log-probs of its share of the groups, and in the update takes its share of every
minibatch. Gradients are averaged by DDP (all-reduce) or FSDP2 (`fully_shard`: parameters,
gradients and optimizer state sharded, reduce-scatter). Because the loss of a share uses the
*global* minibatch denominators (see algorithms.losses.batch_denominators), the ranks' losses
add up to the single-process loss; the averaging engines divide by the world size, so each
rank's loss is multiplied by it (`loss_scale`).

Single process is the default and the same code path with world size 1: every function here
is then a no-op, so `breakpoint()` keeps working.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from regen.errors import UserError

_ACTIVE: Dist | None = None


class Dist:
    """The process group this run trains in: rank, world size and the collectives the loop needs."""

    def __init__(self, strategy: str = "single", rank: int = 0, world: int = 1, side_group=None,
                 device: torch.device | None = None):
        self.strategy, self.rank, self.world = strategy, rank, world
        self.device = device or torch.device("cpu")  # where the group's tensors must be (NCCL: this rank's GPU)
        # A second (gloo) group for what runs in a background thread, such as scoring that overlaps
        # the log-prob passes: collectives of two threads on one group would interleave and mismatch.
        self.side_group = side_group

    @property
    def main(self) -> bool:
        """Rank 0 writes the run directory (metrics, alerts, checkpoints, samples)."""
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1

    @property
    def loss_scale(self) -> float:
        """DDP and FSDP2 average gradients over ranks; the ranks' loss shares must add up."""
        return float(self.world)

    # ------------------------------------------------------------------ rows

    def my_rows(self, rows: torch.Tensor, unit: int = 1) -> torch.Tensor:
        """This rank's contiguous share of `rows` (whole units of `unit` rows, e.g. groups)."""
        if not self.on:
            return rows
        units = len(rows) // unit
        if units % self.world:
            raise UserError(f"{len(rows)} rows in units of {unit} cannot be split evenly over {self.world} processes")
        per = len(rows) // self.world
        return rows[self.rank * per : (self.rank + 1) * per]

    # ------------------------------------------------------------ collectives

    def barrier(self) -> None:
        if self.on:
            tdist.barrier()

    def gather_objects(self, obj: Any, side: bool = False) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (pickled: small things only).
        side: on the side group (from a background thread)."""
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.world
        tdist.all_gather_object(out, obj, group=self.side_group if side else None)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.on:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_batch(self, obj: Any) -> Any:
        """Rank 0's `obj` (a sampled batch) on every rank: its tensors as one broadcast of raw bytes
        over the process group (NCCL on GPUs), only its skeleton pickled (regen/runtime/tensor_tree.py),
        so that what is pickled per step does not grow with the batch. Sets `batch_bytes` to
        (bytes pickled, bytes broadcast) on rank 0."""
        if not self.on:
            return obj
        import pickle

        from regen.runtime import tensor_tree as tt

        head, tensors = None, []
        if self.main:
            skeleton, tensors = tt.split(obj)
            head = (skeleton, tt.layout(tensors))
        skeleton, meta = self.broadcast_object(head)
        buf = tt.pack_bytes(tensors, self.device) if self.main else tt.empty_bytes(meta, self.device)
        if buf.numel():
            tdist.broadcast(buf, src=0)
        if self.main:
            self.batch_bytes = (len(pickle.dumps(head)), int(buf.numel()))
            return obj  # rank 0 keeps its own tensors
        return tt.join(skeleton, tt.unpack_bytes(buf, meta, self.device))

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's rows (same shape on every rank) in rank order."""
        if not self.on:
            return t
        src = t.contiguous().to(self.device)
        parts = [torch.empty_like(src) for _ in range(self.world)]
        tdist.all_gather(parts, src)
        return torch.cat(parts).to(t.device)

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Sum a dict of floats over ranks (same keys in the same order on every rank)."""
        if not self.on or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        tdist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over ranks in place, in one flat all-reduce (a missing gradient counts as
        zeros): data parallelism without a wrapper, for trainers whose ranks' losses add up to the whole batch's."""
        if not self.on:
            return
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():  # one all-reduce per dtype (the same groups on every rank)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            flat = torch.cat([g.reshape(-1) for g in grads]).to(self.device)
            tdist.all_reduce(flat)
            start = 0
            for p, g in zip(group, grads):
                p.grad = flat[start : start + g.numel()].view_as(g).to(g.device)
                start += g.numel()

    def all_true(self, flag: bool) -> bool:
        """True when `flag` holds on every rank: decisions that must not diverge (skip a step)."""
        if not self.on:
            return flag
        t = torch.tensor([0.0 if flag else 1.0], device=self.device)
        tdist.all_reduce(t)
        return bool(t.item() == 0)

    def any_true(self, flag: bool) -> bool:
        return not self.all_true(not flag)

    # -------------------------------------------------------------- models

    def wrap(self, model: torch.nn.Module, trainable: bool = True, unused: bool = False) -> torch.nn.Module:
        """The module the update runs through: DDP around `model`, or `model` itself sharded in
        place by FSDP2 (its transformer blocks first, then the root, as torch recommends).
        unused: some parameters never reach the loss (Qwen-Image's last block's text stream), so
        DDP must look for them after each forward instead of waiting for their gradients."""
        if not self.on:
            return model
        if self.strategy == "ddp":
            if not trainable:
                return model  # a frozen replica needs no gradient sync
            from torch.nn.parallel import DistributedDataParallel

            dev = next(model.parameters()).device
            # buffers are constants here; broadcasting them would put a collective in every forward
            # (torch >= 2.13 names the switch forward_sync_buffers and warns about the old one)
            import inspect

            sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel.__init__).parameters else "broadcast_buffers"
            return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if dev.type == "cuda"
                                           else None, find_unused_parameters=unused, **{sync: False})
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model):
            fully_shard(block)
        # reshard the root too: outside a forward, model.parameters() are then always the sharded
        # ones the optimizer holds (FSDP2 keeps the root unsharded after forward by default)
        fully_shard(model, reshard_after_forward=True)
        return model

    @property
    def sharded(self) -> bool:
        return self.on and self.strategy == "fsdp"

    @contextlib.contextmanager
    def unsharded(self, model: torch.nn.Module):
        """FSDP2: keep `model`'s parameters gathered from the first forward to the end of the block,
        then shard them again. Sampling runs the model once per token (or denoising step); left
        sharded, every one of those forwards all-gathers every block again (measured in
        bench/rehearsal.py: 98 s instead of 4 s to sample 8 x 16 tokens from a 0.5B model on two
        CPU ranks). The cost is the whole model on each rank while sampling, as under DDP. torch's
        FSDPModule.set_reshard_after_forward documents this switch for evaluation."""
        if not self.sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        model.set_reshard_after_forward(False)  # every FSDP unit under model
        try:
            yield
        finally:
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()
            model.set_reshard_after_forward(True)  # as wrap() sharded them (the root too)

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole (unsharded) state dict on CPU; collective under FSDP2 (call on every rank)."""
        if not self.sharded:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a whole state dict into `model` (sharding it under FSDP2)."""
        if not self.sharded:
            model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def full_optim_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, spool: Path | None = None):
        """The optimizer state in the single-process form (integer parameter ids in parameter
        order), so checkpoints move freely between one process and FSDP2; collective. With `spool`
        (a folder on the checkpoints' filesystem) rank 0 streams it there tensor by tensor and gets
        a ckpt.Spooled, holding one gathered tensor at a time instead of the whole state."""
        if not self.sharded:
            return None
        if spool is not None:
            from regen.runtime.fsdp_state import spool_optim_state

            return spool_optim_state(opt, Path(spool), self.main)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.main:
            return None  # cpu_offload gathers on rank 0 only
        ids, groups = {}, []
        for g in full["param_groups"]:
            ids.update({name: len(ids) + i for i, name in enumerate(g["params"])})
            groups.append({**g, "params": [ids[name] for name in g["params"]]})
        return {"state": {ids[name]: st for name, st in full["state"].items()}, "param_groups": groups}

    def load_optim_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, state) -> None:
        """Load a single-process optimizer state (a state_dict, or a checkpoint's ckpt.Stored, which
        every rank reads) into this process's optimizer; under FSDP2 each rank takes its shards."""
        from regen.runtime.checkpoint import Stored, state_dict_of

        if not self.sharded:
            opt.load_state_dict(state_dict_of(state))
            return
        if isinstance(state, Stored):
            from regen.runtime.fsdp_state import load_sharded

            load_sharded(opt, state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        groups, start = [], 0
        for g in state["param_groups"]:
            groups.append({**g, "params": order[start : start + len(g["params"])]})
            start += len(g["params"])
        full = {"state": {order[int(i)]: st for i, st in state["state"].items()}, "param_groups": groups}
        set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True))


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """FSDP2's units: the repeated blocks of a model, i.e. the elements of every ModuleList of
    blocks (each element holding parameters) at the shallowest depth where there is one: a
    transformers LM's layers, a UNet's down and up blocks, FLUX's double- and single-stream
    blocks alike (were FLUX's 38 single blocks left to the root unit, its forward would gather
    them all at once)."""
    level = [model]
    while level:
        lists = [m for m in level if isinstance(m, torch.nn.ModuleList) and len(m)
                 and all(any(True for _ in b.parameters()) for b in m)]
        if lists:
            return [b for lst in lists for b in lst]
        level = [c for m in level for c in m.children()]
    return []


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


GROUP_ENV = "REGEN_TRAINER_GROUP"  # set by regen/train/ray_trainers.py in each trainer actor
GENERATION_ENV = "REGEN_GROUP_GENERATION"  # which start of the trainer group this is (0, then each restart)


def in_trainer_group() -> bool:
    """This process is a trainer actor of a Ray trainer group: RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT were set by the group's driver, as torchrun sets them for its ranks."""
    return os.environ.get(GROUP_ENV) == "1"


def start(mode: str, strategy: str, backend: str, device: torch.device, timeout_s: float = 1800.0) -> Dist:
    """Join the torchrun process group (mode torchrun, or auto under torchrun) or stay single.
    timeout_s: how long a collective waits for the other ranks (both groups)."""
    global _ACTIVE
    if mode == "auto":
        mode = "torchrun" if launched_by_torchrun() else "single"
    if mode == "ray" and in_trainer_group():
        mode = "torchrun"  # a trainer actor joins its group exactly as a torchrun rank does
    if mode != "torchrun":
        if launched_by_torchrun():  # N copies of a one-process run would write the same run directory
            raise UserError(f"started by torchrun with {os.environ['WORLD_SIZE']} processes but distributed.mode="
                            f"{mode}: use distributed.mode=torchrun (or auto), or start it without torchrun")
        _ACTIVE = Dist()
        return _ACTIVE
    if "RANK" not in os.environ:
        raise UserError("distributed.mode=torchrun: start the job with torchrun "
                        "(torchrun --nproc_per_node N -m regen train CONFIG ...); RANK/WORLD_SIZE are not set")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("distributed.backend=nccl needs CUDA devices; use gloo on CPU")
    if not tdist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    comm = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    side = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    _ACTIVE = Dist(strategy, tdist.get_rank(), tdist.get_world_size(), side, comm)
    return _ACTIVE


def current() -> Dist:
    """The run's Dist (single process until `start` joined a group)."""
    return _ACTIVE or Dist()


def stop() -> None:
    global _ACTIVE
    if tdist.is_initialized():
        tdist.destroy_process_group()
    _ACTIVE = None
