"""Per-token KL estimators between the policy and a reference (J. Schulman, "Approximating
KL divergence", 2020). With samples drawn from the policy and d = logp_ref - logp:

    k1 = -d                 unbiased, high variance, can be negative
    k2 = d^2 / 2            biased, low variance
    k3 = exp(d) - d - 1     unbiased, low variance, always >= 0 (GRPO's choice, Shao 2024 eq. 4)
"""

from __future__ import annotations

import torch

# Like verl's low_var_kl we bound the estimate: a single token whose log-ratio explodes
# would otherwise dominate the loss (exp of a large d) and produce inf.
KL_CLAMP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """logp, ref_logp: (B, T) log-probs of the sampled tokens. Returns (B, T) estimates."""
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.pow(2)
    if kind == "k3":
        return (torch.exp(d) - d - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown KL estimator '{kind}' (known: k1, k2, k3)")
