"""The modality adapter: what the one RL loop (regen/train/loop.py) asks of a kind of model.

A modality turns the loop's five stages into work on its models: language models (lm.py:
token sequences) and flow-matching image / video models (flow.py: denoising trajectories and
clean samples) implement the same small protocol; a new modality is one more file here. The
loop, the update (regen/modalities/update.py), the run's books (regen/train/run.py) and every
placement (regen/placement/) see only these methods:

  1. sample     plan(gen, step)          the step's randomness for the whole batch, drawn up front
                inputs(items)            what sample takes of the prompt items (text; VLMs: and images)
                sample(prompts, n, plan)  n samples per prompt, on whichever process samples
                concat(parts)             one batch from the shares of several processes
  2. score      reward_samples(items, b)  what the reward functions see
                shape_rewards(r, parts, b)  method terms added to the reward (DAPO's overlong)
                fixed_terms(b)            what stays fixed during the update, computed while scoring
                behaviour_terms(b, fixed)  the same, from the weights that sampled a late batch (Ray)
  3. advantage  advantages(r, b, fixed)   -> Advantages
  4. update     update(opt, ...)           the optimizer steps (regen/modalities/update.py), which ask
                minibatch(...), micro_loss(mini, pos), aux_step(...)
                after_update(step)        slow copies follow the weights (NFT's old policy, EMA)
  5. sync       the placement pushes `trained`'s tensors (sync_state) to the samplers
  books         gather / save / restore / export, evaluate, frozen (parked while sampling)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from regen.rewards import Sample


@dataclass
class Advantages:
    """Stage 3's result: what the update trains on."""

    adv: torch.Tensor  # (B,) per sample, or (B, T) per token / step
    valid: torch.Tensor  # (B,) bool: the sample has a reward and a group to compare with
    mask: torch.Tensor  # (B, T) float: what the loss averages over (tokens, SDE steps) of valid samples
    metrics: dict = field(default_factory=dict)  # missing_frac, zero_std_frac, ...
    returns: torch.Tensor | None = None  # (B, T) PPO's value targets
    values: torch.Tensor | None = None  # (B, T) PPO's critic values before the update
    weights: torch.Tensor | None = None  # (B,) per-sample loss weights (NFT on binary labels: balanced sets)


