"""RL objectives for flow-matching image/video models: Flow-GRPO, Flow-DPPO, DiffusionNFT, AWM (DGPO:
regen/algorithms/flow_preference.py).

Conventions (shared with the samplers): x_sigma = (1 - sigma) * x0 + sigma * eps, sigma = 1 is
noise and sigma = 0 data, velocity v = eps - x0. An SDE rollout gives per-step log-probs (B, S)
(averaged over latent elements), per-step Gaussian means (B, S, *x.shape[1:]) and std (S,) or
(B, S). Samples x are (B, C, H, W) images or (B, F, C, H, W) videos; every per-sample reduction
is a mean over all non-batch dims, so videos need no special case.

Micro-batching: the per-step losses (flow_grpo_loss, flow_dppo_loss) take the whole batch's
`denoms = batch_denominators(mask)` (token-mean over (sample, step)); the per-sample losses
(nft_loss, awm_loss) take `denoms = batch_denominators(valid[:, None])` and divide by its
"seqs" count. Summing the micro-batch losses then gives exactly the whole batch's loss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from regen.algorithms.advantages import grpo_advantages
from regen.algorithms.losses import LOG_RATIO_CLAMP, aggregate, masked_mean, ppo_clip_loss

Metrics = dict[str, torch.Tensor]


def _hi(x: torch.Tensor) -> torch.Tensor:
    # squared errors and log-densities lose too much in half precision (log-probs are kept in fp32)
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _per_sample(t: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """A per-sample scalar, () or (B,) or (B, 1, ...), shaped to broadcast against x (B, ...)."""
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    return t.reshape(t.shape + (1,) * (x.dim() - t.dim()))


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (B,): the mean over all non-batch dims (images and videos alike)."""
    return x.flatten(1).mean(1) if x.dim() > 1 else x


