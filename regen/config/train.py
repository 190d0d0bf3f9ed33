"""How a model is optimised: the RL update's passes and batches (train:), SFT's steps (sft:),
and AdamW with its schedule (optim:)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from regen.config.base import Section


class TrainConfig(Section):
    steps: int = Field(100, ge=1, description="RL steps (one rollout batch each).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    global_minibatch_size: int | None = Field(
        None, ge=1, description="Completions per optimizer step, over all processes; null = the whole rollout batch."
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Completions per forward/backward on one device; gradients are accumulated "
        "up to the minibatch (same loss, bounded memory). null = the whole minibatch."
    )
    grad_clip: float = Field(1.0, ge=0.0, description="Max global gradient norm; 0 disables clipping.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Forward passes under torch.autocast in bf16 or fp16 (fp16 with loss scaling); weights, "
        "gradients, optimizer state and log-probs stay fp32 (regen/runtime/precision.py)."
    )
    gradient_checkpointing: bool = Field(
        False, description="Flow models: recompute the velocity network's activations in the backward pass (less "
        "memory, about a third more compute). Not for language models yet: their update shares each prompt's KV "
        "cache across the group, which checkpointing turns off."
    )
    offload: bool = Field(
        False, description="GPU memory: park the optimizer state and idle frozen models (reference, critic, EMA "
        "copies) in CPU memory while sampling, and bring them back for the update (regen/runtime/offload.py)."
    )


class SFTStepsConfig(Section):
    steps: int = Field(3000, ge=1, description="Optimizer steps.")
    global_batch_size: int = Field(64, ge=1, description="Demonstrations per optimizer step, over all processes.")
    grad_clip: float = Field(1.0, ge=0.0, description="Max global gradient norm; 0 disables clipping.")


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule after warm-up.")
