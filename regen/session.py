"""Everything around the RL loop that is not the loop: checking inputs, preparing or
resuming the run directory, saving checkpoints, rolling back. `regen.loop.train` reads top
to bottom because this file holds the bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from regen.config import RLConfig, dump_config, incompatible_changes, redact
from regen.data import EpochSampler, PromptItem, load_prompts
from regen.errors import RunStopped, UserError
from regen.placement import SilentLog, check_placement, data_parallel, placement, prepare_on_rank0
from regen.policies.critic import Critic
from regen.policies.lm import LMPolicy, apply_lora, load_model_and_tokenizer, resolve_device
from regen.rewards import CombinedReward
from regen.runtime import checkpoint as ckpt
from regen.runtime import dist as rdist
from regen.runtime.alerts import Alerts
from regen.runtime.health import HealthMonitor
from regen.runtime.loggers import require as require_loggers
from regen.runtime.metrics import MetricsLogger
from regen.runtime.offload import PhaseHooks, loop_hooks
from regen.runtime.optim import make_optimizer
from regen.runtime.precision import Precision
from regen.runtime.rundir import end_status, mark_closed, mark_running, setup_torch, versions


@dataclass
class RunBooks:
    """What every RL run keeps, whatever it trains: a Session (language models, below) or a
    FlowRun (flow models, regen/flow_session.py)."""

    cfg: RLConfig
    run_dir: Path
    policy: object  # LMPolicy or FlowPolicy
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

    def close(self) -> None:
        self.log.close()
        self._close_more()
        self.alerts.flush()
        if rdist.current().main:
            mark_closed(self.run_dir, end_status(self.run_dir, self.cfg.train.steps))
        rdist.stop()

    def _close_more(self) -> None:
        """What a run closes besides its logs and alerts."""


@dataclass
class Session(RunBooks):
    saved_reward_versions: dict | None  # from the checkpoint resumed, to warn when they changed
    mirror: object | None = None  # S3Mirror when mirror.url is set
    critic: Critic | None = None  # PPO's value model (algorithm.name=ppo) and its optimizer
    critic_opt: torch.optim.Optimizer | None = None
    hooks: PhaseHooks = field(default_factory=PhaseHooks)  # run at each phase change (train.offload parks state)
    precision: Precision | None = None  # train.precision: autocast and loss scaling
    dist: rdist.Dist = field(default_factory=rdist.Dist)  # torchrun rank / world size (single: rank 0 of 1)
    rollout: object = None  # where samples come from: LocalRollouts or RayRollouts (regen/rollout.py)

    @classmethod
    def start(cls, cfg: RLConfig, resume: bool = False, force: bool = False) -> Session:
        # Check everything the user gave before touching the run directory.
        device = resolve_device(cfg.run.device)
        d = rdist.start(cfg.distributed.mode, cfg.distributed.strategy, cfg.distributed.backend, device)
        check_placement(cfg, d)
        reward, prompts, eval_items = run_inputs(cfg)
        run_dir, resume = prepare_on_rank0(cfg, resume, d)
        setup_torch(cfg.run.threads, cfg.run.seed)
        alerts = Alerts(run_dir, webhook_url=cfg.health.webhook_url)
        mirror = _open_mirror(cfg, alerts) if d.main else None
        if mirror is not None and not resume and mirror.list_complete():
            # nothing here but checkpoints in the bucket: continue from the newest valid one
            if mirror.download_latest(run_dir / "checkpoints") is not None:
                resume = True
        resume = d.broadcast_object(resume)

        state = resume_state(cfg, run_dir, alerts, force) if resume else None
        model, tok, reference = _load_policy_model(cfg, state)
        policy = LMPolicy(model, tok, device, reference=reference)
        policy.model.eval()  # dropout off: sampling and training see the same function (ratio 1 on-policy)
        data_parallel(policy, d)
        opt = make_optimizer(policy.model, cfg.optim)
        critic, critic_opt = _load_critic(cfg, device, state, alerts, d)
        data = EpochSampler(len(prompts), cfg.run.seed)
        gen = torch.Generator(device=device).manual_seed(cfg.run.seed)
        health = HealthMonitor(cfg.health, alerts)
        start_step = restore_books(state, run_dir, opt, data, gen, health,
                                   load_optimizer=lambda sd: d.load_optim_state(policy.model, opt, sd))
        if d.main:
            dump_config(cfg, run_dir / "config.yaml")
            mark_running(run_dir)  # run.json: `regen status` tells a live run from a dead one
        else:
            cfg.log.progress = "none"  # one progress bar: rank 0's
        hooks = loop_hooks(cfg.train.offload, device, [opt, critic_opt],
                           [policy.ref, None if critic is None else critic.model])
        log = MetricsLogger(run_dir, cfg.log, config=cfg, resume=state is not None,
                            warn=lambda step, m: alerts.fire(step, "logger_failed", m)) if d.main else SilentLog()
        reward, rollout = placement(cfg, d, policy, reward, data, prompts, start_step)
        return cls(cfg, run_dir, policy, opt, data, gen, reward, prompts, eval_items, log, alerts, health, start_step,
                   state["state"].get("reward_versions") if state else None, mirror, critic, critic_opt, hooks,
                   Precision(cfg.train.precision, device), d, rollout)

    def save(self, step: int) -> Path | None:
        """Write a checkpoint; a failed write (disk full...) raises an alert and returns None:
        earlier checkpoints are untouched and training goes on. Under torchrun every rank calls
        it (FSDP2 gathers the shards), rank 0 writes."""
        d = self.dist
        self.rollout.discard_prefetch()  # a batch sampled ahead is not part of the saved state
        weights, opt_state = d.full_model_state(self.policy.model), d.full_optim_state(self.policy.model, self.opt)
        critic = None if self.critic is None else \
            (d.full_model_state(self.critic.model), d.full_optim_state(self.critic.model, self.critic_opt))

        def write() -> Path | None:
            folder = save_run_checkpoint(
                self, step, None if critic is None else lambda f: self._save_critic(f, *critic),
                save_model=None if weights is None else lambda f: self.policy.save_pretrained(f, weights),
                opt_state=opt_state)
            if folder is not None and self.mirror is not None:
                self.mirror.submit(folder)  # background upload; failures become alerts
            return folder

        return save_on_rank0(self, write)

    def export(self) -> None:
        """The final model in export/ (rank 0 writes; FSDP2 shards gathered first)."""
        weights = self.dist.full_model_state(self.policy.model)
        if self.dist.main:
            self.policy.export(self.run_dir / "export", weights)
            if self.mirror is not None:
                self.mirror.submit_export(self.run_dir / "export")
        self.dist.barrier()

    def _save_critic(self, folder: Path, weights: dict | None, opt_state: dict | None) -> None:
        """The critic and its optimizer (weights / opt_state: gathered from FSDP2 shards)."""
        self.critic.save_pretrained(folder / "critic", weights)
        ckpt.save_optimizer(self.critic_opt if opt_state is None else _Gathered(opt_state), folder, "critic_optimizer")

    def rollback(self, step: int) -> None:
        """Return the weights and optimizer to the last healthy checkpoint (or the starting
        model) and scale the learning rate down. Data and RNG streams keep moving forward, so
        the batches that went wrong are not replayed."""
        folder = begin_rollback(self, step)
        weights, _, _ = _load_policy_model(self.cfg, None if folder is None else {"model_dir": folder / "model"})
        self.dist.load_model_state(self.policy.model, weights.state_dict())
        if folder is None:
            self.opt.state.clear()  # back to the start: a fresh optimizer
        else:
            self.dist.load_optim_state(self.policy.model, self.opt, ckpt.load_checkpoint(folder)["optimizer"])
        if self.critic is not None:  # the critic goes back to the same point as the policy
            state = None if folder is None else {"folder": folder}
            critic, critic_opt = _load_critic(self.cfg, self.critic.device, state, self.alerts)
            self.dist.load_model_state(self.critic.model, critic.model.state_dict())
            self.critic_opt.state.clear()
            if folder is not None:
                self.dist.load_optim_state(self.critic.model, self.critic_opt, critic_opt.state_dict())
        self.rollout.discard_prefetch()  # sampled with the weights being abandoned
        self.rollout.sync(self.policy, step)  # rollout workers / engine get the restored weights
        end_rollback(self, step, folder)

    def _close_more(self) -> None:
        if self.mirror is not None:
            self.mirror.close()  # waits for the uploads still in flight
        if self.rollout is not None:
            self.rollout.close()
        if hasattr(self.reward, "close"):
            self.reward.close()


def begin_rollback(run, step: int) -> Path | None:
    """The checkpoint a rollback of `run` (a Session or a FlowRun) returns to (None: the
    starting model); past health.max_rollbacks, a last checkpoint and the run stops instead."""
    if run.health.rollbacks >= run.cfg.health.max_rollbacks:
        run.save(step)
        raise RunStopped(f"stopped at step {step}: still unhealthy after {run.health.rollbacks} rollbacks "
                         f"(see {run.run_dir / 'alerts.jsonl'})")
    return ckpt.latest_healthy(run.run_dir)


def end_rollback(run, step: int, folder: Path | None) -> None:
    run.health.rolled_back()
    run.alerts.fire(step, "rollback", f"rolled back to {folder.name if folder else 'the starting model'}; "
                    f"learning rate x{run.health.lr_scale:g}", lr_scale=run.health.lr_scale)


def save_on_rank0(run, write) -> Path | None:
    """Run write() (-> the checkpoint folder, or None when it failed) on rank 0 only; every rank
    learns the outcome, and none reads a checkpoint before it is complete (torchrun)."""
    d = run.dist
    folder = d.broadcast_object(write() if d.main else None)
    if folder is not None and not d.main:
        run.health.checkpointed()
    return folder


def save_run_checkpoint(run, step: int, save_extra=None, save_model=None, opt_state=None) -> Path | None:
    """The checkpoint of an RL run (a Session or a FlowRun: weights, optimizer, RNG streams,
    data position, health, reward versions, config). save_model(folder) writes model/ (default:
    the policy's save_pretrained); opt_state: the optimizer's gathered state (FSDP2), else its
    own. A failed write (disk full...) raises an alert and returns None: earlier checkpoints
    are untouched and training goes on."""
    tree = redact(run.cfg.model_dump(mode="json"))
    opt = run.opt if opt_state is None else _Gathered(opt_state)
    try:
        folder = ckpt.save_checkpoint(
            run.run_dir, step, save_model or run.policy.save_pretrained, opt,
            rng={"sampler": run.gen.get_state(), "torch_cpu": torch.get_rng_state()},
            state={"data": run.data.state(), "healthy": not run.health.problem,
                   "health": run.health.state(), "reward_versions": run.reward.versions(), "config": tree,
                   "versions": versions(run.cfg.model.path or run.cfg.model.init, run.reward.versions(), tree)},
            keep_last=run.cfg.checkpoint.keep_last,
            save_extra=save_extra,
        )
    except OSError as e:
        run.alerts.fire(step, "checkpoint_failed", f"checkpoint at step {step} not written: {e.strerror or e}")
        return None
    run.health.checkpointed()
    return folder


class _Gathered:
    """An optimizer state gathered from FSDP2 shards, presented as the optimizer that saving reads."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def run_inputs(cfg: RLConfig) -> tuple[CombinedReward, list[PromptItem], list[PromptItem]]:
    """Loggers' packages, rewards and prompts: everything the user gave that can be wrong,
    checked before the run directory is touched."""
    require_loggers(cfg.log)  # W&B / MLflow installed when turned on
    reward = CombinedReward.from_config(cfg.reward)
    skip = cfg.data.on_bad_line == "skip"
    prompts = load_prompts(cfg.data.train, cfg.task, "data.train", skip, cfg.data.columns)
    eval_items = load_prompts(cfg.data.eval, cfg.task, "data.eval", skip, cfg.data.columns) if cfg.data.eval else []
    if len(prompts) < cfg.prompts_per_step:
        raise UserError(f"data.train: {len(prompts)} prompts, fewer than the {cfg.prompts_per_step} per step")
    return reward, prompts, eval_items


def restore_books(state: dict | None, run_dir: Path, opt, data, gen, health: HealthMonitor,
                  load_optimizer=None) -> int:
    """The step to continue from (0 for a new run): optimizer, data position, RNG streams and
    health monitor back as the checkpoint `state` left them. load_optimizer(state_dict): how the
    optimizer takes its state (FSDP2 shards it), default opt.load_state_dict."""
    if state is None:
        return 0
    step = ckpt.restore(state, run_dir, opt, data, gen, load_optimizer)
    if "health" in state["state"]:
        health.load_state(state["state"]["health"])
    return step


def resume_state(cfg: RLConfig, run_dir: Path, alerts: Alerts, force: bool) -> dict:
    """The newest valid checkpoint, refused when settings that change the computation differ
    from the ones it was trained with (unless force)."""
    state = ckpt.load_latest(run_dir, warn=lambda m: alerts.fire(-1, "checkpoint_skipped", m))
    saved = state["state"].get("config")
    diff = incompatible_changes(saved, redact(cfg.model_dump(mode="json"))) if saved else []
    if diff and not force:
        raise UserError("cannot resume: the config differs from the checkpoint's in "
                        + "; ".join(diff) + " (pass --force to resume anyway, or use another run.dir)")
    print(f"resuming from {state['folder']}")
    return state


def _load_policy_model(cfg: RLConfig, state: dict | None):
    """(model, tokenizer, reference) to train: from the checkpoint when resuming, else from
    model.path / model.init; with model.lora, the base plus a new or saved adapter."""
    kl = cfg.algorithm.kl_coef > 0
    if cfg.model.lora is not None:
        base, tok = load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)
        adapter = None if state is None else state["model_dir"]
        # the reference is the base with the adapter disabled: no second copy (see LMPolicy)
        return apply_lora(base, cfg.model.lora, adapter), tok, None
    model, tok = load_model_and_tokenizer(ckpt.resumed_model(cfg.model, state), cfg.task, cfg.run.seed)
    reference = None
    if kl:  # the KL reference is the run's starting model, also after a resume
        reference = "copy" if state is None else load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)[0]
    return model, tok, reference


