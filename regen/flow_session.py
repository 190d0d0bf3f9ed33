"""Bookkeeping of a flow-model RL run (the counterpart of `regen.session` for images and
videos): inputs checked, run directory prepared or resumed, checkpoints, held-out evaluation."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from regen.config import RLConfig, dump_config
from regen.data import EpochSampler, PromptItem
from regen.errors import UserError
from regen.flow_sft import load_flow_policy, save_media
from regen.policies.flow import FlowPolicy
from regen.policies.lm import resolve_device
from regen.rewards import CombinedReward
from regen.runtime import checkpoint as ckpt
from regen.runtime.alerts import Alerts
from regen.runtime.health import HealthMonitor
from regen.runtime.metrics import MetricsLogger, nanmean
from regen.runtime.optim import make_optimizer
from regen.runtime.rundir import end_status, mark_closed, mark_running, prepare, setup_torch
from regen.session import resume_state, run_inputs, save_run_checkpoint

EVAL_SEED_OFFSET = 7919  # held-out samples draw from their own stream: before/after on equal noise


@dataclass
class FlowRun:
    cfg: RLConfig
    run_dir: Path
    policy: FlowPolicy
    opt: torch.optim.Optimizer
    data: EpochSampler
    gen: torch.Generator
    reward: CombinedReward
    prompts: list[PromptItem]
    eval_items: list[PromptItem]
    log: MetricsLogger
    alerts: Alerts
    health: HealthMonitor
    start_step: int
    ref: torch.nn.Module | None  # frozen starting UNet, for flow_grpo's KL
    ema: torch.nn.Module | None  # DiffusionNFT's slowly moving old policy

    @classmethod
    def start(cls, cfg: RLConfig, resume: bool = False, force: bool = False) -> FlowRun:
        device = resolve_device(cfg.run.device)
        reward, prompts, eval_items = run_inputs(cfg)
        f = cfg.flow
        if f.sde_window is not None and f.window_start + f.sde_window > f.steps:
            raise UserError(f"flow.sde_window={f.sde_window} from flow.window_start={f.window_start} does not fit "
                            f"in flow.steps={f.steps}")
        run_dir, resume = prepare(cfg.run.dir, cfg.run.overwrite, resume)
        setup_torch(cfg.run.threads, cfg.run.seed)
        alerts = Alerts(run_dir, webhook_url=cfg.health.webhook_url)
        state = resume_state(cfg, run_dir, alerts, force) if resume else None
        policy = load_flow_policy(ckpt.resumed_model(cfg.model, state), cfg.run.seed, device)
        ref = ema = None
        if cfg.algorithm.name == "flow_grpo" and f.kl_coef > 0:  # the run's starting model, also after a resume
            start = policy if state is None else load_flow_policy(cfg.model, cfg.run.seed, device)
            ref = copy.deepcopy(start.unet).eval().requires_grad_(False)
        if cfg.algorithm.name == "nft":
            ema = copy.deepcopy(policy.unet).eval().requires_grad_(False)
            if state is not None and (state["folder"] / "ema").is_dir():
                from diffusers import UNet2DModel

                ema.load_state_dict(UNet2DModel.from_pretrained(str(state["folder"] / "ema")).state_dict())
        # RL trains the velocity model only; the prompt encoder stays as pretrained, as text
        # encoders do in Flow-GRPO / DiffusionNFT. A moving encoder would also move NFT's
        # "old" policy (the EMA UNet reads the same prompt vectors).
        policy.encoder.requires_grad_(False)
        opt = make_optimizer(policy.unet, cfg.optim)
        data = EpochSampler(len(prompts), cfg.run.seed)
        gen = torch.Generator().manual_seed(cfg.run.seed)
        health = HealthMonitor(cfg.health, alerts)
        start_step = 0
        if state is not None:
            start_step = ckpt.restore(state, run_dir, opt, data, gen)
            if "health" in state["state"]:
                health.load_state(state["state"]["health"])
        dump_config(cfg, run_dir / "config.yaml")
        mark_running(run_dir)
        log = MetricsLogger(run_dir, cfg.log, config=cfg, resume=state is not None,
                            warn=lambda step, m: alerts.fire(step, "logger_failed", m))
        return cls(cfg, run_dir, policy, opt, data, gen, reward, prompts, eval_items, log, alerts, health,
                   start_step, ref, ema)

    def save(self, step: int) -> Path | None:
        return save_run_checkpoint(self, step, None if self.ema is None else
                                   (lambda folder: self.ema.save_pretrained(str(folder / "ema"), safe_serialization=True)))

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out prompts, sampled with the ODE and fixed noise; mean reward of each term and
        the prompt adherence, with the first samples saved as PNG/GIF under samples/."""
        from regen.flow_loop import to_samples

        e, f = self.cfg.eval, self.cfg.flow
        items = self.eval_items[: e.num_prompts]
        gen = torch.Generator().manual_seed(self.cfg.run.seed + EVAL_SEED_OFFSET)
        out = self.policy.sample_ode([it.prompt for it in items], e.samples_per_prompt, gen, f.eval_steps, f.shift,
                                     f.guidance)
        samples = to_samples(out, items, e.samples_per_prompt)
        total, parts = self.reward(samples)
        metrics = {"eval/reward": nanmean(total), **{f"eval/{k}": nanmean(v) for k, v in parts.items()}}
        if all("colour" in it.meta for it in items):  # the built-in shapes: did it draw what was asked?
            from regen.rewards.adherence import AdherenceAccuracy

            # logged beside any reward, so a reward that is hacked (a flat colour) shows here
            metrics["eval/adherence"] = nanmean(AdherenceAccuracy()(samples))
        save_media(self.run_dir, step, out, total)
        return metrics

    def close(self) -> None:
        self.log.close()
        self.alerts.flush()
        mark_closed(self.run_dir, end_status(self.run_dir, self.cfg.train.steps))
