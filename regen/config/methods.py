"""Config sections of the methods that bring their own models or terms: PPO's critic, DAPO's
overlong punishment, the flow-matching samplers and losses (kept apart so regen/config/__init__.py
stays one screenful per idea), and the migration of older keys. The methods themselves are
declared in regen/config/lm_methods.py and flow_methods.py (regen/config/registry.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from regen.config.base import Section
from regen.config.registry import METHODS


class OverlongConfig(Section):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward."""

    max_len: int = Field(ge=1, description="L_max in tokens: beyond it the penalty is -factor.")
    cache_len: int = Field(ge=1, description="L_cache: the penalty ramps from 0 to -factor over the last cache_len tokens.")
    factor: float = Field(1.0, ge=0.0, description="Size of the full penalty.")


class CriticConfig(Section):
    path: str | None = Field(
        None, description="PPO critic's starting weights: a causal-LM or token-classification folder (a value head "
        "is added when missing); null = the policy's starting model (model.path / model.init) with a new head."
    )
    lr: float = Field(1e-5, gt=0.0, description="Critic learning rate (AdamW; other settings as in optim).")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="Clip of the value update around the old values (eps_v); null = unclipped."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Steps at the start in which only the critic is trained (the policy is held)."
    )


class FlowConfig(Section):
    steps: int = Field(10, ge=1, description="Sampling steps of a training rollout.")
    eval_steps: int = Field(20, ge=1, description="Euler ODE steps when sampling for evaluation.")
    shift: float | None = Field(
        None, gt=0.0, description="Time shift of the sigma grid, sigma' = shift sigma / (1 + (shift - 1) sigma) "
        "(SD3; 1 = linear). null = the model's own: a diffusers folder's scheduler as its pipeline uses it (SD3, "
        "Wan, HunyuanVideo: its shift; FLUX.1-dev, Qwen-Image: the resolution-dependent shift for this image "
        "size), 1 for the built-in models.")
    sampler: Literal["ode", "sde", "cps"] | None = Field(
        None, description="How training rollouts sample: 'ode' (deterministic; nft, awm, dgpo) or, for flow_grpo / "
        "flow_dppo, the stochastic step: Flow-GRPO's 'sde' or coefficients-preserving 'cps'. null = sde for "
        "flow_grpo / flow_dppo, ode for the others."
    )
    solver: Literal["euler", "heun"] = Field(
        "euler", description="ODE solver of the training rollouts of nft / awm / dgpo: 'euler' (one velocity per "
        "step) or 'heun' (second order, two per step but the last: fewer steps for the same accuracy)."
    )
    noise_level: float = Field(0.7, ge=0.0, description="SDE noise level a (CPS: eta in [0, 1]).")
    sde_window: int | None = Field(
        None, ge=1, description="Stochastic (trained) steps per rollout; null = all (Flow-GRPO); a few = "
        "Flow-GRPO-Fast / MixGRPO, the rest are ODE steps."
    )
    window_policy: Literal["fixed", "random", "moving"] = Field(
        "fixed", description="Where the SDE window sits: at window_start, uniform per batch, or sliding one step "
        "later every window_shift_every steps (MixGRPO)."
    )
    window_start: int = Field(0, ge=0, description="First SDE step of the window.")
    window_shift_every: int = Field(25, ge=1, description="moving: training steps per one-step slide.")
    guidance: float = Field(1.0, gt=0.0, description="Classifier-free guidance scale when sampling (1 = off).")
    guidance_embed: float | None = Field(
        None, gt=0.0, description="Guidance-distilled models (FLUX.1-dev, HunyuanVideo: a guidance embedding instead "
        "of CFG): the guidance value the transformer is given, in training and evaluation, kept in the export's "
        "flow_policy.json. null = the folder's value, else its pipeline's default (FLUX.1-dev 3.5, HunyuanVideo "
        "6.0). Refused for models without a guidance embedding.")
    adv_clip: float = Field(5.0, gt=0.0, description="Flow methods: advantages clipped to +-adv_clip (and NFT's C).")
    dppo_tau: float = Field(1e-5, gt=0.0, description="flow_dppo: KL threshold of the trust region.")
    nft_beta: float = Field(1.0, gt=0.0, description="DiffusionNFT beta (implicit positive/negative policies).")
    ema_rate: float = Field(1e-3, ge=0.0, description="DiffusionNFT old policy / AWM anchor (algorithm.kl_coef > 0): "
                            "EMA decay = min(rate * step, ema_max).")
    ema_max: float = Field(0.5, ge=0.0, lt=1.0, description="DiffusionNFT old policy / AWM anchor: largest EMA decay.")
    weight_ema: float | None = Field(
        None, ge=0.0, lt=1.0, description="Decay of an EMA of the trained weights, updated after every step; "
        "held-out evaluation and export/ use it (Flow-GRPO keeps one for its evaluations). null = off."
    )
    trust_region: float | None = Field(
        None, gt=0.0, description="nft / awm / dgpo: the most one optimizer step may move the velocity, as the mean "
        "squared change on the minibatch's own noised points; a step that moves it further is scaled back toward "
        "the weights it started from (by sqrt(bound / change)). Logged as trust/change (before scaling), "
        "trust/scale and trust/clipped. null = off. The shapes task: examples/shapes_nft_trust.yaml (2e-4).")
    awm_weight: Literal["uniform", "t", "t**2"] = Field("uniform", description="AWM loss weight w(t).")
    dgpo_beta: float = Field(
        2000.0, gt=0.0, description="DGPO's beta_dpo: how sharply a group's weight sigmoid(beta / G * sum A (l - l_ref)) "
        "falls once its preference is learned. Public recipes: 10-100 with the frozen reference, 2000-5000 with the "
        "EMA reference."
    )
    dgpo_ref: Literal["ema", "base"] = Field(
        "ema", description="DGPO's reference policy: 'ema' (an EMA of the policy, decay min(flow.ema_rate * step, "
        "flow.ema_max); the public code's CFG-free recipe) or 'base' (the frozen starting model)."
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        """Keys that are one concept with a language-model key now live under that key."""
        moved = [f"flow.{k} is now {new}" for k, new in MOVED.items() if isinstance(data, dict) and k in data]
        if moved:
            raise ValueError("; ".join(moved) + " (one key per concept for every method)")
        return data


MOVED = {"clip_range": "algorithm.clip_low and algorithm.clip_high", "kl_coef": "algorithm.kl_coef",
         "global_std": "algorithm.std_normalize=batch", "awm_kl_coef": "algorithm.kl_coef (awm: the EMA anchor's weight)"}


def migrate(tree: dict) -> dict:
    """A config tree written by an older regen (a run's config.yaml, a checkpoint's config) in
    today's keys: the flow keys that moved (MOVED) go where they now live when the run's method
    reads them, and are dropped otherwise (older regen wrote every key, read or not)."""
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in tree.items()}
    flow, algo = tree.get("flow"), tree.get("algorithm")
    if not isinstance(flow, dict) or not isinstance(algo, dict):
        return tree
    name = algo.get("name")
    old = {k: flow.pop(k) for k in list(MOVED) if k in flow}
    if not old:
        return tree  # written by this version
    # a flow method of an older regen read these under flow:, and the algorithm: keys of the same
    # names (then language-model only) held unused defaults
    if name == "flow_grpo" and "clip_range" in old:
        algo["clip_low"] = algo["clip_high"] = old["clip_range"]
    if name == "flow_grpo" and "kl_coef" in old:
        algo["kl_coef"] = old["kl_coef"]
    if name == "awm" and "awm_kl_coef" in old:
        algo["kl_coef"] = old["awm_kl_coef"]
    m = METHODS.get(name)
    if m is not None and m.modality == "flow":
        algo["std_normalize"] = "batch" if old.get("global_std") else "group"
    if m is not None and m.modality == "flow" and not m.stochastic and flow.get("sampler") in ("sde", "cps"):
        flow.pop("sampler")  # the stochastic step an ODE method never took: today flow.sampler=ode
    if isinstance(algo.get("std_normalize"), bool):
        algo["std_normalize"] = "group" if algo["std_normalize"] else "none"
    return tree
