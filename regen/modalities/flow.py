"""Flow-matching image and video models behind the modality protocol (regen/modalities/base.py):
Flow-GRPO, Flow-DPPO, DiffusionNFT, AWM and DGPO.

What a flow method trains on differs in kind from a token sequence, which is why the work of
each stage differs while the loop does not:
  sample     n images (videos) per prompt: SDE steps where a per-step method trains on them (the
             rest ODE), noise drawn up front for the whole batch (regen/modalities/flow_plan.py)
  fixed      per-step methods (flow_grpo, flow_dppo): the behaviour policy's log-probs and
             Gaussian means of each SDE step and the reference's means (for the KL)
  advantage  Flow-GRPO's group advantage, clipped (std per group, per batch, or none); nft and
             dgpo take binary labels and pairwise win rates as they are (algorithm.reward_type)
  update     flow_grpo / flow_dppo: the clipped ratio / KL trust region over re-scored SDE
             transitions (T = steps); nft / awm / dgpo: clean samples pushed back through the
             forward process at a random t, no likelihood at all (dgpo: one t and noise per group)
The math: regen/algorithms/flow.py and flow_preference.py; the model: regen/policies/flow.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from regen.algorithms.flow import ema_update_, flow_group_advantages, nft_ema_decay
from regen.algorithms.flow_preference import binary_advantages, pairwise_advantages
from regen.algorithms.losses import batch_denominators
from regen.config.registry import load, method
from regen.errors import ConfigError
from regen.modalities.base import Advantages, Modality
from regen.modalities.flow_copies import (  # noqa: F401  (build_policy: re-exported)
    build_policy,
    frozen_copy,
    plain_copy,
    reload_copy,
    trained_pairs,
)
from regen.modalities.flow_eval import EVAL_SEED_OFFSET, to_samples  # noqa: F401  (re-exported)
from regen.modalities.flow_plan import FlowPlan
from regen.policies.flow import FlowSample
from regen.policies.flow_lora import BaseView, merged, save_adapter, swapped, trainable_state
from regen.rewards import Sample
from regen.runtime.dist import Dist
from regen.samplers.flow import sde_steps, window_start

NFT_OLD, WEIGHT_EMA = "nft_old.safetensors", "weight_ema.safetensors"  # in each checkpoint


@dataclass
class FlowMinibatch:
    batch: FlowSample
    idx: torch.Tensor
    adv: Advantages
    fixed: dict
    denoms: dict
    noise: tuple | None  # the ODE methods' (t (M,), eps (M, *x)), drawn for the whole minibatch
    weights: torch.Tensor | None = None  # dgpo: each row's group weight, when micro-batches split groups
    seen: list | None = None  # flow.trust_region: (positions, velocities before the step) of each micro-batch


class FlowModality(Modality):
    kind = "flow"

    def __init__(self, cfg, device: torch.device, dist: Dist, state: dict | None = None, alerts=None,
                 sampler_only: bool = False):
        self.cfg, self.device, self.dist, self.alerts = cfg, device, dist, alerts
        self.gen_device = torch.device("cpu")  # noise is drawn on the CPU (the same on any device)
        self._sde: dict[int, torch.Tensor] = {}  # each planned step's SDE steps (dynamic sampling reuses them)
        f = cfg.flow
        spec = method(cfg.algorithm.name)  # its declaration (regen/config/flow_methods.py) names its code
        self.method = load(spec.impl)(self)
        self.per_step, self.unit = spec.stochastic, self.method.unit  # per step: trained on re-scored SDE steps
        folder = None if state is None else state["folder"]
        self.policy = build_policy(cfg, device, None if state is None or sampler_only else state["model_dir"])
        self.ref = self.ema = self.weight_ema = None
        self.base_samples: dict[str | None, list] = {}  # reward_type=pairwise: the starting model's held-out samples
        if sampler_only:
            self.policy.unet.eval()
            return
        if spec.needs("uses_base", cfg):  # the run's starting model, also after a resume
            if cfg.model.lora is not None:
                self.ref = BaseView(self.policy.unet)  # the base is the network with its adapter off: no copy
            else:
                start = self.policy if state is None else build_policy(cfg, device)
                self.ref = copy.deepcopy(start.unet).eval().requires_grad_(False)
        self.ema = frozen_copy(self.policy.unet, folder, NFT_OLD, alerts) if spec.needs("uses_ema", cfg) else None
        self.weight_ema = frozen_copy(self.policy.unet, folder, WEIGHT_EMA, alerts) if f.weight_ema is not None \
            else None
        if cfg.train.gradient_checkpointing:
            self.policy.unet.enable_gradient_checkpointing()  # diffusers: recompute in backward
        if dist.on:  # the update's forwards go through DDP's wrapper; FSDP2 shards in place
            wrapped = dist.wrap(self.policy.unet, unused=getattr(self.policy, "UNUSED_PARAMETERS", False))
            self.policy.ddp_unet = wrapped if wrapped is not self.policy.unet else None
            if dist.sharded:  # frozen copies sharded alike, so the EMAs update shard by shard
                for net in (self.ref, self.ema, self.weight_ema):
                    if isinstance(net, torch.nn.Module):
                        dist.wrap(net, trainable=False)
        self.single_pass = cfg.train.ppo_epochs == 1 and cfg.train.global_minibatch_size == \
            cfg.rollout.global_batch_size

    @property
    def trained(self) -> torch.nn.Module:
        return self.policy.unet

    def frozen(self) -> tuple[list, list]:
        return [], [self.ref, self.ema, self.weight_ema]

    # ------------------------------------------------------------------ 1. sample

    def trained_steps(self, gen: torch.Generator, step: int) -> torch.Tensor:
        """(S,) bool: the SDE steps of this step's rollouts (none for the ODE methods)."""
        f = self.cfg.flow
        if not self.per_step:
            return torch.zeros(f.steps, dtype=torch.bool)
        if f.sde_window is None:
            return sde_steps(f.steps, "all")
        start = window_start(step - 1, f.steps, f.sde_window, f.window_policy, generator=gen,
                             shift_every=f.window_shift_every, start=f.window_start)
        return sde_steps(f.steps, "window", f.sde_window, start)

    def plan(self, gen: torch.Generator, step: int, again: bool = False) -> FlowPlan:
        """again: another sampling round of the same step (DAPO dynamic sampling): the same SDE
        steps, so that the rounds' samples form one batch."""
        sde = self._sde[step] if again else self.trained_steps(gen, step)
        self._sde = {s: v for s, v in self._sde.items() if s >= step - 1} | {step: sde}
        return FlowPlan.draw(gen, sde, self.cfg.rollout.global_batch_size, self.policy.sample_shape)

    def sample(self, prompts: list[str], n: int, plan: FlowPlan, behaviour: bool = False) -> FlowSample:
        """behaviour: also keep each SDE step's Gaussian mean (for batches trained on after the
        weights moved: Flow-DPPO's trust region is measured against the sampling weights)."""
        f = self.cfg.flow
        with self.dist.unsharded(self.policy.unet):  # FSDP2: gathered once, not at every denoising step
            return self.policy.rollout(prompts, n, plan.noise(), f.steps, plan.sde, f.noise_level, f.sampler,
                                       f.shift, f.guidance, keep_states=bool(plan.sde.any()),
                                       keep_means=behaviour and bool(plan.sde.any()), solver=f.solver)

    def concat(self, parts: list[FlowSample]) -> FlowSample:
        return FlowSample.concat([p.to(self.device) for p in parts])

    def sync_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu") for k, v in trainable_state(self.policy.unet).items()}  # LoRA: adapter

    def sync_local(self, step: int) -> dict[str, float]:
        return {}  # the sampler is the trained model

    # ------------------------------------------------------------------ 2. score

    def reward_samples(self, items, batch: FlowSample) -> list[Sample]:
        """The prompt, its row's attributes, and the pixels as uint8 (the policy decodes latents;
        (H, W, 3) images, (F, H, W, 3) videos)."""
        return to_samples(self.policy, batch, items, self.cfg.rollout.group_size)

    @torch.no_grad()
    def fixed_terms(self, batch: FlowSample) -> dict:
        """Per-step methods: the behaviour policy's log-probs and means (needed only after the first
        pass over the batch) and the reference's means for the KL. Under torchrun each rank
        computes its rows; all ranks get all."""
        c, d = self.cfg, self.dist
        f = c.flow
        out: dict = {}
        if not self.per_step:
            return out
        mine = batch.select(d.my_rows(torch.arange(len(batch.prompts))))
        if not self.single_pass:
            logp, means, _ = self.policy.step_logprobs(mine, f.noise_level, f.sampler, f.guidance)
            out["logp"], out["means"] = d.gather_rows(logp), _gather_means(means, d)
        if self.ref is not None:
            means = self.policy.step_logprobs(mine, f.noise_level, f.sampler, f.guidance, unet=self.ref)[1]
            out["ref_means"] = _gather_means(means, d)
        return out

    def behaviour_terms(self, batch: FlowSample, fixed: dict) -> dict:
        """A batch sampled with older weights (Ray, max_staleness >= 1): the ratio and the trust
        region are taken against the sampling weights' log-probs and means, returned with it."""
        if not self.per_step:
            return fixed  # NFT / AWM train on clean samples: any sampler's are fine
        return {**fixed, "logp": batch.log_probs.to(self.device), "means": batch.means}

    # ------------------------------------------------------------------ 3. advantage

    def advantages(self, rewards: torch.Tensor, batch: FlowSample, fixed: dict) -> Advantages:
        c = self.cfg
        a = c.algorithm
        adv, valid, m = flow_group_advantages(rewards, c.rollout.group_size, a.std_normalize, c.flow.adv_clip)
        weights = None
        if a.reward_type != "scalar":  # labels used as they are, not normalised as if they were scalars
            try:
                adv, valid = (binary_advantages(rewards, c.rollout.group_size) if a.reward_type == "binary"
                              else pairwise_advantages(rewards))
            except ValueError as e:  # the reward terms do not give labels of that form
                raise ConfigError(f"{e} (reward: {', '.join(t.name for t in c.reward)})") from None
            adv, weights = self.method.from_labels(rewards, adv, valid)
        adv, valid = adv.to(self.device), valid.to(self.device)
        mask = (batch.sde.to(self.device)[None, :] & valid[:, None]).float() if self.per_step \
            else valid[:, None].float()
        return Advantages(adv, valid, mask, m, weights=None if weights is None else weights.to(self.device))

    # ------------------------------------------------------------------ 4. update

    def minibatch(self, batch: FlowSample, idx, adv: Advantages, fixed: dict, gen) -> FlowMinibatch:
        mini = FlowMinibatch(batch, idx, adv, fixed, batch_denominators(adv.mask[idx]),
                             self.method.noise(len(idx), batch, gen), seen=[] if self.bounded else None)
        self.method.prepare(mini)
        return mini

    @property
    def bounded(self) -> bool:
        """flow.trust_region on an ODE method (nft, awm, dgpo): each optimizer step is bounded."""
        return self.cfg.flow.trust_region is not None and not self.per_step

    def before_step(self, mini: FlowMinibatch, params):
        return [p.detach().clone() for p in params] if self.bounded else None

    def after_step(self, mini: FlowMinibatch, params, before) -> dict[str, float]:
        return self.method.bound_step(mini, params, before)

    def micro_loss(self, mini: FlowMinibatch, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) of the minibatch rows at positions `pos`: the method's loss."""
        return self.method.loss(mini, pos)

    def after_update(self, step: int) -> None:
        """NFT's old policy (AWM's anchor) and the weight EMA move toward the new weights."""
        f = self.cfg.flow
        if self.ema is not None:  # DiffusionNFT's old policy follows the new one slowly
            ema_update_(*trained_pairs(self.ema, self.policy.unet), nft_ema_decay(step, f.ema_rate, f.ema_max))
        if self.weight_ema is not None:
            ema_update_(*trained_pairs(self.weight_ema, self.policy.unet), f.weight_ema)

    def batch_metrics(self, batch: FlowSample) -> dict[str, float]:
        return {"sde_steps": float(batch.sde.sum())}

    # ------------------------------------------------------------------ books

    def _copies(self):
        return ((NFT_OLD, self.ema), (WEIGHT_EMA, self.weight_ema))

    def gather(self):
        """Under FSDP2 the full weights of the network and of its EMA copies (collective)."""
        d = self.dist
        if not d.sharded:
            return None
        return d.full_model_state(self.policy.unet), {name: d.full_model_state(net) for name, net in self._copies()
                                                      if net is not None}

    def save(self, folder: Path, gathered) -> None:
        weights, copies = gathered or (None, {})
        model_dir = folder / "model"
        if self.cfg.model.lora is not None:
            save_adapter(self.policy.unet, model_dir, self.cfg.model.lora)  # the base is model.path
        else:
            with swapped(self.policy, plain_copy(self.policy.unet, weights)):
                self.policy.save_pretrained(model_dir)
        for name, net in self._copies():
            if net is not None:
                state = copies[name] if name in copies else trainable_state(net)
                save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(folder / name))

    def restore(self, folder: Path | None) -> None:
        """Weights, NFT's old policy and the weight EMA back to checkpoint `folder` (or the start)."""
        back = build_policy(self.cfg, self.device, None if folder is None else folder / "model")
        self.dist.load_model_state(self.policy.unet, back.unet.state_dict())
        for name, net in self._copies():
            if net is not None:
                reload_copy(net, self.policy.unet, folder, name, self.alerts, self.dist)

    def export(self, folder: Path, gathered) -> None:
        """The weight EMA when kept, LoRA merged in (loads without peft)."""
        net = self.weight_ema if self.weight_ema is not None else self.policy.unet
        if gathered is not None:  # FSDP2: an unsharded copy from the gathered weights
            weights, copies = gathered
            net = plain_copy(net, copies.get(WEIGHT_EMA, weights) if self.weight_ema is not None else weights)
        with swapped(self.policy, merged(net) if self.cfg.model.lora is not None else net):
            self.policy.export(folder)

    def evaluate(self, items, reward, run_dir: Path, step: int, quality=None, task: str | None = None
                 ) -> dict[str, float]:
        from regen.modalities.flow_eval import evaluate_flow

        return evaluate_flow(self, items, reward, run_dir, step, quality, task)


def _gather_means(means: list, d: Dist) -> list:
    return [None if m is None else d.gather_rows(m) for m in means]
