"""Modality adapters: one implementation of the protocol in base.py per kind of model."""

from __future__ import annotations


def modality_class(cfg):
    """The adapter of the modality algorithm.name trains (imported lazily: each pulls its models);
    a joint run (models:) is one modality over its models' adapters."""
    if getattr(cfg, "models", None):
        from regen.modalities.joint import JointModality

        return JointModality
    if cfg.modality == "flow":
        from regen.modalities.flow import FlowModality

        return FlowModality
    from regen.modalities.lm import LMModality

    return LMModality
