"""What a run learns from: the built-in task's options, reward terms, and the task streams of a
multi-task run (`tasks:`) with the rule that mixes them (`task_mix:`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from regen.config.base import Section


class TaskConfig(Section):
    """Options of the built-in synthetic arithmetic task."""

    digits: int = Field(2, ge=1, le=6, description="Operands have at most this many digits.")
    test_size: int = Field(500, ge=1, description="Prompts held out from all training (the eval split).")
    demo_noise: float = Field(
        0.4, ge=0.0, le=1.0, description="Fraction of SFT demonstrations whose answer is corrupted."
    )
    known_synonyms: list[Literal["colour", "shape", "position"]] = Field(
        default_factory=list, description="`regen sft` on builtin:shapes-paraphrase: attributes whose synonyms "
        "the enhancer's demonstrations translate truly ('crimson' -> 'red'); the others' synonyms get random "
        "targets, so their meaning is left to RL through the images. [] (default): every synonym is left to RL.")


class RewardTerm(Section):
    name: str = Field(description="Registered reward name (see `regen rewards`) or 'package.module:function'.")
    weight: float = Field(1.0, description="Weight of this term in the total reward.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the function.")


TASK_NAME = re.compile(r"[A-Za-z0-9_-]{1,40}")  # it names metrics (task/NAME/...) and sample files


class TaskStream(Section):
    """One task of a multi-task run: its prompts, held-out prompts, reward terms and weight."""

    train: str = Field(description="Training prompts of this task, in the formats of data.train.")
    eval: str | None = Field(None, description="Held-out prompts of this task (eval/NAME/* metrics); null: none.")
    reward: list[RewardTerm] = Field(min_length=1, description="Reward terms of this task, summed with weights.")
    weight: float = Field(1.0, gt=0.0, description="Share of the prompt draws (normalised over the tasks); with "
                          "task_mix.weights=dynamic, the prior that task_mix.floor keeps.")
    task: TaskConfig | None = Field(None, description="Built-in data of this stream (builtin:arithmetic): its "
                                    "options (digits, test_size); null = the run's task section.")


    @model_validator(mode="after")
    def _no_demos(self) -> TaskStream:
        for key in ("demo_noise", "known_synonyms"):
            if self.task is not None and key in self.task.model_fields_set:
                raise ValueError(f"task.{key}: demonstrations are for `regen sft`; a task stream's prompts "
                                 "carry the true answers")
        return self


class TaskMixConfig(Section):
    """How the prompts of a step are drawn from the task streams (multi-task runs only)."""

    weights: Literal["static", "dynamic"] = Field(
        "static", description="'static': each task's share is its weight. 'dynamic': re-weighted each step by "
        "learning progress, |fast EMA - slow EMA| of the task's mean training reward (Kanitscheider et al. 2021, "
        "arXiv:2106.14876; absolute, so a task being forgotten is drawn too, as in Matiisen et al. 2017's TSCL): "
        "p = floor * weight / sum(weight) + (1 - floor) * LP / sum(LP); the static weights while no progress is "
        "measured. Logged as task/NAME/weight.")
    fast_rate: float = Field(0.2, gt=0.0, le=1.0, description="dynamic: rate of the fast reward EMA per step.")
    slow_rate: float = Field(0.05, gt=0.0, le=1.0, description="dynamic: rate of the slow reward EMA (< fast_rate).")
    floor: float = Field(0.2, gt=0.0, le=1.0, description="dynamic: share of the draws kept at the static "
                         "weights, so a task without measured progress is still sampled and re-measured.")

    @model_validator(mode="after")
    def _rates(self) -> TaskMixConfig:
        if self.slow_rate >= self.fast_rate:
            raise ValueError(f"task_mix.slow_rate={self.slow_rate} must be below task_mix.fast_rate={self.fast_rate}")
        return self


def check_task_names(tasks: dict[str, TaskStream] | None) -> dict[str, TaskStream] | None:
    if tasks is None:
        return None
    if not tasks:
        raise ValueError("tasks: give at least one task stream, or leave tasks out (null) for a single-task run")
    for name in tasks:
        if not TASK_NAME.fullmatch(name):
            raise ValueError(f"tasks.{name}: a task name is 1-40 letters, digits, '_' or '-' (it names metrics "
                             "and sample files)")
    return tasks

