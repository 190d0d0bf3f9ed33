"""Flow-matching RL from preferences rather than scalar advantages: DGPO's group preference
(Luo, Hu, Tang 2025) and the native reward forms (binary labels, pairwise win rates) that the
ODE methods (regen/algorithms/flow.py: DiffusionNFT) and DGPO take as they are.

Conventions as in regen/algorithms/flow.py: l = the flow-matching loss of a sample at one point
of the forward process (mean over elements), groups are `group_size` consecutive rows.
"""

from __future__ import annotations

import torch

from regen.algorithms.flow import Metrics, _hi, _sample_mean, velocity_drift
from regen.algorithms.losses import LOG_RATIO_CLAMP, masked_mean

# ---------------------------------------------------------------- reward forms


def binary_advantages(labels: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group preferences from good (1) / bad (0) labels, as sets rather than normalised scalars:

        A_i = + n / (2 |G+|)  for a good sample,   - n / (2 |G-|)  for a bad one

    so the positive set G+ and the negative set G- of each group weigh alike whatever their sizes
    (sum_g A = 0, mean |A| = 1), the form DGPO's group preference G+ > G- takes with each set's
    members weighted equally (Luo et al. 2025, sec. 3). A group whose labels all agree holds no
    preference (A = 0, still valid); missing labels (NaN) are invalid and left out of the counts.
    labels (B,) in {0, 1, NaN}; returns (adv (B,), valid (B,))."""
    _check_labels(labels, (0.0, 1.0), "binary")
    lab = labels.view(-1, group_size).to(torch.float64)
    valid = torch.isfinite(lab)
    good = (valid & (lab == 1)).sum(1, keepdim=True).to(torch.float64)
    bad = (valid & (lab == 0)).sum(1, keepdim=True).to(torch.float64)
    n = valid.sum(1, keepdim=True).to(torch.float64)
    both = (good > 0) & (bad > 0)
    pos = torch.where(both, n / (2 * good.clamp(min=1)), torch.zeros_like(n))
    neg = torch.where(both, -n / (2 * bad.clamp(min=1)), torch.zeros_like(n))
    adv = torch.where(lab == 1, pos, neg)
    adv = torch.where(valid, adv, torch.zeros_like(adv))
    return adv.flatten().to(labels.dtype), valid.flatten()


def pairwise_advantages(win_rates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt winner / loser directions from pairwise labels (1 win, 0.5 tie, 0 loss):
    A_i = 2 * (w_i - 0.5) in [-1, 1], w_i the sample's mean label against the others of its
    group (the `pairwise` reward), so a sample that beats every other pushes its way with
    A = 1 and one that loses every comparison away with A = -1; ties count as half a win.
    No group normalisation: the labels already are relative. NaN (no scored opponent) is invalid."""
    _check_labels(win_rates, None, "pairwise")
    valid = torch.isfinite(win_rates)
    adv = torch.where(valid, 2.0 * (win_rates - 0.5), torch.zeros_like(win_rates))
    return adv, valid


def _check_labels(r: torch.Tensor, allowed: tuple | None, form: str) -> None:
    fin = r[torch.isfinite(r)]
    bad = fin[~((fin == 0) | (fin == 1))] if allowed else fin[(fin < 0) | (fin > 1)]
    if len(bad):
        want = "1 (good) or 0 (bad)" if allowed else "win rates in [0, 1] (the `pairwise` reward)"
        example = "adherence_accuracy or binary" if allowed else "pairwise"
        raise ValueError(f"algorithm.reward_type={form}: the total reward must be {want}; got {float(bad[0]):g}. "
                         f"Use one reward term of that form with weight 1 (e.g. {example}), "
                         "or algorithm.reward_type=scalar")


# ---------------------------------------------------------------- DGPO


def dgpo_group_weights(fm: torch.Tensor, fm_ref: torch.Tensor, adv: torch.Tensor, group_size: int, beta: float,
                       valid: torch.Tensor | None = None) -> torch.Tensor:
    """DGPO's per-group weight (Luo, Hu, Tang 2025, "Reinforcing Diffusion Models by Direct Group
    Preference Optimization", eqs. 6-9, and their public code):

        S_g = beta / G * sum_{i in g} A_i (l_theta,i - l_ref,i)        (no gradient)
        w_g = sigmoid(S_g)

    The group preference G+ > G- is a Bradley-Terry likelihood sigma(R(G+) - R(G-)) with
    R(G) = beta * sum_{i in G} |A_i| / G * log(pi_theta / pi_ref)(x_i), and, as in Diffusion-DPO,
    log(pi_theta / pi_ref)(x_i) ~ -(l_theta,i - l_ref,i), l the flow-matching loss of sample i at
    the same noisy point. Then R(G+) - R(G-) = -S_g and the gradient of -log sigma(-S_g) is
    sigma(S_g) * beta / G * sum_i A_i grad l_theta,i: each group's advantage-weighted loss scaled by
    how far the group still is from its preference (w -> 0 once the positives are clearly more
    likely than under the reference, 1/2 at the start). fm, fm_ref, adv (B,) in groups of
    `group_size` consecutive rows; invalid rows (missing reward) count as A = 0. Returns w (B,),
    each row its group's weight."""
    a = adv if valid is None else torch.where(valid, adv, torch.zeros_like(adv))
    term = (a * (_hi(fm) - _hi(fm_ref))).detach().view(-1, group_size)
    s = beta * term.sum(1) / group_size
    return torch.sigmoid(s).repeat_interleave(group_size)


def dgpo_loss(fm: torch.Tensor, adv: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None = None,
              old_fm: torch.Tensor | None = None, clip_range: float | None = None,
              denoms: dict[str, float] | None = None, v: torch.Tensor | None = None,
              v_ref: torch.Tensor | None = None, kl_coef: float = 0.0,
              clip_high: float | None = None) -> tuple[torch.Tensor, Metrics]:
    """DGPO's loss given the group weights w (dgpo_group_weights), per sample i:

        L = mean_i sg(w_g(i)) * A_i * l_theta,i   (+ kl_coef * mean_i mean_elements (v - v_ref)^2)

    The public code drops the constant beta / G of the gradient (Adam is scale-free) and adds:
    a PPO-style clip (clip_range c, clip_high c_h, default c): with rho_i = exp(l_old,i - l_theta,i)
    against the old (EMA) policy, l_theta,i is held (no gradient) where A_i > 0 and rho_i > 1 + c_h,
    or A_i < 0 and rho_i < 1 - c; and a velocity-space KL to the frozen reference, weight kl_coef.
    fm = l_theta (B,) with gradient, adv (B,), weights (B,); old_fm (B,) l under the old policy
    (needed with clip_range); v, v_ref (B, ...) for the KL. Metrics: loss, fm_loss, weight_mean,
    clip_frac (with the clip), kl (with v_ref)."""
    fm = _hi(fm)
    valid = torch.isfinite(adv) if valid is None else valid & torch.isfinite(adv)
    a = torch.where(valid, adv, torch.zeros_like(adv)).to(fm.dtype)
    held = torch.zeros_like(valid)
    if clip_range is not None:
        if old_fm is None:
            raise ValueError("dgpo_loss: clip_range needs old_fm, the old policy's loss")
        ratio = torch.exp((_hi(old_fm).detach() - fm.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        high = clip_range if clip_high is None else clip_high
        held = torch.where(a > 0, ratio > 1.0 + high, ratio < 1.0 - clip_range) & valid
    trained = torch.where(held, fm.detach(), fm)
    w = weights.detach().to(fm.dtype)
    loss = _sample_mean(w * a * trained, valid, denoms)
    metrics: Metrics = {}
    if v_ref is not None:
        drift = velocity_drift(v, v_ref)
        metrics["kl"] = _sample_mean(drift.detach(), valid, denoms)
        if kl_coef > 0:
            loss = loss + kl_coef * _sample_mean(drift, valid, denoms)
    with torch.no_grad():
        vf = valid.to(fm.dtype)
        metrics.update(fm_loss=masked_mean(fm, vf), weight_mean=masked_mean(w, vf), loss=loss.detach())
        if clip_range is not None:
            metrics["clip_frac"] = masked_mean(held.to(fm.dtype), vf)
    return loss, metrics
