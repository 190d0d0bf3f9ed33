"""Bookkeeping of a flow-model RL run (the counterpart of `regen.session` for images and
videos): inputs checked, run directory prepared or resumed, checkpoints, held-out evaluation."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from regen.algorithms.flow import ema_update_, nft_ema_decay
from regen.config import RLConfig, dump_config
from regen.data import EpochSampler
from regen.errors import UserError
from regen.flow_rollout import LocalFlowRollouts
from regen.flow_sft import load_flow_policy, save_media
from regen.placement import SilentLog, check_split, prepare_on_rank0
from regen.policies.flow import FlowPolicy
from regen.policies.flow_lora import (
    BaseView,
    add_lora,
    load_adapter,
    load_state,
    merged,
    save_adapter,
    swapped,
    trainable_state,
)
from regen.policies.lm import resolve_device
from regen.rewards.sharded import ShardedReward
from regen.runtime import checkpoint as ckpt
from regen.runtime import dist as rdist
from regen.runtime.alerts import Alerts
from regen.runtime.health import HealthMonitor
from regen.runtime.metrics import MetricsLogger, nanmean
from regen.runtime.offload import PhaseHooks, loop_hooks
from regen.runtime.optim import make_optimizer
from regen.runtime.precision import Precision
from regen.runtime.rundir import mark_running, setup_torch
from regen.session import (
    RunBooks,
    begin_rollback,
    end_rollback,
    restore_books,
    resume_state,
    run_inputs,
    save_on_rank0,
    save_run_checkpoint,
)

NFT_OLD, WEIGHT_EMA = "nft_old.safetensors", "weight_ema.safetensors"  # in each checkpoint
EVAL_SEED_OFFSET = 7919  # held-out samples draw from their own stream: before/after on equal noise


@dataclass
class FlowRun(RunBooks):
    ref: torch.nn.Module | None  # frozen starting UNet, for flow_grpo's KL
    ema: torch.nn.Module | None  # DiffusionNFT's slowly moving old policy (AWM's EMA anchor)
    weight_ema: torch.nn.Module | None  # flow.weight_ema: the weights evaluated and exported
    hooks: PhaseHooks  # run at each phase change (train.offload parks state)
    precision: Precision  # train.precision: autocast and loss scaling
    dist: rdist.Dist = field(default_factory=rdist.Dist)  # torchrun rank / world size (single: rank 0 of 1)
    rollout: object = None  # where images are sampled: LocalFlowRollouts or RayFlowRollouts (flow_rollout.py)

    @classmethod
    def start(cls, cfg: RLConfig, resume: bool = False, force: bool = False) -> FlowRun:
        device = resolve_device(cfg.run.device)
        d = rdist.start(cfg.distributed.mode, cfg.distributed.strategy, cfg.distributed.backend, device)
        if d.sharded:
            raise UserError("distributed.strategy=fsdp: flow models are data parallel with ddp only for now")
        check_split(cfg, d)
        reward, prompts, eval_items = run_inputs(cfg)
        f = cfg.flow
        if f.sde_window is not None and f.window_start + f.sde_window > f.steps:
            raise UserError(f"flow.sde_window={f.sde_window} from flow.window_start={f.window_start} does not fit "
                            f"in flow.steps={f.steps}")
        run_dir, resume = prepare_on_rank0(cfg, resume, d)
        setup_torch(cfg.run.threads, cfg.run.seed)
        alerts = Alerts(run_dir, webhook_url=cfg.health.webhook_url)
        state = resume_state(cfg, run_dir, alerts, force) if resume else None
        folder = None if state is None else state["folder"]
        policy = build_policy(cfg, device, None if state is None else state["model_dir"])
        ref = None
        if cfg.algorithm.name == "flow_grpo" and f.kl_coef > 0:  # the run's starting model, also after a resume
            if cfg.model.lora is not None:
                ref = BaseView(policy.unet)  # the base is the network with its adapter off: no copy
            else:
                start = policy if state is None else build_policy(cfg, device)
                ref = copy.deepcopy(start.unet).eval().requires_grad_(False)
        slow = cfg.algorithm.name == "nft" or (cfg.algorithm.name == "awm" and f.awm_kl_coef > 0)
        ema = frozen_copy(policy.unet, folder, NFT_OLD, alerts) if slow else None
        weight_ema = frozen_copy(policy.unet, folder, WEIGHT_EMA, alerts) if f.weight_ema is not None else None
        if cfg.train.gradient_checkpointing:
            policy.unet.enable_gradient_checkpointing()  # diffusers: recompute in backward
        if d.on:  # DDP: the update's forwards go through the wrapper (FlowPolicy._net)
            policy.ddp_unet = d.wrap(policy.unet)
        opt = make_optimizer(policy.unet, cfg.optim)
        data = EpochSampler(len(prompts), cfg.run.seed)
        gen = torch.Generator().manual_seed(cfg.run.seed)
        health = HealthMonitor(cfg.health, alerts)
        start_step = restore_books(state, run_dir, opt, data, gen, health)
        if d.main:
            dump_config(cfg, run_dir / "config.yaml")
            mark_running(run_dir)
            log = MetricsLogger(run_dir, cfg.log, config=cfg, resume=state is not None,
                                warn=lambda step, m: alerts.fire(step, "logger_failed", m))
        else:
            cfg.log.progress, log = "none", SilentLog()  # rank 0 reports
        if cfg.distributed.mode == "ray":
            from regen.flow_rollout import RayFlowRollouts
            from regen.ray_rollout import RayReward

            reward, rollout = RayReward(cfg), RayFlowRollouts(policy, cfg, start_step)
        else:
            reward, rollout = ShardedReward(reward, d) if d.on else reward, LocalFlowRollouts(policy, cfg, d)
        return cls(cfg, run_dir, policy, opt, data, gen, reward, prompts, eval_items, log, alerts, health, start_step,
                   ref, ema, weight_ema, loop_hooks(cfg.train.offload, device, [opt], [ref, ema, weight_ema]),
                   Precision(cfg.train.precision, device), d, rollout)

    def save(self, step: int) -> Path | None:
        """Rank 0 writes (DDP keeps every rank's weights equal)."""
        return save_on_rank0(self, lambda: save_run_checkpoint(self, step, self._save_extra,
                                                               save_model=self._save_model))

    def _save_model(self, folder: Path) -> None:
        if self.cfg.model.lora is not None:
            save_adapter(self.policy.unet, folder, self.cfg.model.lora)  # the base is model.path
        else:
            self.policy.save_pretrained(folder)

    def _save_extra(self, folder: Path) -> None:
        for name, net in ((NFT_OLD, self.ema), (WEIGHT_EMA, self.weight_ema)):
            if net is not None:
                save_file({k: v.detach().cpu().contiguous() for k, v in trainable_state(net).items()},
                          str(folder / name))

    def follow(self, step: int) -> None:
        """After an update: NFT's old policy and the weight EMA move toward the new weights."""
        if self.ema is not None:  # DiffusionNFT's old policy follows the new one slowly
            f = self.cfg.flow
            ema_update_(*trained_pairs(self.ema, self.policy.unet), nft_ema_decay(step, f.ema_rate, f.ema_max))
        if self.weight_ema is not None:
            ema_update_(*trained_pairs(self.weight_ema, self.policy.unet), self.cfg.flow.weight_ema)

    def rollback(self, step: int) -> None:
        """Weights, optimizer, NFT's old policy and the weight EMA back to the last healthy
        checkpoint (or the starting model); the learning rate scaled down. Data and RNG streams
        keep moving forward, so the batches that went wrong are not replayed."""
        folder = begin_rollback(self, step)
        back = build_policy(self.cfg, self.policy.device, None if folder is None else folder / "model")
        self.policy.unet.load_state_dict(back.unet.state_dict())
        if folder is None:
            self.opt.state.clear()  # back to the start: a fresh optimizer
        else:
            self.opt.load_state_dict(ckpt.load_checkpoint(folder)["optimizer"])
        for name, net in ((NFT_OLD, self.ema), (WEIGHT_EMA, self.weight_ema)):
            if net is not None:
                reload_copy(net, self.policy.unet, folder, name, self.alerts)
        self.rollout.sync(step)  # rollout actors get the restored weights
        end_rollback(self, step, folder)

    def _close_more(self) -> None:
        self.rollout.close()
        if hasattr(self.reward, "close"):
            self.reward.close()

    def export(self, folder: Path) -> None:
        """The export folder: the weight EMA when kept, LoRA merged in (loads without peft)."""
        net = self.weight_ema if self.weight_ema is not None else self.policy.unet
        if self.dist.main:
            with swapped(self.policy, merged(net) if self.cfg.model.lora is not None else net):
                self.policy.export(folder)
        self.dist.barrier()

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out prompts, sampled with the ODE and fixed noise; mean reward of each term and
        the prompt adherence, with the first samples saved as PNG/GIF under samples/."""
        from regen.flow_loop import to_samples

        e, f = self.cfg.eval, self.cfg.flow
        items = self.eval_items[: e.num_prompts]
        gen = torch.Generator().manual_seed(self.cfg.run.seed + EVAL_SEED_OFFSET)
        net = self.policy.unet if self.weight_ema is None else self.weight_ema  # Flow-GRPO evaluates its EMA
        with swapped(self.policy, net):
            out = self.policy.sample_ode([it.prompt for it in items], e.samples_per_prompt, gen, f.eval_steps, f.shift,
                                         f.guidance)
        samples = to_samples(self.policy, out, items, e.samples_per_prompt)
        total, parts = self.reward(samples)
        metrics = {"eval/reward": nanmean(total), **{f"eval/{k}": nanmean(v) for k, v in parts.items()}}
        if all("colour" in it.meta for it in items):  # the built-in shapes: did it draw what was asked?
            from regen.rewards.adherence import AdherenceAccuracy

            # logged beside any reward, so a reward that is hacked (a flat colour) shows here
            metrics["eval/adherence_accuracy"] = nanmean(AdherenceAccuracy()(samples))
        if self.dist.main:
            save_media(self.run_dir, step, out, total, policy=self.policy)
        return metrics


def build_policy(cfg: RLConfig, device: torch.device, model_dir: Path | None = None) -> FlowPolicy:
    """The policy to train: the starting model, or a checkpoint's model/ (resume, rollback);
    with model.lora, the starting model plus a fresh adapter or the checkpoint's."""
    lora = cfg.model.lora
    source = cfg.model if model_dir is None or lora is not None else ckpt.resumed_model(cfg.model, {"model_dir": model_dir})
    policy = load_flow_policy(source, cfg.run.seed, device)
    if lora is not None:
        add_lora(policy.unet, lora, cfg.run.seed)
        if model_dir is not None:
            load_adapter(policy.unet, model_dir)
    # RL trains the velocity model only; the prompt encoder stays as pretrained, as text
    # encoders do in Flow-GRPO / DiffusionNFT. A moving encoder would also move NFT's
    # "old" policy (the EMA UNet reads the same prompt vectors).
    policy.encoder.requires_grad_(False)
    return policy


def frozen_copy(net: torch.nn.Module, folder: Path | None, name: str, alerts: Alerts) -> torch.nn.Module:
    """A frozen copy of `net` (NFT's old policy, the weight EMA), with the trained tensors saved
    as `name` in checkpoint `folder` when given; a checkpoint without them starts a new copy."""
    out = copy.deepcopy(net).eval().requires_grad_(False)
    if folder is not None:
        reload_copy(out, net, folder, name, alerts)
    return out


def reload_copy(out: torch.nn.Module, net: torch.nn.Module, folder: Path | None, name: str, alerts: Alerts) -> None:
    """Set the copy `out` from checkpoint `folder`'s `name`, or, without it, to `net`'s weights."""
    file = None if folder is None else folder / name
    if file is not None and file.is_file():
        load_state(out, load_file(str(file)), str(file))
        return
    if folder is not None:
        alerts.fire(-1, "checkpoint_incomplete", f"{folder.name} holds no {name}: it starts from the current weights")
    out.load_state_dict(net.state_dict())


def trained_pairs(copy_net: torch.nn.Module, net: torch.nn.Module) -> tuple[list, list]:
    """The copy's and the network's parameters that training changes, in the same order."""
    names = {n for n, p in net.named_parameters() if p.requires_grad}
    return ([p for n, p in copy_net.named_parameters() if n in names], [p for n, p in net.named_parameters() if n in names])
