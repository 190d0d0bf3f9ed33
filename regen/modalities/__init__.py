"""Modality adapters: one implementation of the protocol in base.py per kind of model, each
registered once with its methods (regen/config/registry.py; the built-in ones in
regen/config/lm_methods.py and flow_methods.py)."""

from __future__ import annotations


def modality_class(cfg):
    """The adapter of the modality algorithm.name trains (imported when a run starts: each pulls
    its models); a joint run (models:) is one modality over its models' adapters."""
    if getattr(cfg, "models", None):
        from regen.modalities.joint import JointModality

        return JointModality
    from regen.config.registry import MODALITIES, load

    return load(MODALITIES[cfg.modality].adapter)
