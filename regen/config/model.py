"""The model to train (`model:`): where it comes from, its dtype, LoRA, and what of a
vision-language model trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from regen.config.base import Section
from regen.errors import UserError


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


# What kind of model a config names (which modality trains it), read from the folder without loading it.
FLOW_RECIPES = {"shapes-unet": False, "moving-shapes-unet": True}  # model.init of a flow model -> video?
# model_index.json _class_name -> kind
PIPELINES = {"StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux", "QwenImagePipeline": "qwen-image",
             "WanPipeline": "wan", "HunyuanVideoPipeline": "hunyuan-video"}
NOT_YET = {"LTXPipeline": "LTX-Video", "CogVideoXPipeline": "CogVideoX"}  # refused by the family's name


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"model.path: cannot read {path}: {e}") from None


def has_guidance_embed(model_cfg: ModelConfig) -> bool:
    """A guidance-distilled flow model (FLUX.1-dev): its transformer embeds the guidance value."""
    p = Path(str(model_cfg.path or "")).expanduser() / "transformer" / "config.json"
    return model_cfg.path is not None and p.is_file() and bool(read_json(p).get("guidance_embeds"))


def model_kind(path) -> str | None:
    """The kind of flow model at `path` ('sd3', 'flux', 'wan', or a built-in kind), None when it is
    not one (a language model, a hub id)."""
    p = Path(str(path)).expanduser()
    if (p / "flow_policy.json").is_file():
        return read_json(p / "flow_policy.json").get("kind", "shapes")
    if (p / "model_index.json").is_file():
        name = read_json(p / "model_index.json").get("_class_name")
        if name not in PIPELINES:
            what = f"a {NOT_YET[name]} pipeline ({name})" if name in NOT_YET else f"a diffusers {name} folder"
            raise UserError(
                f"model.path: '{path}' is {what}; regen does not train it (yet): it trains "
                f"{', '.join(PIPELINES)} folders and its own flow models (docs/images-and-videos.md#supported-models)"
            )
        return PIPELINES[name]
    return None


def is_flow_model(model_cfg: ModelConfig) -> bool:
    """A flow-matching image / video model: a built-in flow recipe, a regen flow folder
    (flow_policy.json) or a diffusers SD3 / FLUX / Wan pipeline folder."""
    if model_cfg.init is not None:
        return model_cfg.init in FLOW_RECIPES
    return model_kind(model_cfg.path) is not None
