"""Multi-task runs (config `tasks:`): the task streams, the weights that mix them, and the
sampler that draws each step's prompts from them.

Every prompt of a stream carries its task's name in meta['task'], which is how rewards are
routed to the task's own terms (regen/rewards/tasks.py) on every placement (in this process,
torchrun ranks, Ray reward actors), and how the loop's per-task metrics find their rows.

The sampler has EpochSampler's interface (take / state / load_state), so the placements,
DAPO's refill and exact resume treat it like the single-task one. Its draws are deterministic:
smooth weighted round-robin over the task weights, so over N draws a task's count stays
within one of N * its share (a multinomial draw would be off by sqrt(N)), and the order
inside each task is that task's own EpochSampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from regen.data import EpochSampler, PromptItem
from regen.errors import DataError


@dataclass
class Task:
    name: str
    prompts: list[PromptItem]
    eval_items: list[PromptItem]
    weight: float


def tag(items: list[PromptItem], name: str, where: str) -> list[PromptItem]:
    """The stream's items with meta['task'] = name; a row whose own 'task' field says otherwise
    is refused rather than overwritten."""
    for i, it in enumerate(items):
        own = it.meta.get("task", name)
        if own != name:
            raise DataError(f"{where}: row {i + 1} has a field 'task'={own!r}, but in a multi-task run meta['task'] "
                            f"names the stream ('{name}'); rename that field")
        it.meta["task"] = name
    return items


# ---------------------------------------------------------------- the weights (pure math)


def ema(prev: float | None, x: float, rate: float) -> float:
    """One step of an exponential moving average; the first value starts it (no zero-bias)."""
    return x if prev is None else prev + rate * (x - prev)


def progress_weights(base: list[float], fast: list[float | None], slow: list[float | None],
                     floor: float) -> list[float]:
    """Learning-progress task weights (Kanitscheider et al. 2021, arXiv:2106.14876, Sec. 3.2:
    progress = fast EMA - slow EMA of the task's success; taken in absolute value so that a
    task being forgotten is drawn too, as in Matiisen et al. 2017, TSCL):

        LP_i = |fast_i - slow_i|        (0 for a task not yet measured)
        p_i  = floor * b_i / sum(b) + (1 - floor) * LP_i / sum(LP)      (= b_i / sum(b) when sum(LP) = 0)

    b: the static weights. floor > 0 keeps every task drawn, so its progress keeps being measured."""
    total_b = sum(base)
    prior = [b / total_b for b in base]
    lp = [abs(f - s) if f is not None and s is not None else 0.0 for f, s in zip(fast, slow)]
    total_lp = sum(lp)
    if total_lp <= 0.0:
        return prior
    return [floor * p + (1.0 - floor) * x / total_lp for p, x in zip(prior, lp)]


def round_robin(credit: list[float], weights: list[float], k: int) -> tuple[list[int], list[float]]:
    """k task indices by smooth weighted round-robin (the nginx upstream balancer): each draw
    adds every task's share to its credit, takes the task with the most credit (the first on a
    tie) and takes 1 from it. Credits always sum to 0. Returns (picks, new credits)."""
    total = sum(weights)
    shares = [w / total for w in weights]
    credit = list(credit)
    picks = []
    for _ in range(k):
        credit = [c + s for c, s in zip(credit, shares)]
        j = max(range(len(credit)), key=lambda i: credit[i])
        credit[j] -= 1.0
        picks.append(j)
    return picks, credit


class TaskWeights:
    """The task weights of the run: static, or re-weighted by learning progress after each step
    (task_mix.weights=dynamic). Saved in checkpoints apart from the sampler's position, so
    rewinding a batch drawn ahead (Ray) does not undo what the rewards taught."""

    def __init__(self, names: list[str], base: list[float], mix):
        self.names, self.base, self.mix = names, base, mix
        self.fast: list[float | None] = [None] * len(names)
        self.slow: list[float | None] = [None] * len(names)

    def current(self) -> list[float]:
        if self.mix.weights == "static":
            total = sum(self.base)
            return [b / total for b in self.base]
        return progress_weights(self.base, self.fast, self.slow, self.mix.floor)

    def observe(self, means: dict[str, float]) -> None:
        """A step's mean training reward per task (tasks drawn this step, with a score)."""
        for i, name in enumerate(self.names):
            x = means.get(name)
            if x is not None and math.isfinite(x):
                self.fast[i] = ema(self.fast[i], x, self.mix.fast_rate)
                self.slow[i] = ema(self.slow[i], x, self.mix.slow_rate)

    def state(self) -> dict:
        return {"fast": list(self.fast), "slow": list(self.slow)}

    def load_state(self, state: dict) -> None:
        self.fast, self.slow = list(state["fast"]), list(state["slow"])


class TaskMix:
    """Draws prompt indices (into the concatenation of the streams' prompts) task by task."""

    def __init__(self, sizes: list[int], weights: TaskWeights, seed: int):
        self.weights = weights
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.streams = [EpochSampler(n, seed * 7919 + i) for i, n in enumerate(sizes)]
        self.credit = [0.0] * len(sizes)
        self.last = self.weights.current()  # the weights of the latest draw (logged)

    def take(self, k: int) -> list[int]:
        self.last = self.weights.current()
        picks, self.credit = round_robin(self.credit, self.last, k)
        return [self.offsets[t] + self.streams[t].take(1)[0] for t in picks]

    def state(self) -> dict:
        return {"streams": [s.state() for s in self.streams], "credit": list(self.credit)}

    def load_state(self, state: dict) -> None:
        if len(state.get("streams", ())) != len(self.streams):
            raise DataError(f"the checkpoint's data position has {len(state.get('streams', ())) or 'no'} task "
                            f"streams, this run {len(self.streams)}: resume it with the tasks it was started with")
        for s, st in zip(self.streams, state["streams"]):
            s.load_state(st)
        self.credit = [float(c) for c in state["credit"]]


def task_metrics(names: list[str], items: list[PromptItem], rewards) -> tuple[dict[str, float], dict[str, float]]:
    """A step's task/NAME/share (of its prompts) and task/NAME/reward (mean of its scored
    samples; NaN when none), and those means by task. rewards: (len(items) * group size,)."""
    n = len(rewards) // max(len(items), 1)
    metrics, means = {}, {}
    for name in names:
        groups = [g for g, it in enumerate(items) if it.meta.get("task") == name]
        got = [float(rewards[g * n + j]) for g in groups for j in range(n)]
        got = [x for x in got if math.isfinite(x)]
        means[name] = sum(got) / len(got) if got else math.nan
        metrics[f"task/{name}/share"] = len(groups) / max(len(items), 1)
        metrics[f"task/{name}/reward"] = means[name]
    return metrics, means
