"""Policy losses over (B, T) log-probs. T is tokens for an LM, denoising steps for a flow SDE."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regen.algorithms.kl import kl_penalty

LOG_RATIO_CLAMP = 20.0  # exp(±20) is finite in fp32; a larger log-ratio means a broken batch anyway


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(
    x: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm: float | None = None,
    denoms: dict[str, float] | None = None,
) -> torch.Tensor:
    """Reduce per-token values x (B, T) over valid positions `mask` (B, T) to a scalar.

    token-mean               sum over all valid tokens / their count in the batch (DAPO)
    seq-mean-token-mean      mean over each sequence's tokens, then over sequences (GRPO paper)
    seq-mean-token-sum       sum over each sequence's tokens, mean over sequences
    seq-mean-token-sum-norm  sum over each sequence's tokens / `norm` (e.g. max length),
                             mean over sequences (Dr.GRPO, Liu 2025)
    Sequences without any valid token are left out of sequence means.

    denoms: the whole batch's counts {"tokens", "seqs"} (see `batch_denominators`) when x is
    one micro-batch of it: summing the micro-batch results then gives exactly the whole
    batch's value, whatever the mode.
    """
    mask = mask.to(x.dtype)
    if mode == "token-mean":
        return masked_mean(x, mask) if denoms is None else (x * mask).sum() / max(denoms["tokens"], 1.0)
    per_seq_sum = (x * mask).sum(-1)
    lengths = mask.sum(-1)
    has = lengths > 0
    if mode == "seq-mean-token-mean":
        per_seq = per_seq_sum / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = per_seq_sum
    elif mode == "seq-mean-token-sum-norm":
        if norm is None or norm <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive `norm` (e.g. the max response length)")
        per_seq = per_seq_sum / norm
    else:
        raise ValueError(f"unknown loss aggregation '{mode}'")
    return (per_seq * has).sum() / (has.sum().clamp(min=1) if denoms is None else max(denoms["seqs"], 1.0))


def batch_denominators(mask: torch.Tensor) -> dict[str, float]:
    """The counts `aggregate` divides by for a whole batch: valid tokens, and sequences with at
    least one valid token."""
    return {"tokens": float(mask.sum()), "seqs": float((mask.sum(-1) > 0).sum())}


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    norm: float | None = None,
    dual_clip: float | None = None,
    denoms: dict[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric clip (DAPO, Yu 2025):

        rho = exp(logp - old_logp)       (log-ratio clamped to ±20 before exp)
        L_t = max(-A * rho, -A * clip(rho, 1 - clip_low, 1 + clip_high))

    dual_clip = c > 1 (Ye et al. 2020, eq. 5) bounds the loss of negative advantages, whose
    ratio is otherwise unbounded above: for A < 0, L_t = min(L_t, -c * A).

    logp, old_logp, mask: (B, T); adv: (B,) broadcast over T, or (B, T).
    Returns (aggregated loss, metrics): clip_frac is the fraction of valid tokens where the
    clipped term is the active one; approx_kl is mean k3(old || new) over valid tokens.
    """
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    loss = aggregate(per_token, mask, agg, norm, denoms)
    with torch.no_grad():
        m = mask.to(logp.dtype)
        metrics = {
            "pg_loss": loss.detach(),
            "clip_frac": masked_mean((clipped > unclipped).to(logp.dtype), m),
            "ratio_mean": masked_mean(ratio, m),
            "approx_kl": masked_mean(torch.exp(-log_ratio) - 1.0 + log_ratio, m),
        }
    return loss, metrics


def _with_kl(loss, metrics, logp, ref_logp, mask, kl_coef, kl_estimator, agg, norm, denoms, who: str):
    """loss + kl_coef * agg(KL_t); the KL is reported in metrics whenever ref_logp is given."""
    if ref_logp is None:
        if kl_coef > 0:
            raise ValueError(f"{who}: kl_coef > 0 needs ref_logp")
        return loss
    kl = aggregate(kl_penalty(logp, ref_logp, kl_estimator), mask, agg, norm, denoms)
    metrics["kl"] = kl.detach()
    return loss + kl_coef * kl if kl_coef > 0 else loss


