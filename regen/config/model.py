"""The model to train (`model:`): where it comes from, its dtype, LoRA, and what of a
vision-language model trains."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from regen.config.base import Section


class LoraSettings(Section):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scaling alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA path.")
    target_modules: list[str] | None = Field(
        None, description="Module names to adapt; null = peft's default for a causal LM, and for flow models the "
        "attention projections and resnet convolutions (regen/policies/flow_lora.py DEFAULT_TARGETS)."
    )


class ModelConfig(Section):
    path: str | None = Field(
        None, description="Local Hugging Face folder (or hub id, where a network exists) of a causal LM, or a regen "
        "flow model folder (flow_policy.json: the shapes models, export/ of a flow run)."
    )
    init: str | None = Field(
        None, description="Create a fresh model from a built-in recipe instead of loading one (e.g. 'arith-char-gpt2')."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    lora: LoraSettings | None = Field(
        None, description="Train a LoRA adapter (peft) instead of all weights; the KL reference is then the base "
        "with the adapter disabled (no second copy). Checkpoints hold the adapter, export/ the merged model."
    )
    freeze_vision: bool | None = Field(
        None, description="Vision-language models: keep the vision tower's weights fixed (null = true: the projector "
        "and the language model train). With model.lora the adapters sit on the language side only; refused for "
        "models that read no images.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.init is None):
            raise ValueError("set exactly one of model.path (load a model) or model.init (build a fresh one)")
        return self
