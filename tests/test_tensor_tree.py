"""A trainer group's batch reaches its ranks as tensors over the process group, not pickled
(regen/runtime/tensor_tree.py, Dist.broadcast_batch): the skeleton and tensors round-trip bit for
bit (shared tensors arrive shared), what is pickled does not grow with the batch, and two real
processes on a gloo group receive rank 0's batch exactly."""

import pickle

import torch
import torch.multiprocessing as mp

from regen.data.vision_inputs import VisionInputs
from regen.policies.flow import FlowSample
from regen.policies.lm_rollout import LMRollout
from regen.runtime import tensor_tree as tt


def rollout(T: int, seed: int = 0) -> LMRollout:
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(1, 3, 8, 8, generator=g)  # one prompt's image, shared by its group's two rows
    return LMRollout(
        input_ids=torch.randint(0, 50, (2, 4 + T), generator=g), attention_mask=torch.ones(2, 4 + T, dtype=torch.long),
        response_mask=torch.rand(2, T, generator=g), finished=torch.tensor([True, False]), prompt_width=4,
        completions=["a b", "c"], version=torch.tensor([3, 3]), behaviour_logp=torch.randn(2, T, generator=g),
        vision=VisionInputs([{"pixel_values": image}, {"pixel_values": image}]), episodes=[{"turns": 1}, {}],
        rope=torch.randn(2, 3, 4, generator=g).to(torch.bfloat16))


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same_rollout(a: LMRollout, b: LMRollout) -> None:
    for name in ("input_ids", "attention_mask", "response_mask", "finished", "version", "behaviour_logp", "rope"):
        assert same(getattr(a, name), getattr(b, name)), name
    assert (a.prompt_width, a.completions, a.episodes) == (b.prompt_width, b.completions, b.episodes)
    assert same(a.vision.rows[0]["pixel_values"], b.vision.rows[0]["pixel_values"])
    assert b.vision.rows[0]["pixel_values"] is b.vision.rows[1]["pixel_values"]  # shared, as sent


def test_split_and_join_round_trip_a_vlm_rollout_and_a_flow_batch():
    r = rollout(6)
    skeleton, tensors = tt.split(r)
    assert len(tensors) == 8  # the shared image once
    assert r.input_ids is tensors[0] and isinstance(skeleton.input_ids, tt.Slot)  # the original is untouched
    assert_same_rollout(r, tt.join(skeleton, tensors))
    f = FlowSample(torch.randn(4, 3, 2, 2), ["a"] * 4, torch.linspace(1, 0, 4), torch.randn(4, 4, 3, 2, 2),
                   torch.randn(4, 3), torch.tensor([True, False, True]), [torch.randn(4, 3, 2, 2), None, None])
    back = tt.join(*tt.split(f))
    assert same(back.x0, f.x0) and same(back.means[0], f.means[0]) and back.means[1:] == [None, None]
    assert same(back.sde, f.sde) and back.prompts == f.prompts


def test_bytes_pickled_do_not_grow_with_the_tensors():
    small, big = rollout(8), rollout(2048)
    pickled = [len(pickle.dumps((s, tt.layout(t)))) for s, t in (tt.split(small), tt.split(big))]
    whole = [len(pickle.dumps(x)) for x in (small, big)]
    assert whole[1] > 20 * whole[0]  # pickling the batch itself grows with it
    assert abs(pickled[1] - pickled[0]) <= 8, pickled  # the skeleton: a few bytes of shape numbers


def test_packed_bytes_round_trip_every_dtype_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16), torch.tensor([True, False]),
          torch.randint(0, 9, (2, 3), generator=g), torch.randn(1, dtype=torch.float64), torch.empty(0, 4),
          torch.randn(2, 3, generator=g).t(), torch.tensor(2.5, dtype=torch.float16)]  # a transposed view too
    meta = tt.layout(ts)
    buf = tt.pack_bytes(ts, "cpu")
    assert buf.numel() % tt.ALIGN == 0
    back = tt.unpack_bytes(buf, meta, "cpu")
    assert all(same(a.contiguous(), b) for a, b in zip(ts, back))


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as tdist

    from regen.runtime.dist import Dist

    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        d = Dist("ddp", rank, 2)
        got = d.broadcast_batch(rollout(64, seed=5) if rank == 0 else None)
        torch.save({"got": got, "bytes": getattr(d, "batch_bytes", None)}, f"{out}.{rank}")
    finally:
        tdist.destroy_process_group()


def test_two_processes_on_a_gloo_group_receive_rank0s_batch(tmp_path):
    init, out = f"file://{tmp_path / 'store'}", str(tmp_path / "out")
    mp.start_processes(_rank, args=(init, out), nprocs=2, start_method="spawn")
    zero, one = (torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1))
    sent = rollout(64, seed=5)
    assert_same_rollout(sent, one["got"])
    pickled, broadcast = zero["bytes"]
    assert broadcast >= sum(t.numel() * t.element_size() for t in tt.split(sent)[1])  # the tensors went as bytes
    assert pickled < 2000 < broadcast, zero["bytes"]


