"""FSDP2 optimizer state to and from a checkpoint one tensor at a time (regen/runtime/dist.py calls
these): rank 0 streams the gathered state to disk, and each rank reads it back keeping only its
shards, so no process holds the whole AdamW state (8 bytes per parameter) beside its own share."""

from __future__ import annotations

from pathlib import Path

import torch


def spool_optim_state(opt: torch.optim.Optimizer, spool: Path, main: bool):
    """Every rank gathers each state tensor in turn (a collective); rank 0 (`main`) writes it to
    `spool` (a folder on the checkpoints' filesystem) as it comes and gets a ckpt.Spooled."""
    from torch.distributed.tensor import DTensor

    from regen.runtime.checkpoint import Spooled
    from regen.runtime.safetensors_stream import StreamWriter

    # ids as Optimizer.state_dict() numbers them: every parameter of every group, in order
    params = [p for g in opt.param_groups for p in g["params"]]
    tensors = [(f"{i}.{k}", v) for i, p in enumerate(params) for k, v in opt.state.get(p, {}).items()
               if torch.is_tensor(v)]
    scalars = {f"{i}.{k}": v for i, p in enumerate(params) for k, v in opt.state.get(p, {}).items()
               if not torch.is_tensor(v)}
    groups, start = [], 0
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    path = spool / ".gathered-optimizer.safetensors"  # a leftover of an interrupted save is overwritten
    writer, error = None, None
    if main:
        try:
            spool.mkdir(parents=True, exist_ok=True)
            writer = StreamWriter(path, [(n, v.dtype, tuple(v.shape)) for n, v in tensors])
        except OSError as e:
            error = e
    for name, v in tensors:  # every rank, in the same order: each full_tensor() is a collective
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if writer is not None and error is None:
            try:
                writer.write(name, full)
            except OSError as e:  # a full disk: the other ranks' gathers still need this rank
                error = e
        del full
    if writer is not None:
        try:
            writer.close()
        except (OSError, ValueError) as e:
            error = error or e
    # a failed write surfaces where the checkpoint is written (an alert, earlier checkpoints kept)
    return Spooled(path, {"param_groups": groups, "scalars": scalars}, error) if main else None


def load_sharded(opt: torch.optim.Optimizer, saved) -> None:
    """A checkpoint's optimizer state into FSDP2's sharded optimizer one tensor at a time: each
    rank reads a tensor and keeps its own shard (placed as the parameter's), so the whole state
    is never in memory (the rehearsal measured 14.5 GiB on a resuming rank 0 of a 0.5B model
    whose shard is 3.7 GiB). The same as torch's set_optimizer_state_dict with full tensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in opt.param_groups for p in g["params"]]
    opt.state.clear()
    for key in sorted(saved.keys, key=lambda k: (int(k.split(".", 1)[0]), k)):
        i, name = key.split(".", 1)
        p, full = params[int(i)], saved.tensor(key)
        if isinstance(p, DTensor) and full.shape == p.shape:  # moments: sharded as their parameter
            full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        opt.state.setdefault(p, {})[name] = full
    for key, v in saved.meta["scalars"].items():
        i, name = key.split(".", 1)
        opt.state.setdefault(params[int(i)], {})[name] = v
    for g, sg in zip(opt.param_groups, saved.meta["param_groups"], strict=True):
        g.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in sg.items() if k != "params"})