def _load_critic(cfg: RLConfig, device, state: dict | None, alerts: Alerts, d: rdist.Dist | None = None):
    """PPO's critic and its optimizer: from the checkpoint being resumed, else fresh; under
    torchrun (d) data parallel like the policy (DDP, or sharded by FSDP2 before its optimizer
    is made)."""
    if cfg.algorithm.advantage != "gae":
        return None, None
    folder = None if state is None else state["folder"] / "critic"
    if folder is not None and not folder.is_dir():
        alerts.fire(-1, "critic_missing", f"checkpoint {state['folder'].name} holds no critic: starting a new one")
        folder = None
    critic, d = Critic.load(cfg, device, folder), d or rdist.Dist()
    if d.on:
        critic.dist, critic.forward_model = d, d.wrap(critic.model)  # DDP wrapper, or sharded in place
    opt = make_optimizer(critic.model, cfg.optim.model_copy(update={"lr": cfg.critic.lr}))
    saved = None if folder is None else ckpt.load_optimizer(state["folder"], "critic_optimizer")
    if saved is not None:
        d.load_optim_state(critic.model, opt, saved)
    return critic, opt


def _open_mirror(cfg: RLConfig, alerts: Alerts):
    """The S3 mirror, checked at start so a wrong bucket or missing credentials is one clear
    error now instead of failed uploads later."""
    if not cfg.mirror.url:
        return None
    from regen.runtime.mirror import S3Mirror

    mirror = S3Mirror(cfg.mirror.url, endpoint_url=cfg.mirror.endpoint_url, keep_last=cfg.mirror.keep_last,
                      on_event=lambda kind, message, **data: alerts.fire(data.pop("step", -1), kind, message, **data)
                      if kind != "mirror_uploaded" else None)
    try:
        mirror.list_complete()
    except Exception as e:  # botocore raises many types; all mean the same thing here
        raise UserError(f"mirror.url: cannot list '{cfg.mirror.url}': {type(e).__name__}: {e}") from None
    return mirror