def velocity_drift(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """(B,) mean over elements of (v - sg(v_ref))^2: the velocity-space KL to a reference or anchor
    that nft, awm and dgpo add to their losses (the KL between two flows' Gaussian steps is
    proportional to it; gradient through v only)."""
    return _per_sample_mean((_hi(v) - _hi(v_ref).detach()).pow(2))


def _sample_mean(per_sample: torch.Tensor, valid: torch.Tensor, denoms: dict[str, float] | None) -> torch.Tensor:
    # torch.where, not a product with the mask: a NaN/inf in an excluded sample must not leak
    per_sample = torch.where(valid, per_sample, torch.zeros_like(per_sample))
    n = valid.sum().clamp(min=1) if denoms is None else max(denoms["seqs"], 1.0)
    return per_sample.sum() / n


# ---------------------------------------------------------------- advantages


def flow_group_advantages(
    rewards: torch.Tensor, group_size: int, std_normalize: str = "group", clip: float | None = 5.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """Flow-GRPO's advantage (Liu et al. 2025, GRPO's group advantage, with the public code's options):

        A_i = clip( (R_i - mean_g R) / (std + eps), -clip, +clip )
        std = std_g R (per group, "group"), the std over the whole batch ("batch", the public
              code's global std), or none (1, "none")

    rewards (B,), groups of `group_size` consecutive samples: `grpo_advantages` (reused here)
    excludes missing (NaN) rewards and groups with fewer than two valid rewards; the batch std
    is taken over the valid rewards only. Both stds are unbiased (n-1); the public flow_grpo
    code uses np.std (divides by n) and eps = 1e-4, so its advantages are larger by
    sqrt(n/(n-1)) - a constant factor, not a different direction.
    Returns (adv (B,), valid (B,) bool, metrics); metrics add `adv_clip_frac`, the fraction
    of valid samples whose advantage was clipped.
    """
    centred, valid, metrics = grpo_advantages(rewards, group_size, std_normalize=std_normalize, eps=eps)
    adv = centred.to(torch.float64)
    if clip is not None:
        metrics["adv_clip_frac"] = ((adv.abs() > clip) & valid).sum().float() / valid.sum().clamp(min=1)
        adv = adv.clamp(-clip, clip)
    return adv.to(rewards.dtype), valid, metrics


# ---------------------------------------------------------------- SDE-step objectives


def gaussian_mean_kl(
    mean_a: torch.Tensor, mean_b: torch.Tensor, std: torch.Tensor | float, batch_dims: int = 2,
    min_std: float = 1e-12,
) -> torch.Tensor:
    """KL between two Gaussians with the same isotropic std, averaged over elements:

        KL(N(mu_a, s^2 I) || N(mu_b, s^2 I)) / d = mean_elements( (mu_a - mu_b)^2 ) / (2 s^2)

    (symmetric in a, b). Means are (B, S, *x) per step (batch_dims=2, gives (B, S)) or (B, *x)
    for one step (batch_dims=1, gives (B,)); std is a float or broadcasts against the leading
    dims: (S,), (B, 1) or (B, S) per step, (B,) for one step. s is the full transition std
    a*sqrt(sigma/(1-sigma))*sqrt(-dt) of the SDE step: this is the exact KL. The public
    flow_grpo code divides by (a*sqrt(sigma/(1-sigma)))^2 instead, i.e. its KL is ours times
    |dt| (~0.1 at 10 steps), so its beta values do not transfer: beta_ours = beta_theirs * |dt|.
    std is floored at `min_std` so a deterministic (ODE) step gives a finite value, 0 when the
    means agree.
    """
    sq = (_hi(mean_a) - _hi(mean_b)).pow(2)
    if sq.dim() > batch_dims:
        sq = sq.flatten(batch_dims).mean(-1)
    s = torch.as_tensor(std, dtype=sq.dtype, device=sq.device).clamp(min=min_std)
    return sq / (2.0 * s.pow(2))


def flow_grpo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_range: float = 1e-4,
    kl: torch.Tensor | None = None, kl_coef: float = 0.0, denoms: dict[str, float] | None = None,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Flow-GRPO (Liu et al. 2025, "Training Flow Matching Models via Online RL"): the PPO clipped
    objective over SDE denoising steps,

        rho = exp(logp - old_logp)          (per (sample, step), log-ratio clamped to +-20)
        L   = mean_{valid (i, k)} max(-A_i rho, -A_i clip(rho, 1-eps, 1+eps_high))  +  beta * mean KL_ik

    eps = clip_range, eps_high = clip_high (default: eps, the paper's symmetric clip; DAPO's
    clip-higher is the asymmetric option, as for language models).

    the same clipped loss as token-level GRPO (ppo_clip_loss, reused) with T = steps and a
    token-mean over (sample, step). logp, old_logp (B, S); adv (B,) or (B, S); mask (B, S)
    selects the trained SDE steps of valid samples (False for ODE steps and missing rewards).
    kl (B, S): the per-step KL to the reference, e.g. gaussian_mean_kl(mu_theta, mu_ref, std),
    with its gradient; required when kl_coef > 0. eps is tiny (1e-4 in the paper;
    1e-3 learned twice as fast on the shapes task). Metrics: clip_frac, ratio_mean, approx_kl,
    pg_loss, kl (when given), loss.
    """
    high = clip_range if clip_high is None else clip_high
    loss, metrics = ppo_clip_loss(_hi(logp), _hi(old_logp), adv, mask, clip_range, high, "token-mean", denoms=denoms)
    if kl is not None:
        kl_mean = aggregate(kl, mask, "token-mean", denoms=denoms)
        metrics["kl"] = kl_mean.detach()
        if kl_coef > 0:
            loss = loss + kl_coef * kl_mean
    elif kl_coef > 0:
        raise ValueError("flow_grpo_loss: kl_coef > 0 needs the per-step kl")
    metrics["loss"] = loss.detach()
    return loss, metrics


def flow_dppo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, kl_old: torch.Tensor,
    tau: float = 1e-5, denoms: dict[str, float] | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Flow-DPPO (UniRL, "FlowDPPO: Divergence Proximal Policy Optimization for Flow Matching
    Models", 2026, eqs. 14 and 18): no ratio clip; a per-step trust region on the exact KL.

        rho  = exp(logp - old_logp)                             (log-ratio clamped to +-20)
        drop = KL_ik >= tau  and  (rho > 1 and A > 0  or  rho < 1 and A < 0)
        L    = mean_{valid (i, k)} -A_i * rho_ik * (1 - drop_ik)

    kl_old (B, S) = gaussian_mean_kl(mu_theta, mu_old, std): KL(new || old) between the step
    transitions, mean-reduced over elements (tau = 1e-5 is calibrated for that reduction, as in
    UniRL's code). Only a step that is already far from the old policy *and* moves further in
    its advantage's direction is dropped; a corrective move (rho < 1 with A > 0) always passes.
    The mask is not differentiated (UniRL detaches it). Shapes and `mask` as flow_grpo_loss.
    Checked against UniRL's README and flowdppo.py (mean over all trained steps, no clip); one
    deliberate difference: the log-ratio is clamped to +-20 as in ppo_clip_loss (UniRL does not).
    Metrics: masked_frac (dropped / valid steps), kl_over_tau_frac, ratio_mean, kl_mean,
    approx_kl, pg_loss, loss.
    """
    logp, old_logp = _hi(logp), _hi(old_logp)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)
    adv = adv.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    far = kl_old.detach() >= tau
    pushing = ((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0))
    drop = far & pushing
    per_step = torch.where(drop, torch.zeros_like(ratio), -adv * ratio)
    loss = aggregate(per_step, mask, "token-mean", denoms=denoms)
    with torch.no_grad():
        m = mask.to(logp.dtype)
        metrics = {
            "pg_loss": loss.detach(),
            "masked_frac": masked_mean(drop.to(logp.dtype), m),
            "kl_over_tau_frac": masked_mean(far.to(logp.dtype), m),
            "ratio_mean": masked_mean(ratio, m),
            "kl_mean": masked_mean(kl_old.detach().to(logp.dtype), m),
            "approx_kl": masked_mean(torch.exp(-log_ratio) - 1.0 + log_ratio, m),
            "loss": loss.detach(),
        }
    return loss, metrics


# ---------------------------------------------------------------- DiffusionNFT (forward process, no log-probs)


def nft_optimality(adv: torch.Tensor, C: float = 5.0, valid: torch.Tensor | None = None) -> torch.Tensor:
    """DiffusionNFT's optimality probability (Zheng et al. 2025, DiffusionNFT):

        r = clip(A / C / 2 + 0.5, 0, 1)        (A clipped to +-C maps onto [0, 1])

    adv (B,). Samples with valid False (missing reward) get r = NaN, which nft_loss excludes.
    """
    if C <= 0:
        raise ValueError(f"nft_optimality: C must be > 0, got {C}")
    r = (adv / C / 2.0 + 0.5).clamp(0.0, 1.0)
    return r if valid is None else torch.where(valid, r, torch.full_like(r, float("nan")))


def binary_optimality(labels: torch.Tensor | Sequence[int | bool | None]) -> torch.Tensor:
    """r for binary rewards (DiffusionNFT uses the label directly): good (1/True) -> 1, bad
    (0/False) -> 0, missing (None/NaN) -> NaN, which nft_loss excludes (never 0: a timed-out
    reward is not a bad sample). Returns (B,) float32."""
    if isinstance(labels, torch.Tensor):
        r = labels.to(torch.float32)
    else:
        r = torch.tensor([float("nan") if x is None else float(x) for x in labels], dtype=torch.float32)
    if not (torch.isnan(r) | (r == 0) | (r == 1)).all():
        raise ValueError(f"binary_optimality: labels must be 1, 0 or missing, got {r.tolist()}")
    return r


def nft_loss(
    v_theta: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor | float,
    r: torch.Tensor, beta: float = 1.0, eps: float = 1e-5, scale: float = 1.0,
    denoms: dict[str, float] | None = None, v_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DiffusionNFT loss (Zheng et al. 2025, "Online Diffusion Reinforcement with Forward Process"),
    in the x0 form with the adaptive per-sample weight:

        v+ = beta * v_theta + (1 - beta) * v_old          (implicit positive policy)
        v- = (1 + beta) * v_old - beta * v_theta           (implicit negative policy)
        x0_hat+- = x_t - t * v+-
        L_i = [ r_i ||x0_hat+ - x0||^2 / w+ + (1 - r_i) ||x0_hat- - x0||^2 / w- ] / beta
        w+- = sg( mean |x0_hat+- - x0| ) per sample, floored at eps;   L = scale * mean_i L_i

    ||.||^2 is the mean over elements. v_theta, v_old, x0, x_t: (B, ...) at x_t = (1-t) x0 + t eps,
    v_old from the old (EMA) policy and detached here; t (B,) or a float; r (B,) in [0, 1] from
    nft_optimality / binary_optimality, NaN = excluded. r = 1 pulls v_theta toward the true
    velocity eps - x0; r = 0 pushes the negative policy toward it, i.e. v_theta away.
    The public code multiplies the loss by C (adv_clip_max = 5); the paper does not. We default
    to scale = 1 (the paper): under Adam a constant factor changes almost nothing, but it does
    change the weight of any KL term added beside it and the gradient norm that clipping sees,
    so set scale = C to reproduce the public code's numbers. eps = 1e-5 is the public code's floor.
    v_ref (B, ...), kl_coef k: the public code's optional KL to the reference model, a velocity
    distance (the KL between two flows' Gaussian steps is proportional to it):
        L += k * mean_i mean_elements (v_theta - v_ref)^2      over valid samples, outside `scale`
    weights (B,) >= 0, optional: L_i is multiplied by weights_i (binary labels: each group's good
    and bad sets weighing alike, see binary_advantages); the mean still divides by the valid count.
    Metrics: loss, pos_loss, neg_loss (means over valid samples of the two weighted terms),
    r_mean, old_deviate (mean (v_theta - v_old)^2), valid_frac, and kl when v_ref is given.
    """
    if beta <= 0:
        raise ValueError(f"nft_loss: beta must be > 0, got {beta}")
    v, v_old, x0, x_t = _hi(v_theta), _hi(v_old).detach(), _hi(x0), _hi(x_t)
    t = _per_sample(t, x0)
    v_pos = beta * v + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v

    def weighted_sq_err(v_pm: torch.Tensor) -> torch.Tensor:
        err = x_t - t * v_pm - x0
        w = _per_sample(_per_sample_mean(err.detach().abs()).clamp(min=eps), err)
        # (err / w) * err == err^2 / w, but stays finite when err is huge (err^2 overflows fp32 at 2e19)
        return _per_sample_mean((err / w) * err)

    pos, neg = weighted_sq_err(v_pos), weighted_sq_err(v_neg)
    valid = torch.isfinite(r)
    rs = torch.where(valid, r, torch.zeros_like(r)).to(pos.dtype)  # NaN * 0 would poison the gradient
    per_sample = (rs * pos + (1.0 - rs) * neg) / beta
    if weights is not None:
        per_sample = per_sample * _hi(weights).detach()
    loss = scale * _sample_mean(per_sample, valid, denoms)
    with torch.no_grad():
        vf = valid.to(pos.dtype)
        n = vf.sum().clamp(min=1)
        metrics = {
            "loss": loss.detach(),
            "pos_loss": torch.where(valid, pos, 0.0).sum() / n,
            "neg_loss": torch.where(valid, neg, 0.0).sum() / n,
            "r_mean": (rs * vf).sum() / n,
            "old_deviate": (v - v_old).pow(2).mean(),
            "valid_frac": vf.mean(),
        }
    if v_ref is not None and kl_coef > 0:
        drift = velocity_drift(v, v_ref)
        loss = loss + kl_coef * _sample_mean(drift, valid, denoms)
        metrics["loss"] = loss.detach()
        metrics["kl"] = masked_mean(drift.detach(), valid.to(drift.dtype))
    return loss, metrics


def nft_ema_decay(step: int, rate: float = 0.001, max_decay: float = 0.5) -> float:
    """DiffusionNFT's old-policy decay schedule (public code, decay_type 1): min(rate * step, max_decay).
    It starts at 0 (the old policy is a copy of the current one) and rises to 0.5 after 500 steps."""
    return min(rate * step, max_decay)


def ema_update_(old_params: Iterable[torch.Tensor], params: Iterable[torch.Tensor], decay: float) -> None:
    """In place, without gradient: old = decay * old + (1 - decay) * new.

    `decay` is the weight of the *old* copy, as in the DiffusionNFT code (and torch's usual EMA):
    decay = 0 copies the current weights, decay = 1 freezes the old copy. Pass
    `module.parameters()` of the old and the current model in the same order."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"ema_update_: decay must be in [0, 1], got {decay}")
    old_list, new_list = list(old_params), list(params)
    if len(old_list) != len(new_list):
        raise ValueError(f"ema_update_: {len(old_list)} old tensors but {len(new_list)} current ones")
    with torch.no_grad():
        for old, new in zip(old_list, new_list):
            old.lerp_(new.to(old.dtype), 1.0 - decay)  # old + (1 - decay) * (new - old)


# ---------------------------------------------------------------- AWM


def awm_loss(
    v_theta: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor | float, adv: torch.Tensor,
    weight: str | torch.Tensor | None = None, old_loss: torch.Tensor | None = None, clip_range: float | None = None,
    valid: torch.Tensor | None = None, denoms: dict[str, float] | None = None,
    v_anchor: torch.Tensor | None = None, anchor_coef: float = 0.0,
) -> tuple[torch.Tensor, Metrics]:
    """Advantage Weighted Matching (Xue et al. 2025, "Aligning RL with Pretraining in Diffusion
    Models"): the pretraining flow-matching loss on the policy's own samples, weighted by A.

        l_i = w(t_i) * mean_elements( (v_theta(x_t, t) - (eps - x0))^2 )     (-l_i stands in for log pi)
        plain:  L = mean_i  A_i * l_i          (A > 0 lowers l, i.e. raises the sample's likelihood)
        PPO:    rho_i = exp(old_loss_i - l_i)  (= exp(log pi - log pi_old), clamped to +-20)
                L = mean_i max(-A_i rho_i, -A_i clip(rho_i, 1 - c, 1 + c))

    At rho = 1 both forms have the same gradient, A * dl (the values differ by a constant).
    v_theta, x0, eps (B, ...), t (B,) or float, adv (B,). weight: None / "uniform" -> w = 1
    (our default: the plain rectified-flow loss our models are pretrained with), "t" -> t,
    "t**2" -> t^2, or a (B,) tensor. The public AWM configs use "ghuber" (a robust, nonlinear
    function of the error, times t), which a per-sample weight cannot express: compute it
    outside if wanted. old_loss (B,): l under the old policy with the same eps and t (detached);
    clip_range c None with old_loss gives the unclipped ratio (the public configs use c = 1,
    Flow-Factory recommends 1e-5). valid (B,) excludes samples (default: finite advantages).
    v_anchor (B, ...), anchor_coef beta: adds beta * mean_i mean_elements (v_theta - v_anchor)^2,
    a velocity-space KL to a slowly moving EMA of the policy (for two Gaussian steps with the same
    std the KL is proportional to the squared mean difference). Unconstrained advantage weighting
    diverges quickly; Flow-Factory's AWM guidance recommends this EMA-KL (beta 0.1) and/or the
    PPO clip, and our shapes runs without it did not improve.
    Metrics: loss, fm_loss (mean l), anchor_kl when anchored, and in PPO form clip_frac, ratio_mean.
    """
    v, x0, eps = _hi(v_theta), _hi(x0), _hi(eps)
    t = torch.as_tensor(t, dtype=v.dtype, device=v.device).reshape(-1).expand(v.shape[0])
    if weight is None or weight == "uniform":
        w = torch.ones_like(t)
    elif weight == "t":
        w = t
    elif weight == "t**2":
        w = t.pow(2)
    elif isinstance(weight, torch.Tensor):
        w = weight.to(v.dtype)
    else:
        raise ValueError(f"awm_loss: unknown weight '{weight}' (known: uniform, t, t**2, or a tensor)")
    fm = w * _per_sample_mean((v - (eps - x0)).pow(2))
    valid = torch.isfinite(adv) if valid is None else valid & torch.isfinite(adv)
    a = torch.where(valid, adv, torch.zeros_like(adv)).to(fm.dtype)
    metrics: Metrics = {}
    if old_loss is None:
        loss = _sample_mean(a * fm, valid, denoms)
    else:
        c = float("inf") if clip_range is None else clip_range
        d = {"tokens": denoms["seqs"], "seqs": denoms["seqs"]} if denoms is not None else None
        loss, m = ppo_clip_loss(-fm.unsqueeze(1), -old_loss.detach().to(fm.dtype).unsqueeze(1), a, valid.unsqueeze(1),
                                c, c, "token-mean", denoms=d)
        metrics.update(clip_frac=m["clip_frac"], ratio_mean=m["ratio_mean"])
    if v_anchor is not None and anchor_coef > 0:
        drift = velocity_drift(v, v_anchor)
        loss = loss + anchor_coef * _sample_mean(drift, valid, denoms)
        metrics["anchor_kl"] = masked_mean(drift.detach(), valid.to(fm.dtype))
    with torch.no_grad():
        metrics["fm_loss"] = masked_mean(fm, valid.to(fm.dtype))
        metrics["loss"] = loss.detach()
    return loss, metrics
