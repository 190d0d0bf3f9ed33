"""The Ray actors of `distributed.mode: ray`: plain classes, turned into actors by
regen/ray_rollout.py (so this file imports without Ray and reads like the rest of regen).

A RolloutWorker holds its own copy of the policy and samples the groups it is given with the
uniforms it is given, so its rows are exactly the rows one process would have sampled with
the same weights. Weights arrive through load_weights with a version (the trainer's step);
each rollout carries the version that sampled it. A RewardWorker scores samples with the
run's reward terms (a reward model on its own GPU, or a client of an HTTP reward service).
"""

from __future__ import annotations

import torch

from regen.policies.lm import LMRollout


def _torch_setup(threads: int) -> None:
    torch.set_num_threads(threads)


class TakesWeights:
    """What rollout actors share: the trainer's weights arrive with a version."""

    version = -1  # no weights from the trainer yet: sampling refuses until they come

    def trained_net(self) -> torch.nn.Module:
        raise NotImplementedError

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        """Take the trainer's weights: all of them, or (LoRA) the adapter's tensors only."""
        _, unexpected = self.trained_net().load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"{type(self).__name__}: weights it does not have: {unexpected[:3]}")
        self.version = version
        return version


class RolloutWorker(TakesWeights):
    def __init__(self, cfg_tree: dict, threads: int):
        from regen.config import RLConfig
        from regen.policies.lm import LMPolicy, apply_lora, load_model_and_tokenizer, resolve_device
        from regen.runtime.precision import Precision

        _torch_setup(threads)
        self.cfg = RLConfig.model_validate(cfg_tree)
        model, tok = load_model_and_tokenizer(self.cfg.model, self.cfg.task, self.cfg.run.seed)
        if self.cfg.model.lora is not None:
            model = apply_lora(model, self.cfg.model.lora)  # the trainer sends the adapter
        device = resolve_device("cuda" if torch.cuda.is_available() else "cpu")
        self.policy = LMPolicy(model, tok, device)
        self.policy.model.eval()
        self.precision = Precision(self.cfg.train.precision, device)

    def trained_net(self) -> torch.nn.Module:
        return self.policy.model

    def sample(self, prompts: list[str], n: int, uniforms: torch.Tensor) -> LMRollout:
        if self.version < 0:
            raise RuntimeError("rollout worker asked to sample before any weights were sent")
        r = self.cfg.rollout
        with self.precision.autocast():
            batch = self.policy.sample(prompts, n, r.temperature, r.top_p, r.max_new_tokens, None, uniforms=uniforms,
                                       with_logp=True)  # the behaviour policy's: for batches the trainer gets late
        batch = batch.to("cpu")
        batch.version = torch.full((len(batch.completions),), self.version, dtype=torch.long)
        return batch

    def ready(self) -> bool:
        return True


class RewardWorker:
    def __init__(self, cfg_tree: dict, threads: int):
        from regen.config import RLConfig
        from regen.rewards import CombinedReward

        _torch_setup(threads)
        self.reward = CombinedReward.from_config(RLConfig.model_validate(cfg_tree).reward)

    def score(self, samples: list) -> tuple[list[float], dict[str, list[float]]]:
        return self.reward(samples)

    def versions(self) -> dict[str, str]:
        return self.reward.versions()

    def stats(self) -> dict[str, float]:
        return self.reward.stats()

    def ready(self) -> bool:
        return True
