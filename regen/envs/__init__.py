"""Environments: multi-turn episodes for language models (config section `env`).

An environment plays the other side of a conversation. regen starts one instance per episode
(each sampled completion of a prompt row), and drives it from wherever the episode is sampled
(the trainer, a torchrun rank, or a Ray rollout actor):

    env = MyEnv(**env.args)                      # `env.name: my_module:MyEnv`
    first = env.reset(row, seed)                 # the prompt: text, or chat messages
    loop:  the model writes a turn (until a stop token or rollout.max_new_tokens)
           step = env.step(turn_text)            # Step(observation, reward, done)
           the observation's tokens are appended (and masked out of every loss term)
    env.episode_reward()                         # the episode's score, or None

The episode's reward reaches the loss through the `env_reward` reward term (the per-turn
rewards plus episode_reward), so it can be weighted and combined with any other reward.
A built-in tool environment (regen/envs/tools.py) runs Python functions the model calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    """An environment's answer to one model turn."""

    observation: str | list[dict] | None = None  # text appended as it is, or messages rendered by the chat template
    reward: float = 0.0  # this turn's reward (summed into the episode's)
    done: bool = False  # the episode is over: the model writes no more turns
    info: dict[str, Any] = field(default_factory=dict)  # free-form; "tool_calls", "tool_errors", "tool_seconds" counted


class Environment:
    """The protocol (subclassing is optional: any class with reset and step works).

    reset(row, seed) -> the episode's first prompt: text (used as it is), or a list of
        {role, content} messages rendered with the model's chat template (data.chat_template).
        `row` is the prompt row (PromptItem: .prompt, .meta); `seed` is this episode's own,
        fixed by the step's plan, so a resumed run replays the same episode.
    step(turn) -> Step: the model's turn as text (its stop token removed).
    episode_reward() -> float | None: added to the per-turn rewards when the episode ends.
    tools: JSON-schema tool specs (OpenAI / Hugging Face format) the chat template shows, or None.
    """

    tools: list[dict] | None = None

    def reset(self, row, seed: int) -> str | list[dict]:
        raise NotImplementedError

    def step(self, turn: str) -> Step:
        raise NotImplementedError

    def episode_reward(self) -> float | None:
        return None


BUILTIN = {"tools": "regen.envs.tools:ToolEnv"}  # env.name shorthands


def import_object(spec: str, where: str):
    """The object a "module:attribute" string names (a user's module is found from the current
    folder and the config's folder, as reward modules are); ConfigError naming `where` otherwise."""
    import importlib

    from regen.errors import ConfigError

    spec = BUILTIN.get(spec, spec) if where == "env.name" else spec
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{where}: '{spec}' is not 'module:attribute'")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import module '{module}': {e}") from None
    if not hasattr(mod, attr):
        raise ConfigError(f"{where}: module '{module}' has no '{attr}'")
    return getattr(mod, attr)


def make_env(cfg_env):
    """A factory of fresh environments (one per episode) from the config's env section."""
    cls = import_object(cfg_env.name, "env.name")
    args = dict(cfg_env.args)

    def new():
        try:
            return cls(**args)
        except TypeError as e:
            from regen.errors import ConfigError

            raise ConfigError(f"env.args: {cfg_env.name} does not take these arguments ({e})") from None

    new()  # fail now, with the config's names, rather than mid-step
    return new
