"""Which flow model a config names, and loading it: a built-in recipe (model.init), a regen flow
folder (flow_policy.json), or a diffusers SD3 / FLUX / Wan pipeline folder."""

from __future__ import annotations

import torch

from regen.config.model import FLOW_RECIPES, is_flow_model  # noqa: F401  (re-exported)
from regen.policies.flow import FlowPolicy


def load_flow_policy(model_cfg, seed: int, device: torch.device) -> FlowPolicy:
    if model_cfg.init is not None:
        return FlowPolicy.builtin(FLOW_RECIPES[model_cfg.init], seed, device)
    from regen.policies.flow_latent import model_kind, policy_class  # noqa: F811

    # dispatch on flow_policy.json's kind (or model_index.json's pipeline class): the built-in
    # UNet, SD3, FLUX or Wan
    cls = policy_class(model_kind(model_cfg.path) or "shapes")
    return cls.load(model_cfg.path, device, getattr(torch, model_cfg.dtype))
