"""Stage 4 of the loop, for every modality: `train.ppo_epochs` passes over the batch in
minibatches, one optimizer step per minibatch, each accumulated over micro-batches.

The loss of a micro-batch (the modality's `micro_loss`) is computed with the whole minibatch's
denominators, so the micro-batch losses add up to exactly the minibatch's loss: memory is
bounded by `train.micro_batch_size` while the step is the same. Under torchrun each rank takes
its share of every minibatch with the same denominators and the gradient engine (DDP / FSDP2)
sums the shares (see regen/runtime/dist.py). A non-finite loss or gradient skips the step on
every rank (counted in `nonfinite_skipped`; the health monitor rolls back after a streak).
"""

from __future__ import annotations

import torch

from regen.modalities.base import Advantages, Modality
from regen.runtime.dist import Dist
from regen.runtime.precision import Precision

# Metrics that micro_loss already scales to the whole minibatch (they add up over micro-batches
# and ranks); every other metric is a mean over its micro-batch, weighted by its share of rows.
SUMMED = ("loss", "pg_loss", "kl", "entropy")


def shuffle_groups(B: int, unit: int, gen: torch.Generator) -> torch.Tensor:
    """A random order of the B rows that keeps each run of `unit` consecutive rows together."""
    groups = torch.randperm(B // unit, generator=gen, device=gen.device).cpu()
    return (groups[:, None] * unit + torch.arange(unit)).flatten()


def update(m: Modality, opt, batch, adv: Advantages, fixed: dict, cfg, gen: torch.Generator, step: int,
           prec: Precision | None = None, d: Dist | None = None) -> dict[str, float]:
    """The optimizer steps of one RL step; returns the metrics averaged over the steps taken.
    m.aux_step steps a second model on the same minibatches (PPO's critic); m.trains_policy(step)
    False (critic warm-up) updates only that one."""
    t = cfg.train
    prec, d = prec or Precision("fp32", torch.device("cpu")), d or Dist()
    B, mb = len(adv.valid), t.global_minibatch_size
    micro = t.micro_batch_size or mb
    single_pass = t.ppo_epochs == 1 and mb == B
    train_policy = m.trains_policy(step)
    # the optimizer's own list: FSDP2 swaps a module's parameters for unsharded ones around forwards
    params = [p for g in opt.param_groups for p in g["params"]]
    sums: dict[str, float] = {}
    n_steps = skipped = 0
    for _ in range(t.ppo_epochs):
        order = torch.arange(B) if single_pass else shuffle_groups(B, m.unit, gen)  # the same on every rank
        for idx in order.split(mb):
            for k, v in m.aux_step(batch, idx, adv).items():
                sums[k] = sums.get(k, 0.0) + v
            if not train_policy:
                continue
            mini = m.minibatch(batch, idx, adv, fixed, gen)
            opt.zero_grad(set_to_none=True)
            step_m: dict[str, float] = {}
            finite = True
            for pos in d.my_rows(torch.arange(len(idx)), m.share).split(micro):  # positions in the minibatch
                with prec.autocast():
                    loss, lm = m.micro_loss(mini, pos)
                if not d.all_true(bool(torch.isfinite(loss))):
                    finite = False  # a non-finite loss would poison the weights: skip this step (every rank)
                    break
                prec.backward(loss * d.loss_scale)
                share = len(pos) / len(idx)
                for k, v in lm.items():
                    step_m[k] = step_m.get(k, 0.0) + (1.0 if k in SUMMED else share) * float(v)
            if not finite:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            step_m = d.sum_floats(step_m)  # each rank's share of the minibatch's metrics
            before = m.before_step(mini, params)  # what bounding the step needs (a trust region: the weights)
            grad_norm, stepped = prec.step(opt, params, t.grad_clip)
            if not stepped:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            step_m["grad_norm"] = float(grad_norm)
            if before is not None:
                with prec.autocast():  # the velocities compared were computed under it
                    step_m.update(m.after_step(mini, params, before))  # the same on every rank
            for k, v in step_m.items():
                sums[k] = sums.get(k, 0.0) + v
            n_steps += 1
    n_mb = t.ppo_epochs * (B // mb)  # steps of the second model (it is not held in warm-up)
    out = {k: v / (n_mb if k.startswith("critic/") else max(n_steps, 1)) for k, v in sums.items()}
    out["nonfinite_skipped"] = float(skipped)
    out.update(m.update_metrics(adv))
    return out
