"""Where a flow run's images (videos) are sampled: `run.rollout.sample(items, gen, sde)`, then
`run.rollout.sync(step)` after the update, the same two calls in every placement:

- LocalFlowRollouts: this process (under torchrun: each rank its groups, gathered; see
  regen/flow_loop.py `sample`);
- RayFlowRollouts (`distributed.mode: ray`): rollout actors each draw their groups. Every
  actor starts from the trainer's generator state and draws the noise of the whole batch,
  keeping its rows, so the batch is the one a single process would sample with the same
  weights; the trainer then advances its generator by the same draws. Weights (LoRA: the
  adapter only) go to the actors after each update with a version, as for language models
  (regen/ray_rollout.py); a dead actor is replaced and its share sampled again.
"""

from __future__ import annotations

import torch

from regen.policies.flow import FlowPolicy, FlowSample
from regen.ray_workers import TakesWeights
from regen.rollout import group_rows


class LocalFlowRollouts:
    def __init__(self, policy: FlowPolicy, cfg, dist):
        self.policy, self.cfg, self.dist = policy, cfg, dist

    def sample(self, items, gen: torch.Generator, sde: torch.Tensor) -> FlowSample:
        from regen.flow_loop import sample

        return sample(self.policy, items, self.cfg, gen, sde, self.dist)

    def sync(self, step: int) -> dict[str, float]:
        return {}  # the sampler is the trained model

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class FlowRolloutWorker(TakesWeights):
    """A Ray actor (see regen/ray_workers.py): its own copy of the flow policy."""

    def __init__(self, cfg_tree: dict, threads: int):
        from regen.config import RLConfig
        from regen.flow_session import build_policy
        from regen.policies.lm import resolve_device
        from regen.runtime.precision import Precision

        torch.set_num_threads(threads)
        self.cfg = RLConfig.model_validate(cfg_tree)
        device = resolve_device("cuda" if torch.cuda.is_available() else "cpu")
        self.policy = build_policy(self.cfg, device)
        self.policy.unet.eval()
        self.precision = Precision(self.cfg.train.precision, device)

    def trained_net(self) -> torch.nn.Module:
        return self.policy.unet

    def sample(self, prompts: list[str], n: int, gen_state: torch.Tensor, sde: torch.Tensor, rows: torch.Tensor,
               total: int) -> FlowSample:
        if self.version < 0:
            raise RuntimeError("flow rollout worker asked to sample before any weights were sent")
        f = self.cfg.flow
        gen = torch.Generator().manual_seed(0)
        gen.set_state(gen_state)
        with self.precision.autocast():
            out = self.policy.rollout(prompts, n, gen, f.steps, sde, f.noise_level, f.sampler, f.shift, f.guidance,
                                      keep_states=bool(sde.any()), rows=rows, total=total)
        return out.to("cpu")

    def ready(self) -> bool:
        return True


class RayFlowRollouts:
    def __init__(self, policy: FlowPolicy, cfg, version: int):
        import ray

        from regen.ray_rollout import ActorGroup, for_actors, start_ray

        start_ray(cfg)
        d = cfg.distributed
        self.policy, self.cfg, self.version, self._weights = policy, cfg, version, None
        self.workers = ActorGroup(FlowRolloutWorker, d.rollout_workers, d.rollout_resources,
                                  (for_actors(cfg), d.actor_threads), "regen-flow-rollout", d.max_restarts,
                                  on_new=lambda a: ray.get(a.load_weights.remote(self._weights, self.version)))
        self.sync(version)

    def sample(self, items, gen: torch.Generator, sde: torch.Tensor) -> FlowSample:
        n = self.cfg.rollout.group_size
        total, state = len(items) * n, gen.get_state()
        shares = [s for s in torch.arange(len(items)).tensor_split(len(self.workers.actors)) if len(s)]
        args = [([items[g].prompt for g in s.tolist()], n, state, sde, group_rows(s, n), total) for s in shares]
        refs = [self.workers.call(i, "sample", *a) for i, a in enumerate(args)]
        parts = self.workers.get(refs, "sample", args)
        # the trainer's generator moves on by the draws the actors made from the same state
        torch.randn((total, *self.policy.sample_shape), generator=gen)
        for _ in range(int(sde.sum())):
            torch.randn((total, *self.policy.sample_shape), generator=gen)
        return FlowSample.concat(parts).to(self.policy.device)

    def sync(self, step: int) -> dict[str, float]:
        from regen.policies.flow_lora import trainable_state

        state = {k: v.detach().to("cpu") for k, v in trainable_state(self.policy.unet).items()}  # LoRA: adapter
        self._weights, metrics = self.workers.push(state, step)
        self.version = step
        return metrics

    def stats(self) -> dict[str, float]:
        return {"rollout/worker_restarts": float(self.workers.restarts)}

    def close(self) -> None:
        self.workers.close()
