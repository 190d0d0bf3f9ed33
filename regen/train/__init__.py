"""Online RL training: loop.py (the five stages, once), run.py (the books: start, resume,
checkpoints, rollback, health, alerts, mirror, export), start.py (what Run.start checks and reads),
dynamic_sampling.py (DAPO's refill of groups without signal), ray_trainers.py (the same loop in a
group of Ray trainer actors, distributed.trainer_workers > 1). The update stage every modality runs
is regen/modalities/update.py."""

from regen.train.loop import train

__all__ = ["train"]
