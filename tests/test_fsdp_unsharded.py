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
