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

from regen.algorithms.flow import (
    awm_loss,
    ema_update_,
    flow_dppo_loss,
    flow_group_advantages,
    flow_grpo_loss,
    gaussian_mean_kl,
    nft_ema_decay,
    nft_loss,
    nft_optimality,
)
from regen.algorithms.flow_preference import binary_advantages, pairwise_advantages
from regen.algorithms.losses import batch_denominators
from regen.errors import ConfigError
from regen.modalities.base import Advantages, Modality
from regen.modalities.flow_copies import (  # noqa: F401  (build_policy: re-exported)
    build_policy,
    frozen_copy,
    plain_copy,
    reload_copy,
    trained_pairs,
)
from regen.modalities.flow_dgpo import dgpo_micro_loss, dgpo_weights
from regen.modalities.flow_eval import EVAL_SEED_OFFSET, to_samples  # noqa: F401  (re-exported)
from regen.modalities.flow_plan import FlowPlan
from regen.policies.flow import FlowSample
from regen.policies.flow_lora import BaseView, merged, save_adapter, swapped, trainable_state
from regen.rewards import Sample
from regen.runtime.dist import Dist
from regen.samplers.flow import sde_steps, window_start

PER_STEP = ("flow_grpo", "flow_dppo")  # trained on re-scored SDE transitions
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


