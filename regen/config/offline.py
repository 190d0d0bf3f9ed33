"""What every trainer without sampling reads (`regen sft`, `regen rm`), declared once: the run, the
model and its data, the optimizer, checkpoints, the S3 mirror, health (non-finite skip and
rollback), the process group and the logs. Each verb's config adds its own steps section and
evaluation (regen/config/sft.py, rm.py) and may give other defaults."""

from __future__ import annotations

from pydantic import Field

from regen.config import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    MirrorConfig,
    ModelConfig,
    OfflineHealthConfig,
    OptimConfig,
    RunConfig,
    TaskConfig,
)
from regen.config.base import Section
from regen.config.dist import OfflineDistributedConfig, offline_unread


class OfflineConfig(Section):
    run: RunConfig
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    optim: OptimConfig
    checkpoint: CheckpointConfig = Field(default_factory=lambda: CheckpointConfig(every=0))
    mirror: MirrorConfig = Field(default_factory=MirrorConfig)
    health: OfflineHealthConfig = Field(default_factory=OfflineHealthConfig)
    distributed: OfflineDistributedConfig = Field(default_factory=OfflineDistributedConfig)
    log: LogConfig

    def unread(self, given) -> list[str]:
        """Messages for keys the user set that the trainer does not read: the process group's outside torchrun."""
        return offline_unread(self.distributed.mode, given)
