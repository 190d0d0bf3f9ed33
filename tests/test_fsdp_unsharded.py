"""Dist.unsharded on two real gloo ranks: inside it an FSDP2 model's blocks stay gathered between
forwards (sampling's many forwards gather once), after it they are sharded again, and the outputs
are the sharded model's."""

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.extended  # two processes: the CI's second tier


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as tdist
    from torch.distributed.tensor import DTensor

    from regen.runtime.dist import Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    model.forward = lambda x: model.blocks[2](model.blocks[1](model.blocks[0](x)).relu())
    d = Dist("fsdp", rank, 2)
    d.wrap(model)
    sharded = lambda: [isinstance(p, DTensor) for p in model.parameters()]  # noqa: E731
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        plain = model(x)
        after_plain = sharded()
        with d.unsharded(model):
            first = model(x)
            between = sharded()  # after a forward, still gathered
            second = model(x)
        after = sharded()
        again = model(x)
    torch.save({"after_plain": after_plain, "between": between, "after": after,
                "same": [torch.equal(plain, first), torch.equal(plain, second), torch.equal(plain, again)]},
               f"{out}/{rank}.pt")
    tdist.destroy_process_group()


def test_unsharded_keeps_fsdp2_blocks_gathered_and_shards_them_again(tmp_path):
    torch.multiprocessing.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"{rank}.pt")
        assert all(r["after_plain"]), r  # a plain forward reshards (so sampling would gather at every token)
        assert not any(r["between"]), r  # inside: gathered once, kept between forwards
        assert all(r["after"]), r  # sharded again for the update and the optimizer
        assert r["same"] == [True, True, True], r


def _optim_rank(rank: int, port: int, out: str) -> None:
    from pathlib import Path

    import torch.distributed as tdist

    from regen.runtime import checkpoint as ckpt
    from regen.runtime.dist import Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)

    def build():
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.blocks = torch.nn.ModuleList([torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)])  # 7 rows: uneven shards
        m.forward = lambda x: m.blocks[1](m.blocks[0](x).tanh())
        d.wrap(m)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.9))

    d = Dist("fsdp", rank, 2)
    model, opt = build()
    for i in range(2):
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * i + rank))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    folder = Path(out) / "ckpt"
    spooled = d.full_optim_state(model, opt, folder)  # streamed to disk by rank 0, tensor by tensor
    whole = d.full_optim_state(model, opt)  # torch's get_optimizer_state_dict, in memory
    if rank == 0:
        (folder / "opt").mkdir(parents=True)
        ckpt.save_optimizer(spooled, folder / "opt", "optimizer")
        ckpt.save_optimizer(ckpt.Gathered(whole), folder, "reference")
    tdist.barrier()
    fresh, fresh_opt = build()
    d.load_optim_state(fresh, fresh_opt, ckpt.load_optimizer(folder / "opt", "optimizer"))  # one tensor at a time
    ref, ref_opt = build()
    d.load_optim_state(ref, ref_opt, ckpt.load_optimizer(folder, "reference").load())  # torch's loader, whole
    shards = lambda o: [{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in o.state[p].items()}  # noqa: E731
                        for g in o.param_groups for p in g["params"]]
    torch.save({"fresh": shards(fresh_opt), "ref": shards(ref_opt), "own": shards(opt),
                "groups": [(g["betas"], g["lr"]) for g in fresh_opt.param_groups]}, f"{out}/{rank}.pt")
    tdist.destroy_process_group()


def test_fsdp2_optimizer_state_streamed_to_disk_and_back_is_torchs_own_to_the_bit(tmp_path):
    torch.multiprocessing.spawn(_optim_rank, args=(_free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"{rank}.pt")
        assert len(r["own"]) == 4 and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in r["own"])
        for fresh, ref, own in zip(r["fresh"], r["ref"], r["own"], strict=True):
            for k in own:  # each rank's shard: what it trained, what torch's loader gives, what ours gives
                assert torch.equal(fresh[k], own[k]) and torch.equal(ref[k], own[k]), (rank, k)
        assert r["groups"] == [((0.8, 0.9), 1e-2)] * 1
