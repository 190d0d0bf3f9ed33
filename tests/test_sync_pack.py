"""What a Ray weight sync sends (regen/placement/sync.py): each tensor once, cast to the sync
dtype, only the changed ones, in buckets of bounded size, and what an actor's model holds after
loading them (an actor that took every sync, and a new one that loads the chain)."""

import torch

from regen.placement.sync import Chain, Packer, nbytes


class Tied(torch.nn.Module):
    """An embedding tied to the output layer (as GPT-2's), a linear layer and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)  # 40 floats
        self.mid = torch.nn.Linear(4, 4)  # 16 + 4 floats
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # tied: one storage, two names
        self.register_buffer("steps", torch.tensor([7, 8, 9], dtype=torch.int64))  # 3 x 8 bytes


def pack(state, dtype, bucket_bytes):
    """One full sync (every tensor)."""
    return Packer(dtype, bucket_bytes, changed_only=False).pack(state)


def fresh(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def test_a_tied_tensor_is_sent_once_and_the_actor_ends_with_the_trainers_weights():
    trainer, actor = fresh(0), fresh(1)
    buckets = pack(trainer.state_dict(), torch.float32, 1 << 30)
    sent = [k for b in buckets for k in b]
    assert sent == ["steps", "emb.weight", "mid.weight", "mid.bias"]  # state_dict order; out.weight shares emb.weight
    assert nbytes(buckets) == (40 + 16 + 4) * 4 + 3 * 8
    for b in buckets:
        actor.load_state_dict(b, strict=False)
    for k, v in trainer.state_dict().items():
        assert torch.equal(actor.state_dict()[k], v), k
    assert actor.out.weight.data_ptr() == actor.emb.weight.data_ptr()  # still tied after loading


def test_bf16_sync_halves_the_float_bytes_and_the_actor_holds_the_weights_rounded_to_bf16():
    trainer, actor = fresh(0), fresh(1)
    buckets = pack(trainer.state_dict(), torch.bfloat16, 1 << 30)
    assert nbytes(buckets) == (40 + 16 + 4) * 2 + 3 * 8  # the int64 buffer is not cast
    assert buckets[0]["steps"].dtype == torch.int64
    for b in buckets:
        actor.load_state_dict(b, strict=False)
    w = trainer.mid.weight.detach()
    assert actor.mid.weight.dtype == torch.float32  # the actor's model keeps its dtype...
    assert torch.equal(actor.mid.weight, w.to(torch.bfloat16).float())  # ...with bf16-rounded values
    assert not torch.equal(actor.mid.weight, w)  # (rounding really changed them: the check can fail)


def test_buckets_hold_at_most_the_limit_and_a_larger_tensor_goes_alone():
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(5),
             "d": torch.zeros(5)}
    buckets = pack(state, torch.float32, 80)  # 80 bytes: two 10-float tensors
    assert [list(b) for b in buckets] == [["a", "b"], ["big"], ["c", "d"]]
    assert [nbytes([b]) for b in buckets] == [80, 400, 40]
    assert pack({}, torch.float32, 80) == []


def load(model: Tied, buckets) -> None:
    for b in buckets:
        model.load_state_dict(b, strict=False)


def assert_same(actor: Tied, trainer: Tied, dtype=torch.float32) -> None:
    for k, v in trainer.state_dict().items():
        want = v.to(dtype).to(v.dtype) if v.is_floating_point() else v
        assert torch.equal(actor.state_dict()[k], want), k


def test_only_changed_tensors_are_sent_and_every_actor_ends_with_the_trainers_weights():
    trainer, steady = fresh(0), fresh(1)
    packer, chain = Packer(torch.float32, 1 << 30, changed_only=True), Chain()
    first = packer.pack(trainer.state_dict())
    assert [k for b in first for k in b] == ["steps", "emb.weight", "mid.weight", "mid.bias"]  # all, the first time
    load(steady, first)
    chain.add(["v0"], first)
    with torch.no_grad():  # in place, on the CPU: pack gets the very tensors it sent last time
        trainer.mid.bias.add_(0.5)
    second = packer.pack(trainer.state_dict())
    assert [list(b) for b in second] == [["mid.bias"]] and packer.skipped == 3
    assert nbytes(second) == 4 * 4
    load(steady, second)
    assert chain.add(["v1"], second) == ["v0", "v1"]  # v0 still holds the current emb, mid.weight, steps
    with torch.no_grad():
        trainer.emb.weight.mul_(2)  # and out.weight with it (tied)
        trainer.mid.weight.add_(1)
        trainer.steps.add_(1)
    third = packer.pack(trainer.state_dict())
    assert [k for b in third for k in b] == ["steps", "emb.weight", "mid.weight"]
    load(steady, third)
    assert chain.add(["v2"], third) == ["v1", "v2"]  # v0's tensors were all sent again: dropped
    assert_same(steady, trainer)  # the actor that took each sync
    new = fresh(2)  # a replaced actor: its own initial weights, then the chain in order
    load(new, [{"v0": first, "v1": second, "v2": third}[h][0] for h in chain.add([], [])])
    assert_same(new, trainer)
    assert packer.pack(trainer.state_dict()) == [] and packer.skipped == 4  # nothing moved: nothing sent


def test_in_bf16_a_change_below_its_resolution_is_not_sent_and_a_larger_one_is():
    trainer, actor = fresh(0), fresh(1)
    packer = Packer(torch.bfloat16, 1 << 30, changed_only=True)
    load(actor, packer.pack(trainer.state_dict()))
    with torch.no_grad():
        trainer.mid.weight.copy_(trainer.mid.weight.to(torch.bfloat16).float())  # exactly representable...
        trainer.mid.weight.mul_(1 + 2**-12)  # ...then moved by less than half of bf16's 2^-8 relative step
        trainer.mid.bias.add_(0.25)
    buckets = packer.pack(trainer.state_dict())
    assert [list(b) for b in buckets] == [["mid.bias"]]
    load(actor, buckets)
    assert_same(actor, trainer, torch.bfloat16)  # what a full bf16 sync would have given it


def test_a_full_sync_sends_every_tensor_every_time():
    trainer = fresh(0)
    packer = Packer(torch.float32, 1 << 30, changed_only=False)
    assert nbytes(packer.pack(trainer.state_dict())) == nbytes(packer.pack(trainer.state_dict())) == 60 * 4 + 24
    assert packer.skipped == 0