def _with_entropy(loss, entropy, entropy_coef, mask, agg, norm, denoms, who: str):
    """loss - entropy_coef * agg(H_t): the entropy bonus (PPO, Schulman et al. 2017, eq. 9)."""
    if entropy_coef <= 0:
        return loss
    if entropy is None:
        raise ValueError(f"{who}: entropy_coef > 0 needs the per-token entropy")
    return loss - entropy_coef * aggregate(entropy, mask, agg, norm, denoms)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    agg: str = "token-mean",
    norm: float | None = None,
    dual_clip: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    denoms: dict[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO objective (Shao et al. 2024, eq. 3), as a loss to minimise:

        L = agg( max(-A*rho, -A*clip(rho, 1-eps_low, 1+eps_high)) ) + beta * agg( KL_t )
            - entropy_coef * agg( H_t )

    with KL_t one of Schulman's estimators of KL(pi || pi_ref) (k3 in the paper) and the
    same aggregation for all terms. ref_logp is required when kl_coef > 0, `entropy` (B, T),
    with its gradient, when entropy_coef > 0 (the optional entropy bonus of PPO, eq. 9).
    """
    loss, metrics = ppo_clip_loss(logp, old_logp, adv, mask, clip_low, clip_high, agg, norm, dual_clip, denoms)
    loss = _with_kl(loss, metrics, logp, ref_logp, mask, kl_coef, kl_estimator, agg, norm, denoms, "grpo_loss")
    loss = _with_entropy(loss, entropy, entropy_coef, mask, agg, norm, denoms, "grpo_loss")
    metrics["loss"] = loss.detach()
    return loss, metrics


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    agg: str = "seq-mean-token-mean",
    norm: float | None = None,
    denoms: dict[str, float] | None = None,
    dual_clip: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, eqs. 5-7): one importance ratio per sequence, length-normalised,

        s_i = exp( (1/|y_i|) * sum_t (logp_t - old_logp_t) )
        L   = mean_i  max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_low, 1 + eps_high))
              + beta * agg( KL_t ) - entropy_coef * agg( H_t )

    adv: (B,) (or (B, T), of which position 0 is used). Sequences without valid tokens are
    left out. Ranges are tiny (3e-4 / 4e-4 in the paper) because s_i is a geometric mean.
    The optional KL and entropy terms are per token, reduced with `agg` as in grpo_loss (the
    entropy bonus is PPO's, eq. 9; the paper has neither). Dual-clip bounds a token-level
    ratio and has no sequence-level form here: dual_clip must be None.
    """
    if dual_clip is not None:
        raise ValueError("gspo_loss: dual_clip is a token-level PPO option; GSPO clips one ratio per sequence")
    if adv.dim() == 2:
        adv = adv[:, 0]
    m = mask.to(logp.dtype)
    lengths = m.sum(-1)
    has = lengths > 0
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # for the metric only
    log_s = ((logp - old_logp) * m).sum(-1) / lengths.clamp(min=1)
    s = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -adv * s
    clipped = -adv * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_seq = torch.maximum(unclipped, clipped)
    loss = (per_seq * has).sum() / (has.sum().clamp(min=1) if denoms is None else max(denoms["seqs"], 1.0))
    with torch.no_grad():
        hf = has.to(logp.dtype)
        metrics = {
            "pg_loss": loss.detach(),
            "clip_frac": ((clipped > unclipped).to(logp.dtype) * hf).sum() / hf.sum().clamp(min=1),
            "ratio_mean": (s * hf).sum() / hf.sum().clamp(min=1),
            "approx_kl": masked_mean(torch.exp(-log_ratio) - 1.0 + log_ratio, m),
        }
    loss = _with_kl(loss, metrics, logp, ref_logp, mask, kl_coef, kl_estimator, agg, norm, denoms, "gspo_loss")
    loss = _with_entropy(loss, entropy, entropy_coef, mask, agg, norm, denoms, "gspo_loss")
    metrics["loss"] = loss.detach()
    return loss, metrics


POLICY_LOSSES = {"grpo": grpo_loss, "ppo": grpo_loss, "gspo": gspo_loss}  # PPO: the same clipped loss, per-token A


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    kind: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing, or IPO (Azar 2023, eq. 17).

        h = (logpi(y_c) - logpi(y_r)) - (logpi_ref(y_c) - logpi_ref(y_r))     (sums over response tokens)
        sigmoid: L = -(1 - ls) * log sigma(beta * h) - ls * log sigma(-beta * h)
        ipo:     L = (h - 1 / (2 * beta))^2

    All inputs (P,) summed log-probs of P preference pairs; loss is the mean over pairs.
    Metrics: the implicit rewards beta * (logpi - logpi_ref) of chosen and rejected, their
    margin, and reward accuracy (fraction of pairs whose chosen reward is higher).
    """
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if kind == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).pow(2)
    else:
        raise ValueError(f"unknown DPO loss '{kind}' (known: sigmoid, ipo)")
    with torch.no_grad():
        rc = beta * (policy_chosen - ref_chosen)
        rr = beta * (policy_rejected - ref_rejected)
        metrics = {
            "rewards/chosen": rc.mean(),
            "rewards/rejected": rr.mean(),
            "rewards/margin": (rc - rr).mean(),
            "rewards/accuracy": (rc > rr).float().mean(),
        }
    loss = losses.mean()
    metrics["loss"] = loss.detach()
    return loss, metrics
