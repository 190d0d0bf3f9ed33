"""The randomness of one flow rollout step, drawn once for the whole batch (FlowPlan), so that any
process sampling a slice of the batch (torchrun ranks, Ray rollout actors) draws exactly its rows."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from regen.policies.flow import draw_noise


@dataclass
class FlowPlan:
    """The randomness of one step's sampling, for the whole batch: which steps are SDE steps,
    and the noise (x_T, then one tensor per SDE step) drawn in that order from the run's
    generator. A share of the batch takes its rows (select). Shipped to a rollout actor, only
    the generator state travels and the actor draws the same tensors again (cheap to send)."""

    sde: torch.Tensor  # (S,) bool
    state: torch.Tensor  # the generator's state before the draws
    total: int  # rows of the whole batch
    shape: tuple
    rows: torch.Tensor | None = None  # this share's rows; None = all
    drawn: tuple | None = field(default=None, repr=False)  # (x_T, [eps]) of the whole batch

    @classmethod
    def draw(cls, gen: torch.Generator, sde: torch.Tensor, total: int, shape: tuple) -> FlowPlan:
        state = gen.get_state()
        return cls(sde, state, total, tuple(shape), None, draw_noise(gen, total, shape, sde))

    def select(self, rows: torch.Tensor) -> FlowPlan:
        return replace(self, rows=rows if self.rows is None else self.rows[rows])

    def cpu(self) -> FlowPlan:
        return self  # drawn on the CPU

    def noise(self) -> tuple:
        if self.drawn is None:
            gen = torch.Generator().manual_seed(0)
            gen.set_state(self.state)
            self.drawn = draw_noise(gen, self.total, self.shape, self.sde)
        x, eps = self.drawn
        pick = (lambda t: t) if self.rows is None else (lambda t: t[self.rows])  # noqa: E731
        return pick(x), [None if e is None else pick(e) for e in eps]

    def __getstate__(self):  # to a rollout actor: the state, not the tensors
        return {**self.__dict__, "drawn": None}
