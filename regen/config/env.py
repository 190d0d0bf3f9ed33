"""Multi-turn episodes (`env:`): the environment a language model acts in, and the episode's limits."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from regen.config.base import Section


class EnvConfig(Section):
    name: str = Field(description="The environment: 'tools' (the built-in tool environment, regen/envs/tools.py) or "
                      "'module:Class' of your own (reset(row, seed), step(turn) -> Step; regen/envs/__init__.py).")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's class; "
                                 "tools: {tools: [module:function, python], timeout_s, parser, isolate, max_calls, "
                                 "response_format, sandbox}.")
    max_turns: int = Field(4, ge=1, description="Model turns per episode; an episode still going after them is "
                           "marked truncated.")
    max_tokens: int = Field(256, ge=1, description="Tokens after the prompt per episode, the model's and the "
                            "observations'; rollout.max_new_tokens caps each turn.")
