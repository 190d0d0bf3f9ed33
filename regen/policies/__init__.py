"""Modality adapters: everything model-specific the loop needs sits behind these."""