class Modality:
    """The protocol; see the module docstring. Subclasses: LMModality, FlowModality."""

    kind = "?"
    METRICS: dict = {}  # algorithm metrics every metrics row holds, with these values when not computed
    PER_MODEL_LR = False  # a joint run logs each model's learning rate (NAME/lr) instead of the run's "lr"
    unit = 1  # rows kept together when minibatches are shuffled (LM: whole groups when they fit)
    share = 1  # rows kept together when a minibatch is split over ranks

    # ---- built by the run (regen/train/run.py)
    @property
    def trained(self) -> torch.nn.Module:
        """The module the optimizer steps (DDP / FSDP2 act on it; checkpoints save it)."""
        raise NotImplementedError

    def optimizer(self, optim) -> torch.optim.Optimizer:
        """The optimizer of `trained` (a joint run: one parameter group per model)."""
        from regen.runtime.optim import make_optimizer

        return make_optimizer(self.trained, optim)

    def frozen(self) -> tuple[list, list]:
        """(optimizers, modules) that sampling does not use: parked in CPU memory with train.offload."""
        return [], []

    def sampler_sleep(self) -> None:
        """distributed.colocate, before the update: a rollout engine with memory of its own (vLLM)
        hands it back. The trained model sampling for itself holds nothing between phases."""

    def sampler_wake(self) -> None:
        """distributed.colocate, after the update: the engine takes its memory back (the new weights
        are loaded into it next)."""

    # ---- 1. sample
    def plan(self, gen: torch.Generator, step: int):
        raise NotImplementedError

    def inputs(self, items) -> list:
        """What `sample` takes for these prompt items (their text; a VLM adds their images)."""
        return [it.prompt for it in items]

    def sample(self, prompts: list, n: int, plan, behaviour: bool = False):
        raise NotImplementedError

    def concat(self, parts: list):
        raise NotImplementedError

    def sync_state(self) -> dict[str, torch.Tensor]:
        """The trained tensors a sampler elsewhere needs (LoRA: the adapter only), on the CPU."""
        raise NotImplementedError

    def sync_local(self, step: int) -> dict[str, float]:
        """Sampling in this process: hand the new weights to a separate engine (vLLM), if any."""
        return {}

    def take_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A rollout actor: one bucket of the trainer's tensors (sync_state's names) into its sampler."""
        _, unexpected = self.trained.load_state_dict(state, strict=False)  # copy_ casts bf16 to the model's dtype
        if unexpected:
            raise ValueError(f"rollout worker: weights it does not have: {unexpected[:3]}")

    def weights_taken(self) -> None:
        """A rollout actor: every bucket of a sync is in (an engine may now refresh caches)."""

    # ---- 2. score
    def reward_samples(self, items, batch) -> list[Sample]:
        raise NotImplementedError

    def shape_rewards(self, rewards: torch.Tensor, parts: dict, batch) -> tuple[torch.Tensor, dict]:
        return rewards, parts

    def fixed_terms(self, batch) -> dict:
        return {}

    def behaviour_terms(self, batch, fixed: dict) -> dict:
        return fixed

    # ---- 3. advantage
    def advantages(self, rewards: torch.Tensor, batch, fixed: dict) -> Advantages:
        raise NotImplementedError

    # ---- 4. update
    def update(self, opt, batch, adv: Advantages, fixed: dict, gen: torch.Generator, step: int, prec=None,
               d=None) -> dict[str, float]:
        """The step's optimizer steps (regen/modalities/update.py) with this modality's config; a joint
        run updates each of its models with its own."""
        from regen.modalities.update import update

        return update(self, opt, batch, adv, fixed, self.cfg, gen, step, prec, d)

    def minibatch(self, batch, idx: torch.Tensor, adv: Advantages, fixed: dict, gen: torch.Generator):
        raise NotImplementedError

    def micro_loss(self, mini, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def before_step(self, mini, params: list[torch.Tensor]):
        """Before a minibatch's optimizer step: what after_step needs to bound it, or None (no bound)."""
        return None

    def after_step(self, mini, params: list[torch.Tensor], before) -> dict[str, float]:
        """After the step (when before_step gave something): bound it in place; its metrics, the
        same on every rank."""
        return {}

    def aux_step(self, batch, idx: torch.Tensor, adv: Advantages) -> dict[str, float]:
        """A second model stepped on the same minibatch (PPO's critic); {} when there is none."""
        return {}

    def trains_policy(self, step: int) -> bool:
        return True

    def set_lr(self, lr: float) -> None:
        """The step's learning rate reached the policy's optimizer; a second model follows it."""

    def update_metrics(self, adv: Advantages) -> dict[str, float]:
        """Metrics of a step that updated (PPO: the critic's explained variance)."""
        return {}

    def after_update(self, step: int) -> None:
        pass

    def batch_metrics(self, batch) -> dict[str, float]:
        return {}

    # ---- books
    def gather(self):
        """Everything a checkpoint or an export writes, gathered from FSDP2 shards (a collective:
        every rank calls it); None where nothing is sharded."""
        return None

    def save(self, folder: Path, gathered) -> None:
        """Write the weights into folder/model (and any extra state into folder)."""
        raise NotImplementedError

    def restore(self, folder: Path | None) -> None:
        """Weights and extra state back to checkpoint `folder` (None: the starting model)."""
        raise NotImplementedError

    def export(self, folder: Path, gathered) -> None:
        raise NotImplementedError

    def evaluate(self, items, reward, run_dir: Path, step: int, quality=None, task: str | None = None
                 ) -> dict[str, float]:
        """eval/* metrics of the held-out `items`: each reward term, and `quality` (regen.quality.Quality,
        eval.metrics) called on the same samples. task: a multi-task run's task, whose kept samples
        join the other tasks' of the same step (regen/modalities/lm_eval.py: write_samples)."""
        raise NotImplementedError

    def close(self) -> None:
        pass
