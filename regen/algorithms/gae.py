"""Token-level advantages for PPO with a learned critic, and REINFORCE++ with the KL folded
into the reward. All tensors (B, T) over response tokens; `mask` marks the valid ones (a
prefix of each row: the tokens up to and including EOS).
"""

from __future__ import annotations

import torch

from regen.algorithms.losses import aggregate, masked_mean


def kl_shaped_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards with the sequence reward on the last valid token and a k1 KL
    penalty on every token (Ziegler et al. 2019 eq. 2; Ouyang et al. 2022 eq. 2):

        r_t = -kl_coef * (logp_t - ref_logp_t) + [t = last] * R

    rewards: (B,) sequence rewards; non-finite ones (missing) are put in as 0 — the caller
    masks those rows out. A row without valid tokens gets all zeros.
    """
    m = mask.to(torch.float32)
    R = torch.where(torch.isfinite(rewards), rewards, torch.zeros_like(rewards)).to(torch.float32)
    # the last valid token (not the count of valid ones: a multi-turn episode's observation tokens
    # are holes in the mask between the model's turns)
    T = m.shape[-1]
    last_idx = T - 1 - (m.flip(-1) > 0).float().argmax(-1)
    has = m.sum(-1) > 0
    rows = torch.arange(m.shape[0], device=m.device)[has]
    last = torch.zeros_like(m)
    last[rows, last_idx[has]] = 1.0
    out = last * R.to(m.device).unsqueeze(-1)
    if kl_coef > 0:
        if logp is None or ref_logp is None:
            raise ValueError("kl_shaped_rewards: kl_coef > 0 needs logp and ref_logp")
        out = out - kl_coef * (logp.float() - ref_logp.float()) * m
    return out


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eqs. 11-16):

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last valid token = 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V                               (the critic's regression target)

    With values = 0 and gamma = lam = 1, A_t is the plain reward-to-go sum_{s>=t} r_s
    (REINFORCE++). Invalid positions get A = returns = 0. Returns (advantages, returns).

    "Next" is the next valid token: invalid positions between valid ones (a multi-turn
    episode's observation tokens, which the model did not choose) are skipped, not treated
    as the end of the sequence.
    """
    m = mask.to(token_rewards.dtype)
    v = values.to(token_rewards.dtype) * m
    T = token_rewards.shape[-1]
    adv = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # A of the next valid token (0 after the last)
    next_v = torch.zeros_like(running)  # V of the next valid token (0 after the last)
    for t in reversed(range(T)):
        valid = m[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * running
        adv[:, t] = torch.where(valid, a, torch.zeros_like(a))
        running = torch.where(valid, a, running)
        next_v = torch.where(valid, v[:, t], next_v)
    return adv, (adv + v) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens of the whole batch, with the
    unbiased variance (as verl and OpenRLHF whiten PPO advantages). Fewer than two valid
    tokens: x is only centred. Invalid positions come out 0."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    centred = (x - mean) * m
    if n < 2:
        return centred
    var = centred.pow(2).sum() / (n - 1)
    return centred * torch.rsqrt(var + eps)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
    clip: float | None = 0.2, agg: str = "token-mean", norm: float | None = None,
    denoms: dict[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (the value clipping of OpenAI baselines' PPO2):

        V_clip = V_old + clip(V - V_old, -eps_v, +eps_v)
        L_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)       (clip None: 1/2 (V - R)^2)

    aggregated like the policy loss. Metrics: vf_clip_frac (tokens where the clipped term
    is the larger), explained_var = 1 - Var(R - V_old) / Var(R) over valid tokens (how much
    of the return the critic that produced the advantages explained).
    """
    err = (values - returns).pow(2)
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns).pow(2)
        per_token = 0.5 * torch.maximum(err, err_clip)
    else:
        per_token = 0.5 * err
    loss = aggregate(per_token, mask, agg, norm, denoms)
    with torch.no_grad():
        m = mask.to(values.dtype)
        metrics = {
            "value_loss": loss.detach(),
            "vf_clip_frac": masked_mean((err_clip > err).to(values.dtype), m) if clip is not None
            else torch.zeros(()),
            "values_mean": masked_mean(values.detach(), m),
        }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens; nan when the returns do not vary."""
    m = mask.to(returns.dtype)
    n = m.sum().clamp(min=1)

    def var(x):
        mu = (x * m).sum() / n
        return (((x - mu) * m).pow(2)).sum() / n

    vr = var(returns)
    return float("nan") if vr <= 0 else float(1.0 - var(returns - values) / vr)


def token_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, group_size: int, estimator: str, *,
    values: torch.Tensor | None = None, logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, baseline: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token advantages when the KL is folded into the reward, or a critic is used.

    estimator 'gae': PPO (Ouyang et al. 2022): kl_shaped_rewards -> gae with the critic's
        `values` -> whitened over the batch's valid tokens (whiten=True).
    estimator 'reinforce_pp': REINFORCE++ (Hu 2025, eqs. 5-7): kl_shaped_rewards (with the
        group-centred reward when baseline=True) -> reward-to-go (gae with V = 0, gamma = lam
        = 1) -> whitened over the batch.
    Missing (non-finite) rewards leave their row out (valid False, zero advantage).
    Returns (adv (B, T), returns (B, T) for the critic or None, valid (B,), metrics).
    """
    from regen.algorithms.advantages import grpo_advantages

    grouped = group_size >= 2 and rewards.numel() % group_size == 0
    if grouped:
        centred, g_valid, metrics = grpo_advantages(rewards, group_size, std_normalize=False)
    else:
        metrics = {"zero_std_frac": torch.zeros(()), "dropped_group_frac": torch.zeros(())}
    valid = torch.isfinite(rewards)
    metrics["missing_frac"] = 1.0 - valid.float().mean()
    if estimator == "reinforce_pp" and baseline:
        if not grouped:
            raise ValueError("reinforce_pp with a group baseline needs groups of at least 2")
        rewards, valid = centred, g_valid
    elif estimator not in ("gae", "reinforce_pp"):
        raise ValueError(f"unknown token-level estimator '{estimator}' (known: gae, reinforce_pp)")
    m = mask * valid.to(mask.dtype).unsqueeze(-1).to(mask.device)
    shaped = kl_shaped_rewards(rewards.to(m.device), m, logp, ref_logp, kl_coef)
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs the critic's values")
        adv, returns = gae(shaped, values.float(), m, gamma, lam)
    else:
        adv, returns = gae(shaped, torch.zeros_like(shaped), m, 1.0, 1.0)[0], None
    if whiten or estimator == "reinforce_pp":
        adv = masked_whiten(adv, m)
    return adv, returns, valid, {k: v.float() for k, v in metrics.items()}
