"""The flow-matching modality and its methods (Flow-GRPO, Flow-DPPO, DiffusionNFT, AWM, DGPO),
each declared once (regen/config/registry.py): the keys it reads, its defaults and checks, the
frozen copies it keeps, and its code in regen/modalities/flow_methods.py."""

from __future__ import annotations

from regen.config.eval import ALIGNED, DISTRIBUTION
from regen.config.model import has_guidance_embed
from regen.config.registry import Method, Modality, always, register_method, register_modality, when

IMPL = "regen.modalities.flow_methods:"
MEDIA_QUALITY = (  # what the image / video metrics compare with
    *when("with eval.metrics fid, kid, precision_recall, ssim or psnr",
          lambda c: any(n in DISTRIBUTION + ALIGNED for n in c.eval.metrics),
          "eval.reference"),
    *when("with eval.metrics fid, kid or precision_recall",
          lambda c: any(n in DISTRIBUTION for n in c.eval.metrics), "eval.features"),
    *when("with eval.metrics clip_score", lambda c: "clip_score" in c.eval.metrics, "eval.clip_model"),
)
register_modality(Modality("flow", "flow-matching models", "regen.modalities.flow:FlowModality", reads=(
    *always("flow.steps", "flow.eval_steps", "flow.shift", "flow.guidance", "flow.weight_ema", "flow.adv_clip",
            "algorithm.std_normalize", "train.gradient_checkpointing", "flow.sampler"),
    *when("with a guidance-distilled model (FLUX.1-dev, HunyuanVideo: their transformers embed the guidance; the "
          "others' guidance is flow.guidance)", lambda c: c.model is not None and has_guidance_embed(c.model),
          "flow.guidance_embed"),
    *MEDIA_QUALITY)))

SDE = (  # the methods trained on stochastic (SDE) sampling steps
    *always("flow.noise_level", "flow.sde_window"),
    *when("with flow.sde_window set", lambda c: c.flow.sde_window is not None, "flow.window_policy",
          "flow.window_start"),
    *when("with flow.window_policy=moving", lambda c: c.flow.sde_window is not None
          and c.flow.window_policy == "moving", "flow.window_shift_every"),
)
ODE = tuple(always("flow.solver", "flow.trust_region"))  # the methods trained on clean ODE samples: their
# rollouts' solver, and the bound on one update (regen/algorithms/trust_region.py)
EMA = ("flow.ema_rate", "flow.ema_max")  # the EMA copy's schedule, read where the method keeps one


def _kl(cfg) -> bool:
    return cfg.algorithm.kl_coef > 0


def _dgpo_ema(cfg) -> bool:
    return cfg.flow.dgpo_ref == "ema" or cfg.algorithm.clip_low is not None


def _whole_groups(cfg) -> str | None:
    t, r = cfg.train, cfg.rollout
    if t.global_minibatch_size % r.group_size:
        return (f"train.global_minibatch_size={t.global_minibatch_size} must hold whole groups of "
                f"rollout.group_size={r.group_size} for dgpo (its weight is one per group)")
    return None


# Flow-GRPO's per-step ratio clips at 1e-4 in the paper; 1e-3 learned twice as fast on the shapes task
# (1e-4 clipped 15-23% of the ratios).
register_method(Method(
    "flow_grpo", "flow", "clipped ratio over SDE steps", clip=(1e-3, 1e-3), stochastic=True, uses_base=_kl,
    reads=(*SDE, *always("algorithm.clip_low", "algorithm.clip_high", "algorithm.kl_coef")), impl=IMPL + "FlowGRPO"))
register_method(Method(
    "flow_dppo", "flow", "KL trust region over SDE steps", stochastic=True,
    reads=(*SDE, *always("flow.dppo_tau")), impl=IMPL + "FlowDPPO"))
register_method(Method(
    "nft", "flow", "DiffusionNFT on ODE samples", uses_base=_kl, uses_ema=lambda c: True,
    reads=(*ODE, *always("flow.nft_beta", *EMA, "algorithm.reward_type", "algorithm.kl_coef")), impl=IMPL + "NFT"))
register_method(Method(
    "awm", "flow", "advantage-weighted flow matching on ODE samples", uses_ema=_kl,
    reads=(*ODE, *always("flow.awm_weight", "algorithm.kl_coef"),
           *when("with algorithm.kl_coef > 0 (the EMA anchor)", _kl, *EMA)), impl=IMPL + "AWM"))
register_method(Method(
    "dgpo", "flow", "DGPO: group preferences learned from ODE samples, Luo et al. 2025", check=_whole_groups,
    uses_base=lambda c: _kl(c) or c.flow.dgpo_ref == "base", uses_ema=_dgpo_ema,
    reads=(*ODE, *always("flow.dgpo_beta", "flow.dgpo_ref", "algorithm.kl_coef", "algorithm.clip_low",
                         "algorithm.reward_type"),
           *when("with algorithm.clip_low set", lambda c: c.algorithm.clip_low is not None, "algorithm.clip_high"),
           *when("with flow.dgpo_ref=ema or algorithm.clip_low set (the EMA old policy)", _dgpo_ema, *EMA)),
    impl="regen.modalities.flow_dgpo:DGPO"))