class FlowModality(Modality):
    kind = "flow"

    def __init__(self, cfg, device: torch.device, dist: Dist, state: dict | None = None, alerts=None,
                 sampler_only: bool = False):
        self.cfg, self.device, self.dist, self.alerts = cfg, device, dist, alerts
        self.gen_device = torch.device("cpu")  # noise is drawn on the CPU (the same on any device)
        self._sde: dict[int, torch.Tensor] = {}  # each planned step's SDE steps (dynamic sampling reuses them)
        a, f = cfg.algorithm, cfg.flow
        folder = None if state is None else state["folder"]
        self.policy = build_policy(cfg, device, None if state is None or sampler_only else state["model_dir"])
        self.ref = self.ema = self.weight_ema = None
        self.base_samples: dict[str | None, list] = {}  # reward_type=pairwise: the starting model's held-out samples
        if sampler_only:
            self.policy.unet.eval()
            return
        needs_base = (a.name in ("flow_grpo", "nft") and a.kl_coef > 0) or (
            a.name == "dgpo" and (a.kl_coef > 0 or f.dgpo_ref == "base"))
        if needs_base:  # the run's starting model, also after a resume
            if cfg.model.lora is not None:
                self.ref = BaseView(self.policy.unet)  # the base is the network with its adapter off: no copy
            else:
                start = self.policy if state is None else build_policy(cfg, device)
                self.ref = copy.deepcopy(start.unet).eval().requires_grad_(False)
        slow = a.name == "nft" or (a.name == "awm" and a.kl_coef > 0) or (
            a.name == "dgpo" and (f.dgpo_ref == "ema" or a.clip_low is not None))
        self.ema = frozen_copy(self.policy.unet, folder, NFT_OLD, alerts) if slow else None
        self.weight_ema = frozen_copy(self.policy.unet, folder, WEIGHT_EMA, alerts) if f.weight_ema is not None \
            else None
        if cfg.train.gradient_checkpointing:
            self.policy.unet.enable_gradient_checkpointing()  # diffusers: recompute in backward
        if dist.on:  # the update's forwards go through DDP's wrapper; FSDP2 shards in place
            wrapped = dist.wrap(self.policy.unet)
            self.policy.ddp_unet = wrapped if wrapped is not self.policy.unet else None
            if dist.sharded:  # frozen copies sharded alike, so the EMAs update shard by shard
                for net in (self.ref, self.ema, self.weight_ema):
                    if isinstance(net, torch.nn.Module):
                        dist.wrap(net, trainable=False)
        self.per_step = a.name in PER_STEP
        if a.name == "dgpo":  # minibatches of whole groups: the weight is the group's
            self.unit = cfg.rollout.group_size
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
        if self.cfg.algorithm.name not in PER_STEP:
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
        return self.policy.rollout(prompts, n, plan.noise(), f.steps, plan.sde, f.noise_level, f.sampler, f.shift,
                                   f.guidance, keep_states=bool(plan.sde.any()),
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
            if a.name == "nft":  # r = the label / the win rate: nft_optimality(C * (2r - 1), C) == r
                if a.reward_type == "binary":
                    # each group's good and bad sets weigh alike: |A| = n / 2|G+-| of binary_advantages, 0 in a
                    # group whose labels agree (no preference). Unweighted, a group of good samples is r = 1 on
                    # every one and the model refits its own samples, which collapsed held-out adherence to
                    # 0.365 with 90 % good labels (bench/README, reward forms)
                    weights = adv.abs()
                adv = c.flow.adv_clip * (2.0 * torch.where(valid, rewards, 0.5) - 1.0)
        adv, valid = adv.to(self.device), valid.to(self.device)
        mask = (batch.sde.to(self.device)[None, :] & valid[:, None]).float() if self.per_step \
            else valid[:, None].float()
        return Advantages(adv, valid, mask, m, weights=None if weights is None else weights.to(self.device))

    # ------------------------------------------------------------------ 4. update

    def minibatch(self, batch: FlowSample, idx, adv: Advantages, fixed: dict, gen) -> FlowMinibatch:
        # the ODE methods' point of the forward process for each sample, drawn for the whole
        # minibatch so that micro-batching (and the rank split) never changes it
        if self.per_step:
            noise = None
        elif self.cfg.algorithm.name == "dgpo":  # one t and noise per group: its members compare at one point
            G = self.unit
            t = torch.rand(len(idx) // G, generator=gen).repeat_interleave(G)
            noise = (t, torch.randn((len(idx) // G, *batch.x0.shape[1:]), generator=gen).repeat_interleave(G, 0))
        else:
            noise = (torch.rand(len(idx), generator=gen), torch.randn((len(idx), *batch.x0.shape[1:]), generator=gen))
        mini = FlowMinibatch(batch, idx, adv, fixed, batch_denominators(adv.mask[idx]), noise)
        micro = self.cfg.train.micro_batch_size
        if self.cfg.algorithm.name == "dgpo" and (self.dist.on or (micro or len(idx)) < len(idx)):
            mini.weights = dgpo_weights(self, mini)  # micro-batches or ranks split the groups: weigh them first
        return mini

    def micro_loss(self, mini: FlowMinibatch, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) of the minibatch rows at positions `pos` for the configured method."""
        c = self.cfg
        a, f = c.algorithm, c.flow
        rows = mini.idx[pos]
        sub, adv, valid, fixed = mini.batch.select(rows), mini.adv.adv[rows], mini.adv.valid[rows], mini.fixed
        B = len(rows)
        if self.per_step:
            logp, means, stds = self.policy.step_logprobs(sub, f.noise_level, f.sampler, f.guidance)
            # first pass over a batch: the behaviour policy is the current one (ratio 1, KL 0)
            old = logp.detach() if "logp" not in fixed else fixed["logp"][rows]
            mask = mini.adv.mask[rows]
            if a.name == "flow_grpo":
                kl = _step_kl(means, _rows(fixed["ref_means"], rows), stds, B) if self.ref is not None else None
                return flow_grpo_loss(logp, old, adv, mask, a.clip_low, kl, a.kl_coef, mini.denoms,
                                      clip_high=a.clip_high)
            now = [None if m is None else m.detach() for m in means]
            old_means = _rows(fixed["means"], rows) if "means" in fixed else now
            return flow_dppo_loss(logp, old, adv, mask, _step_kl(now, old_means, stds, B), f.dppo_tau, mini.denoms)
        # ODE methods: a random point of the forward process for each clean sample
        x0 = sub.x0
        t, eps = (z[pos].to(self.device) for z in mini.noise)
        tt = t.view(B, *[1] * (x0.dim() - 1))
        xt = (1 - tt) * x0 + tt * eps
        cond = self.policy.encoder(sub.prompts)
        v = self.policy.velocity(xt, t, cond)
        if a.name == "nft":
            with torch.no_grad():
                v_old = self.policy.velocity(xt, t, cond, unet=self.ema)
                v_ref = None if self.ref is None else self.policy.velocity(xt, t, cond, unet=self.ref)
            r = nft_optimality(adv, f.adv_clip, valid)
            weights = None if mini.adv.weights is None else mini.adv.weights[rows]  # binary labels: balanced sets
            return nft_loss(v, v_old, x0, xt, t, r, f.nft_beta, denoms=mini.denoms, v_ref=v_ref, kl_coef=a.kl_coef,
                            weights=weights)
        if a.name == "dgpo":
            return dgpo_micro_loss(self, mini, pos, v, x0, xt, eps, t, cond)
        weight = None if f.awm_weight == "uniform" else f.awm_weight
        anchor = None
        if self.ema is not None:  # kl_coef > 0: the EMA anchor's velocity at the same point
            with torch.no_grad():
                anchor = self.policy.velocity(xt, t, cond, unet=self.ema)
        return awm_loss(v, x0, eps, t, adv, weight=weight, valid=valid, denoms=mini.denoms, v_anchor=anchor,
                        anchor_coef=a.kl_coef)

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


def _step_kl(means: list, other: list, stds: list[float], B: int) -> torch.Tensor:
    """(B, S) exact KL between the Gaussians of each SDE step (0 on ODE steps); `means` and
    `other` hold (B, *x) per SDE step and None on ODE steps."""
    kl = torch.zeros(B, len(means), device=next(m for m in means if m is not None).device)
    for i, (m, o) in enumerate(zip(means, other)):
        if m is not None:
            kl[:, i] = gaussian_mean_kl(m, o.to(m.device), stds[i], batch_dims=1)
    return kl


def _rows(means: list, rows) -> list:
    return [None if m is None else m[rows.to(m.device)] for m in means]
