"""What a Ray weight sync sends (regen/placement/sync.py): each tensor once, cast to the sync
dtype, in buckets of bounded size, and what an actor's model holds after loading them."""

import torch

from regen.placement.sync import nbytes, pack


class Tied(torch.nn.Module):
    """An embedding tied to the output layer (as GPT-2's), a linear layer and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)  # 40 floats
        self.mid = torch.nn.Linear(4, 4)  # 16 + 4 floats
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # tied: one storage, two names
        self.register_buffer("steps", torch.tensor([7, 8, 9], dtype=torch.int64))  # 3 x 8 bytes


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
