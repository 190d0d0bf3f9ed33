"""The base of every config section (its own module so section files can share it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # extra="forbid" turns a typo'd key into an error instead of a silently ignored setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
