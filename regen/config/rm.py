"""`regen rm`: the reward-model training config (regen/offline/rm.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from regen.config import DataConfig, EvalConfig, LogConfig, ModelConfig, OptimConfig, RunConfig
from regen.config.base import Section
from regen.config.offline import OfflineConfig


class RMStepsConfig(Section):
    steps: int = Field(300, ge=1, description="Optimizer steps.")
    global_batch_size: int = Field(32, ge=1, description="Preference pairs per optimizer step.")
    grad_clip: float = Field(1.0, ge=0.0, description="Max global gradient norm; 0 disables clipping.")
    margin: float = Field(0.0, description="Bradley-Terry margin m: loss -log sigmoid(r_chosen - r_rejected - m) "
                          "(Llama 2's reward model, Touvron et al. 2023, eq. 2); 0 = the plain Bradley-Terry loss.")
    max_length: int = Field(1024, ge=2, description="Tokens per scored sequence; longer ones lose tokens from the "
                            "start, as the reward_model reward does when it scores.")


class RMEvalConfig(Section):
    every: int = Field(0, ge=0, description="Held-out pair accuracy every N steps; 0 = before the first and after the "
                       "last step only.")
    gates: dict[str, str] = Field(
        default_factory=dict, description="Thresholds on eval metrics (pair_accuracy, margin), e.g. {pair_accuracy: "
        "'>= 0.7'}: logged as eval/gate/NAME and eval/gates_passed; `regen export --require-gates` reads them.")

    @field_validator("gates", mode="before")
    @classmethod
    def _gate_rules(cls, v: Any) -> Any:
        return EvalConfig._gate_rules(v)


class RMConfig(OfflineConfig):
    """`regen rm`: train a reward model on preference pairs."""

    run: RunConfig = Field(default_factory=lambda: RunConfig(dir="runs/rm"))
    model: ModelConfig = Field(description="Starting point: a causal LM folder (usually the SFT model; a new scalar "
                               "head is added), a sequence-classification folder, or model.init.")
    data: DataConfig = Field(default_factory=lambda: DataConfig(train="builtin:arithmetic:train",
                                                                eval="builtin:arithmetic:test"),
                             description="Pairs {prompt, chosen, rejected}, as for DPO.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    log: LogConfig = Field(default_factory=lambda: LogConfig(every=20))
    rm: RMStepsConfig = Field(default_factory=RMStepsConfig)
    eval: RMEvalConfig = Field(default_factory=RMEvalConfig)

    @model_validator(mode="after")
    def _supported(self) -> RMConfig:
        if self.model.lora is not None:
            raise ValueError("model.lora: `regen rm` trains every weight of the reward model")
        if self.data.chat_template or self.data.system_prompt is not None:
            raise ValueError("data.chat_template / data.system_prompt: `regen rm` renders each pair with the model "
                             "tokenizer's own chat template when it has one (as the reward_model reward scores)")
        return self
