"""The Ray actors of `distributed.mode: ray`: plain classes, turned into actors by
regen/placement/ray.py (so this file imports without Ray and reads like the rest of regen).

A RolloutWorker holds its own copy of the policy (the modality's sampler, built from the run's
config) and samples the groups it is given with the randomness it is given (the rows of the
step's plan), so its rows are exactly the rows one process would have sampled with the same
weights. Weights arrive through load_weights with a version (the trainer's step); each rollout
carries the version that sampled it, and the behaviour policy's terms (token log-probs, SDE
means) for the trainer to use when it gets the batch late. A RewardWorker scores samples with
the run's reward terms (a reward model on its own GPU, or a client of an HTTP reward service).
"""

from __future__ import annotations

import torch


class RolloutWorker:
    version = -1  # no weights from the trainer yet: sampling refuses until they come

    def __init__(self, cfg_tree: dict, threads: int):
        from regen.config import RLConfig
        from regen.modalities import modality_class
        from regen.policies.lm import resolve_device
        from regen.runtime.dist import Dist
        from regen.runtime.precision import Precision

        torch.set_num_threads(threads)
        cfg = RLConfig.model_validate(cfg_tree)
        device = resolve_device("cuda" if torch.cuda.is_available() else "cpu")
        self.m = modality_class(cfg)(cfg, device, Dist(), sampler_only=True)
        self.precision = Precision(cfg.train.precision, device)

    def load_weights(self, buckets: list, version: int) -> int:
        """Take the trainer's weights (all of them, or for LoRA the adapter's tensors only), one
        bucket at a time: object references, fetched here (regen/placement/sync.py), or dicts."""
        import ray

        for part in buckets:
            state = part if isinstance(part, dict) else ray.get(part)
            self.m.take_weights(state)  # the sampler's model, or straight into a vLLM engine
            del state
        self.m.weights_taken()
        self.version = version
        return version

    def join_group(self, host: str, port: int, tag: int, rank: int, world: int, backend: str, timeout_s: float) -> bool:
        """distributed.sync=collective: become rank `rank` of the trainer's weight group, generation
        `tag` (regen/placement/collective.py), leaving the last generation's group first."""
        from regen.placement.collective import connect

        self.group, self.backend = None, backend
        self.group = connect(host, port, tag, rank, world, backend, timeout_s)
        return True

    def recv_weights(self, buckets: list[tuple[list[str], list]], version: int) -> int:
        """distributed.sync=collective: the buckets (their names and layouts here, their bytes by
        broadcast from the trainer), each copied into the sampler as it arrives."""
        from regen.placement.collective import receive

        self.version = -1  # until the whole sync is in: a failed one must not sample with half of it
        for names, meta in buckets:
            self.m.take_weights(dict(zip(names, receive(self.group, meta, self.backend), strict=True)))
        self.m.weights_taken()
        self.version = version
        return version

    def sample(self, prompts: list[str], n: int, plan):
        if self.version < 0:
            raise RuntimeError("rollout worker asked to sample before any weights were sent")
        with self.precision.autocast():
            batch = self.m.sample(prompts, n, plan, behaviour=True).to("cpu")
        batch.version = torch.full((len(batch),), self.version, dtype=torch.long)
        return batch

    def ready(self) -> bool:
        return True


class RewardWorker:
    def __init__(self, cfg_tree: dict, threads: int):
        from regen.config import RLConfig
        from regen.rewards.tasks import build_reward

        torch.set_num_threads(threads)
        self.reward = build_reward(RLConfig.model_validate(cfg_tree))

    def score(self, samples: list) -> tuple[list[float], dict[str, list[float]]]:
        return self.reward(samples)

    def versions(self) -> dict[str, str]:
        return self.reward.versions()

    def stats(self) -> dict[str, float]:
        return self.reward.stats()

    def ready(self) -> bool:
        return True
