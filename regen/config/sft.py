"""`regen sft`: the supervised fine-tuning config (regen/offline/sft.py, regen/offline/flow_sft.py)."""

from __future__ import annotations

from pydantic import Field, model_validator

from regen.config import EvalConfig, LogConfig, OptimConfig, RolloutConfig, RunConfig, SFTStepsConfig
from regen.config.offline import OfflineConfig

# the rollout keys `regen sft` of a language model reads: its held-out evaluation samples with them
SFT_ROLLOUT = ("temperature", "top_p", "max_new_tokens", "stop_tokens")


class SFTConfig(OfflineConfig):
    """`regen sft`: supervised fine-tuning on prompt/completion demonstrations."""

    run: RunConfig = Field(default_factory=lambda: RunConfig(dir="runs/sft"))
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    log: LogConfig = Field(default_factory=lambda: LogConfig(every=200))
    sft: SFTStepsConfig = Field(default_factory=SFTStepsConfig)
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig(greedy=True))
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="Sampling settings used by held-out evaluation."
    )

    def unread(self, given) -> list[str]:
        """Messages for keys the user set that `regen sft` does not read: of rollout.*, held-out evaluation of a
        language model reads only the sampling settings (SFT_ROLLOUT), a flow model's none; the process group's
        settings outside torchrun."""
        from regen.config.model import is_flow_model

        keys = sorted(k for k in given if k.startswith("rollout."))
        chat = sorted(k for k in given if k in ("data.chat_template", "data.system_prompt"))
        if (keys or chat) and is_flow_model(self.model):
            out = [f"{k} is not read by `regen sft` of a flow model (its held-out samples take 20 ODE steps)"
                   for k in keys] + [f"{k} is not read by `regen sft` of a flow model (it renders no text)" for k in chat]
        else:
            out = [f"{k} is not read by `regen sft` (held-out evaluation reads only rollout.{', rollout.'.join(SFT_ROLLOUT)})"
                   for k in keys if k.removeprefix("rollout.").split(".")[0] not in SFT_ROLLOUT]
            if "data.system_prompt" in chat and not self.data.chat_template:
                out.append("data.system_prompt is read only with data.chat_template=true")
        return out + super().unread(given)

    @model_validator(mode="after")
    def _synonyms(self) -> SFTConfig:
        if self.task.known_synonyms and not str(self.data.train).startswith("builtin:shapes-paraphrase"):
            raise ValueError(f"task.known_synonyms={self.task.known_synonyms}: it shapes the demonstrations of "
                             f"builtin:shapes-paraphrase:train, not data.train={self.data.train}")
        return self
