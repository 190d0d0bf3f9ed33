"""Online RL training: loop.py (the five stages, once), run.py (the books: start, resume,
checkpoints, rollback, health, alerts, mirror, export), update.py (minibatch x micro-batch
accumulation), dynamic_sampling.py (DAPO's refill of groups without signal)."""

from regen.train.loop import train

__all__ = ["train"]
