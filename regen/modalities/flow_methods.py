"""Each flow method's own part of the flow modality (regen/modalities/flow.py), one class per
method, declared in regen/config/flow_methods.py (its keys, defaults and the frozen copies it
keeps). FlowModality runs the five stages; a method says what it trains on and its loss:

  StochasticMethod  trained on re-scored SDE transitions (flow_grpo, flow_dppo): per-step
                    log-probs and Gaussian means of the sampled steps
  ODEMethod         trained on clean ODE samples pushed back through the forward process at a
                    random t (nft, awm; dgpo in flow_dgpo.py): velocities, no likelihood

The math is in regen/algorithms/flow.py and flow_preference.py."""

from __future__ import annotations

import torch

from regen.algorithms.flow import awm_loss, flow_dppo_loss, flow_grpo_loss, gaussian_mean_kl, nft_loss, nft_optimality
from regen.algorithms.trust_region import scale_step_, trust_region_scale, velocity_change


class FlowMethod:
    """The hooks a flow method fills in; `m` is the FlowModality it belongs to. Whether it trains on re-scored SDE
    steps is its declaration's `stochastic` (the modality then keeps their log-probs)."""

    def __init__(self, m) -> None:
        self.m = m

    @property
    def unit(self) -> int:
        return 1  # rows kept together in a minibatch

    def from_labels(self, rewards, adv, valid) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(advantages, per-row weights or None) from labels (algorithm.reward_type binary /
        pairwise): the labels' advantages as they are by default."""
        return adv, None

    def noise(self, n: int, batch, gen: torch.Generator) -> tuple | None:
        """The forward-process point (t, eps) of each of a minibatch's n rows, drawn for the whole
        minibatch so that micro-batching and the rank split never change it; None: no such point."""
        return None

    def prepare(self, mini) -> None:
        """Anything the minibatch needs before its micro-batches (dgpo: its groups' weights)."""

    def loss(self, mini, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError


class StochasticMethod(FlowMethod):
    """Declared with stochastic=True: trained on the rollouts' re-scored SDE transitions."""

    def loss(self, mini, pos):
        m = self.m
        f = m.cfg.flow
        rows = mini.idx[pos]
        sub, fixed = mini.batch.select(rows), mini.fixed
        logp, means, stds = m.policy.step_logprobs(sub, f.noise_level, f.sampler, f.guidance)
        # first pass over a batch: the behaviour policy is the current one (ratio 1, KL 0)
        old = logp.detach() if "logp" not in fixed else fixed["logp"][rows]
        return self.step_loss(mini, rows, logp, old, means, stds, mini.adv.adv[rows], mini.adv.mask[rows])

    def step_loss(self, mini, rows, logp, old, means, stds, adv, mask) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError


class FlowGRPO(StochasticMethod):
    """Flow-GRPO (Liu et al. 2025): the clipped ratio over SDE steps, the exact Gaussian KL to the base."""

    def step_loss(self, mini, rows, logp, old, means, stds, adv, mask):
        m, a = self.m, self.m.cfg.algorithm
        kl = step_kl(means, _rows(mini.fixed["ref_means"], rows), stds, len(rows)) if m.ref is not None else None
        return flow_grpo_loss(logp, old, adv, mask, a.clip_low, kl, a.kl_coef, mini.denoms, clip_high=a.clip_high)


class FlowDPPO(StochasticMethod):
    """Flow-DPPO: a trust region on the exact KL between the sampling and the current step Gaussians."""

    def step_loss(self, mini, rows, logp, old, means, stds, adv, mask):
        now = [None if x is None else x.detach() for x in means]
        old_means = _rows(mini.fixed["means"], rows) if "means" in mini.fixed else now
        return flow_dppo_loss(logp, old, adv, mask, step_kl(now, old_means, stds, len(rows)),
                              self.m.cfg.flow.dppo_tau, mini.denoms)


class ODEMethod(FlowMethod):
    def noise(self, n, batch, gen):
        return torch.rand(n, generator=gen), torch.randn((n, *batch.x0.shape[1:]), generator=gen)

    def points(self, mini, pos) -> tuple:
        """(rows, x0, x_t, eps, t, cond) of the minibatch rows at `pos`: their forward-process points."""
        m = self.m
        rows = mini.idx[pos]
        sub = mini.batch.select(rows)
        x0 = sub.x0
        t, eps = (z[pos].to(m.device) for z in mini.noise)
        tt = t.view(len(rows), *[1] * (x0.dim() - 1))
        return rows, x0, (1 - tt) * x0 + tt * eps, eps, t, m.policy.encoder(sub.prompts)

    def loss(self, mini, pos):
        rows, x0, xt, eps, t, cond = self.points(mini, pos)
        v = self.m.policy.velocity(xt, t, cond)
        if mini.seen is not None:  # flow.trust_region: the velocities this step starts from
            mini.seen.append((pos, v.detach()))
        return self.point_loss(mini, pos, rows, x0, xt, eps, t, cond, v)

    @torch.no_grad()
    def bound_step(self, mini, params, before) -> dict[str, float]:
        """flow.trust_region: the velocity change this step made on its own points (regen/algorithms/
        trust_region.py), and the step scaled back toward `before` where it is over the bound."""
        m = self.m
        total = count = 0.0
        for pos, v_before in mini.seen:
            rows, _, xt, _, t, cond = self.points(mini, pos)
            s, n = velocity_change(m.policy.velocity(xt, t, cond), v_before, mini.adv.valid[rows])
            total, count = total + s, count + n
        sums = m.dist.sum_floats({"change": total, "rows": count})  # every rank's rows: one D, one alpha
        drift = sums["change"] / max(sums["rows"], 1.0)
        alpha = trust_region_scale(drift, m.cfg.flow.trust_region)
        if alpha < 1.0:
            scale_step_(params, before, alpha)
        return {"trust/change": drift, "trust/scale": alpha, "trust/clipped": float(alpha < 1.0)}

    def point_loss(self, mini, pos, rows, x0, xt, eps, t, cond, v) -> tuple[torch.Tensor, dict]:
        """The loss at the rows' forward-process points; v = the policy's velocity there (with gradient)."""
        raise NotImplementedError


class NFT(ODEMethod):
    """DiffusionNFT (Zheng et al. 2025): implicit positive / negative policies around the EMA old policy."""

    def from_labels(self, rewards, adv, valid):
        # r = the label / the win rate: nft_optimality(C * (2r - 1), C) == r
        c = self.m.cfg
        # binary labels: each group's good and bad sets weigh alike (|A| = n / 2|G+-| of binary_advantages, 0 in a
        # group whose labels agree). Unweighted, a group of good samples is r = 1 on every one and the model refits
        # its own samples, which collapsed held-out adherence to 0.365 with 90 % good labels (bench/README, reward forms)
        weights = adv.abs() if c.algorithm.reward_type == "binary" else None
        return c.flow.adv_clip * (2.0 * torch.where(valid, rewards, 0.5) - 1.0), weights

    def point_loss(self, mini, pos, rows, x0, xt, eps, t, cond, v):
        m = self.m
        a, f = m.cfg.algorithm, m.cfg.flow
        with torch.no_grad():
            v_old = m.policy.velocity(xt, t, cond, unet=m.ema)
            v_ref = None if m.ref is None else m.policy.velocity(xt, t, cond, unet=m.ref)
        r = nft_optimality(mini.adv.adv[rows], f.adv_clip, mini.adv.valid[rows])
        weights = None if mini.adv.weights is None else mini.adv.weights[rows]  # binary labels: balanced sets
        return nft_loss(v, v_old, x0, xt, t, r, f.nft_beta, denoms=mini.denoms, v_ref=v_ref, kl_coef=a.kl_coef,
                        weights=weights)


class AWM(ODEMethod):
    """Advantage-weighted flow matching, optionally anchored to an EMA of the policy (kl_coef > 0)."""

    def point_loss(self, mini, pos, rows, x0, xt, eps, t, cond, v):
        m = self.m
        a, f = m.cfg.algorithm, m.cfg.flow
        anchor = None
        if m.ema is not None:  # the EMA anchor's velocity at the same point
            with torch.no_grad():
                anchor = m.policy.velocity(xt, t, cond, unet=m.ema)
        return awm_loss(v, x0, eps, t, mini.adv.adv[rows], weight=None if f.awm_weight == "uniform" else f.awm_weight,
                        valid=mini.adv.valid[rows], denoms=mini.denoms, v_anchor=anchor, anchor_coef=a.kl_coef)


def step_kl(means: list, other: list, stds: list[float], B: int) -> torch.Tensor:
    """(B, S) exact KL between the Gaussians of each SDE step (0 on ODE steps); `means` and
    `other` hold (B, *x) per SDE step and None on ODE steps."""
    kl = torch.zeros(B, len(means), device=next(x for x in means if x is not None).device)
    for i, (x, o) in enumerate(zip(means, other)):
        if x is not None:
            kl[:, i] = gaussian_mean_kl(x, o.to(x.device), stds[i], batch_dims=1)
    return kl


def _rows(means: list, rows) -> list:
    return [None if x is None else x[rows.to(x.device)] for x in means]
