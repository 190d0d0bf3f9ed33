"""Modality adapters: one implementation of the protocol in base.py per kind of model."""

from __future__ import annotations


def modality_class(cfg):
    """The adapter of the modality algorithm.name trains (imported lazily: each pulls its models)."""
    if cfg.modality == "flow":
        from regen.modalities.flow import FlowModality

        return FlowModality
    from regen.modalities.lm import LMModality

    return LMModality
