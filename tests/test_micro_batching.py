"""Gradient accumulation is exact: 8 micro-batches of 1 give the loss and gradients of one batch of 8."""

import pytest
import torch

from regen.algorithms.losses import aggregate, batch_denominators, grpo_loss, gspo_loss
from regen.cli import main
from tests.conftest import read_jsonl

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _batch():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(8, 5, generator=g) * 3
    old = logp + 0.3 * torch.randn(8, 5, generator=g)  # off-policy, so clipping is active somewhere
    ref = logp + 0.2 * torch.randn(8, 5, generator=g)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])[:, None]).float()  # ragged, one empty
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -2.0, 0.0, 1.5, -0.5])
    ent = torch.rand(8, 5, generator=g)
    return logp, old, ref, mask, adv, ent


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fn", [grpo_loss, gspo_loss])
def test_eight_micro_batches_of_one_equal_one_batch_of_eight(mode, fn):
    logp, old, ref, mask, adv, ent = _batch()
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, agg=mode, norm=5.0)
    if fn is grpo_loss:
        kw.update(dual_clip=3.0, entropy_coef=0.01)
    whole_logp, whole_ent = logp.clone().requires_grad_(), ent.clone().requires_grad_()
    whole, _ = fn(whole_logp, old, adv, mask, ref_logp=ref, entropy=whole_ent, **kw)
    whole.backward()
    denoms = batch_denominators(mask)
    acc_logp, acc_ent = logp.clone().requires_grad_(), ent.clone().requires_grad_()
    total = 0.0
    for i in range(8):
        part, _ = fn(acc_logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], ref_logp=ref[i:i + 1],
                     entropy=acc_ent[i:i + 1], denoms=denoms, **kw)
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), abs=1e-6)
    torch.testing.assert_close(acc_logp.grad, whole_logp.grad, atol=1e-6, rtol=1e-5)
    if fn is grpo_loss:
        torch.testing.assert_close(acc_ent.grad, whole_ent.grad, atol=1e-6, rtol=1e-5)


def test_denominators_count_tokens_and_nonempty_sequences():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert batch_denominators(mask) == {"tokens": 3.0, "seqs": 2.0}
    x = torch.tensor([[1.0, 2.0, 9.0], [9.0, 9.0, 9.0], [4.0, 9.0, 9.0]])
    # token-mean over the batch: (1+2+4)/3; row 2 alone with the batch's denominator: 4/3
    assert float(aggregate(x[2:], mask[2:], "token-mean", denoms=batch_denominators(mask))) == pytest.approx(4 / 3)


def test_micro_batched_training_matches_whole_minibatch(base_model, tmp_path):
    common = ["train", f"model.path={base_model}", "log.progress=none", "data.eval=null", "log.tensorboard=false",
              "rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.steps=2",
              "optim.lr=1e-3"]
    assert main([*common, f"run.dir={tmp_path / 'a'}"]) == 0
    assert main([*common, f"run.dir={tmp_path / 'b'}", "train.micro_batch_size=4"]) == 0
    a, b = read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-5)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4)
        assert rb["reward/mean"] == ra["reward/mean"]
