"""Faults the tests inject into the loop, in this process (tests/conftest.py) or in a process
that must really die (tests/fault_entry.py)."""


def nan_update(real_update, steps):
    """`update` of regen/modalities/update.py (every modality's optimizer steps go through it) with the
    loss NaN at these RL steps (by step, so a resumed run sees the same steps fail)."""

    def update(m, *args, **kw):
        if args[6] not in steps:  # update(m, opt, batch, adv, fixed, cfg, gen, step, ...)
            return real_update(m, *args, **kw)
        real_loss = m.micro_loss
        m.micro_loss = lambda mini, pos: (lambda out: (out[0] * float("nan"), out[1]))(real_loss(mini, pos))
        try:
            return real_update(m, *args, **kw)
        finally:
            del m.micro_loss  # the class's again

    return update
