"""DGPO's update in the flow modality (the math: regen/algorithms/flow_preference.py).

Each minibatch holds whole groups (DGPO.unit = group size) and its members share one point of
the forward process (DGPO.noise), so l_theta - l_ref compares like with like
inside a group. A group's weight needs every member's loss: when one micro-batch holds the whole
minibatch it comes from that forward pass; when micro-batches or torchrun ranks split the groups
the weights are computed first, without gradient, over the whole minibatch (dgpo_weights), so
the update does not depend on the split.
"""

from __future__ import annotations

import torch

from regen.algorithms.flow_preference import dgpo_group_weights, dgpo_loss
from regen.modalities.flow_methods import ODEMethod


class DGPO(ODEMethod):
    """DGPO (Luo et al. 2025): group preferences learned from ODE samples."""

    @property
    def unit(self) -> int:
        return self.m.cfg.rollout.group_size  # minibatches of whole groups: the weight is the group's

    def noise(self, n, batch, gen):
        G = self.unit  # one t and noise per group: its members compare at one point
        t = torch.rand(n // G, generator=gen).repeat_interleave(G)
        return t, torch.randn((n // G, *batch.x0.shape[1:]), generator=gen).repeat_interleave(G, 0)

    def prepare(self, mini) -> None:
        m = self.m
        micro = m.cfg.train.micro_batch_size
        if m.dist.on or (micro or len(mini.idx)) < len(mini.idx):
            mini.weights = dgpo_weights(m, mini)  # micro-batches or ranks split the groups: weigh them first

    def point_loss(self, mini, pos, rows, x0, xt, eps, t, cond, v):
        return dgpo_micro_loss(self.m, mini, pos, v, x0, xt, eps, t, cond)


def fm_loss(v, x0, eps) -> torch.Tensor:
    """(B,): each sample's flow-matching loss, mean over elements of (v - (eps - x0))^2."""
    return (v.float() - (eps - x0).float()).pow(2).flatten(1).mean(1)


def flow_matching_loss(m, x0, xt, eps, t, cond, unet) -> tuple[torch.Tensor, torch.Tensor]:
    """(l (B,), v): each sample's flow-matching loss at (x_t, t) under `unet` (None = the policy)."""
    v = m.policy.velocity(xt, t, cond, unet=unet)
    return fm_loss(v, x0, eps), v


def dgpo_micro_loss(m, mini, pos, v, x0, xt, eps, t, cond) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of the minibatch rows at `pos`, v = the policy's velocity there (with gradient)."""
    a, f = m.cfg.algorithm, m.cfg.flow
    rows = mini.idx[pos]
    adv, valid = mini.adv.adv[rows], mini.adv.valid[rows]
    fm = fm_loss(v, x0, eps)
    inline = mini.weights is None  # the weights come from this forward: the reference's loss is needed here
    with torch.no_grad():  # only the forwards something reads: the old policy for the clip, the base for the KL
        need_old = a.clip_low is not None or (inline and f.dgpo_ref == "ema")
        need_ref = a.kl_coef > 0 or (inline and f.dgpo_ref == "base")
        old = flow_matching_loss(m, x0, xt, eps, t, cond, m.ema)[0] if need_old else None
        ref_fm, v_ref = flow_matching_loss(m, x0, xt, eps, t, cond, m.ref) if need_ref else (None, None)
    if not inline:
        w = mini.weights[pos]
    else:  # the micro-batch is the whole minibatch: its groups are whole
        w = dgpo_group_weights(fm, old if f.dgpo_ref == "ema" else ref_fm, adv, m.unit, f.dgpo_beta, valid)
    return dgpo_loss(fm, adv, w, valid, old, a.clip_low, mini.denoms, v, v_ref if a.kl_coef > 0 else None, a.kl_coef,
                     clip_high=a.clip_high)


@torch.no_grad()
def dgpo_weights(m, mini) -> torch.Tensor:
    """Every row's group weight from the whole minibatch, before micro-batches or ranks split its
    groups (one more forward of the policy, without gradient)."""
    c, d = m.cfg, m.dist
    ref = m.ema if c.flow.dgpo_ref == "ema" else m.ref
    mine = d.my_rows(torch.arange(len(mini.idx)), m.unit)
    fms, refs = [], []
    for pos in mine.split(c.train.micro_batch_size or len(mine)):
        _, x0, xt, eps, t, cond = m.method.points(mini, pos)
        fms.append(flow_matching_loss(m, x0, xt, eps, t, cond, None)[0])
        refs.append(flow_matching_loss(m, x0, xt, eps, t, cond, ref)[0])
    fm, ref_fm = d.gather_rows(torch.cat(fms)), d.gather_rows(torch.cat(refs))
    adv, valid = mini.adv.adv[mini.idx], mini.adv.valid[mini.idx]
    return dgpo_group_weights(fm, ref_fm, adv, m.unit, c.flow.dgpo_beta, valid)
