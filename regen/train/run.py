"""Run: everything around the RL loop that is not the loop, for every modality.

Start (inputs checked before the run directory is touched, the run directory prepared or
resumed, the model built by its modality adapter), checkpoints (rank 0 writes, a failed write
is an alert), rollback to the last healthy checkpoint, the health checks and alerts of each
step (missing rewards, unscored steps, scorer version, non-finite streaks, collapse, KL,
stall), the S3 mirror, evaluation cadence, export and close. A guarantee written here holds
for language and flow models alike; `regen.train.loop.train` reads top to bottom because the
books are kept here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from regen.config import RLConfig, dump_config, redact
from regen.data import EpochSampler, PromptItem
from regen.data.tasks import Task, TaskMix, task_metrics
from regen.errors import RunStopped, UserError
from regen.modalities import modality_class
from regen.modalities.base import Modality
from regen.placement import place
from regen.placement.checks import check_placement
from regen.policies.lm import resolve_device
from regen.quality import Quality, gates
from regen.runtime import checkpoint as ckpt
from regen.runtime import dist as rdist
from regen.runtime.alerts import Alerts
from regen.runtime.hacking import HeldOutWatch, earlier_evals
from regen.runtime.health import HealthMonitor
from regen.runtime.metrics import MetricsLogger
from regen.runtime.offload import PhaseHooks, PhaseMemory, loop_hooks
from regen.runtime.optim import lr_at, set_lr
from regen.runtime.precision import Precision
from regen.runtime.rundir import (
    end_status,
    mark_closed,
    mark_running,
    setup_torch,
    undone_on_failure,
    versions,
    write_folder,
)
from regen.train.start import (  # noqa: F401  (changed_settings: re-exported)
    SilentLog,
    changed_settings,
    data_sampler,
    open_mirror,
    prepare_on_rank0,
    restore_books,
    resume_state,
    run_inputs,
)


@dataclass
class Run:
    cfg: RLConfig
    run_dir: Path
    m: Modality  # the models and what each stage does with them (regen/modalities/)
    opt: torch.optim.Optimizer
    data: EpochSampler | TaskMix
    gen: torch.Generator  # every random draw of sampling and the update (saved in checkpoints)
    reward: object  # CombinedReward, or its torchrun / Ray placement
    prompts: list[PromptItem]
    eval_items: list[PromptItem]
    log: MetricsLogger
    alerts: Alerts
    health: HealthMonitor
    start_step: int
    rollout: object  # where samples come from: LocalRollouts or RayRollouts (regen/placement/)
    dist: rdist.Dist = field(default_factory=rdist.Dist)  # torchrun rank / world size (single: rank 0 of 1)
    precision: Precision | None = None  # train.precision: autocast and loss scaling
    hooks: PhaseHooks = field(default_factory=PhaseHooks)  # at each phase change (offload, colocate)
    mirror: object | None = None  # S3Mirror when mirror.url is set
    expected_versions: dict | None = None  # reward versions of the checkpoint resumed (alert when they change)
    unscored: int = 0  # consecutive steps in which no sample got a score
    quality: Quality | None = None  # eval.metrics: feature extractor and references, loaded once
    watch: HeldOutWatch | None = None  # health.hacking_metric: the evaluations so far, their best, a fall from it
    tasks: list[Task] | None = None  # a multi-task run's streams (regen/data/tasks.py); `data` is then a TaskMix
    memory: PhaseMemory | None = None  # distributed.colocate: each phase's peak memory
    # for the next metrics row: the last checkpoint's write time (time/checkpoint_s), the resume's (time/resume_s)
    books: dict = field(default_factory=dict)

    @classmethod
    def start(cls, cfg: RLConfig, resume: bool = False, force: bool = False) -> Run:
        # Check everything the user gave before touching the run directory.
        device = resolve_device(cfg.run.device)
        d = rdist.start(cfg.distributed.mode, cfg.distributed.strategy, cfg.distributed.backend, device,
                        cfg.distributed.timeout_s)
        check_placement(cfg, d)
        reward, prompts, eval_items, tasks = run_inputs(cfg)
        quality = Quality(cfg.eval, cfg.modality, cfg.run.seed, device=str(device))  # a wrong path stops here
        if eval_items:
            quality.check_items(eval_items)
        if cfg.distributed.mode == "ray" and not d.on:  # the cluster and its resources, before the run directory is touched
            from regen.placement.ray import start_ray

            start_ray(cfg)
        fresh = not Path(cfg.run.dir).exists()
        run_dir, resume = prepare_on_rank0(cfg, resume, d)
        with undone_on_failure(run_dir, fresh, d.main):  # refused or failed before the first step
            return cls._open(cfg, run_dir, resume, force, d, device, reward, prompts, eval_items, tasks, quality)

    @classmethod
    def _open(cls, cfg: RLConfig, run_dir: Path, resume: bool, force: bool, d, device, reward, prompts, eval_items,
              tasks, quality) -> Run:
        """Start's second half, in the locked run directory: checkpoint, model, workers, books."""
        quality.base_file, quality.write_base = run_dir / "eval" / "base_reference.npz", d.main
        setup_torch(cfg.run.threads, cfg.run.seed)
        alerts = Alerts(run_dir, webhook_url=cfg.health.webhook_url)
        mirror = open_mirror(cfg, alerts) if d.main else None
        if mirror is not None and not resume and mirror.list_complete():
            # nothing here but checkpoints in the bucket: continue from the newest valid one
            if mirror.download_latest(run_dir / "checkpoints") is not None:
                resume = True
        resume = d.broadcast_object(resume)
        t_read = time.perf_counter()
        state = resume_state(cfg, run_dir, alerts, force) if resume else None

        try:
            m = modality_class(cfg)(cfg, device, d, state, alerts)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            if state is None:
                raise
            raise UserError(f"checkpoint '{state['folder']}': its model cannot be loaded although its files match "
                            f"the manifest ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); move "
                            "that folder away to resume from the checkpoint before it") from None
        opt = m.optimizer(cfg.optim)
        data = data_sampler(cfg, len(prompts), tasks)
        gen = torch.Generator(device=m.gen_device).manual_seed(cfg.run.seed)
        health = HealthMonitor(cfg.health, alerts)
        start_step = restore_books(state, run_dir, opt, data, gen, health,
                                   load_optimizer=lambda sd: d.load_optim_state(m.trained, opt, sd))
        # reading the checkpoint, building the model from it and loading the optimizer and books
        books = {"time/resume_s": time.perf_counter() - t_read} if state is not None else {}
        reward, rollout = place(cfg, d, m, reward, data, prompts, start_step)  # the workers (Ray actors) before
        # anything is written: one that cannot start leaves no run behind
        if d.main:
            dump_config(cfg, run_dir / "config.yaml")
            mark_running(run_dir)  # run.json: `regen status` tells a live run from a dead one
            log = MetricsLogger(run_dir, cfg.log, config=cfg, resume=state is not None,
                                warn=lambda step, msg: alerts.fire(step, "logger_failed", msg))
        else:
            cfg.log.progress, log = "none", SilentLog()  # one progress bar and one metrics file: rank 0's
        optimizers, idle = m.frozen()
        colocate = cfg.distributed.colocate  # park state, sleep the engine, measure each phase (runtime/offload.py)
        hooks, memory = loop_hooks(cfg.train.offload or colocate, device, [opt, *optimizers], idle,
                                   sampler=m if colocate else None, memory=colocate)
        return cls(cfg, run_dir, m, opt, data, gen, reward, prompts, eval_items, log, alerts, health, start_step,
                   rollout, d, Precision(cfg.train.precision, device), hooks, mirror,
                   state["state"].get("reward_versions") if state else None, quality=quality,
                   watch=HeldOutWatch(cfg.health.hacking_metric, cfg.health.hacking_drop,
                                      earlier_evals(run_dir) if state is not None and d.main else []),
                   tasks=tasks, memory=memory, books=books)

    # ------------------------------------------------------------------ each step

    def set_lr(self, step: int) -> float:
        """The step's learning rate (schedule x the rollbacks' scale) into the optimizers."""
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps) * self.health.lr_scale
        set_lr(self.opt, lr)
        self.m.set_lr(lr)
        return lr

    def observe_tasks(self, items, rewards: torch.Tensor) -> dict[str, float]:
        """A multi-task step: each task's share of the prompts and mean reward, which the dynamic
        task weights learn from; task/NAME/weight is the weight of the next draw. {} otherwise."""
        if not self.tasks:
            return {}
        metrics, means = task_metrics([t.name for t in self.tasks], items, rewards)
        self.data.weights.observe(means)
        return metrics | {f"task/{t.name}/weight": w for t, w in zip(self.tasks, self.data.weights.current())}

    def check_rewards(self, step: int, adv_metrics: dict) -> None:
        """Alerts on a step's rewards: too many missing, or a scorer whose version changed since
        the checkpoint this run resumed from (rewards before and after are not comparable). A
        version not known on either side (a service that has not answered yet) is not compared."""
        missing = float(adv_metrics["missing_frac"])
        if missing > self.cfg.health.missing_alert_frac:
            self.alerts.fire(step, "reward_missing", f"{missing:.0%} of rewards missing", missing_frac=missing)
        before, now = self.expected_versions, self.reward.versions()
        if not before or any(now.get(k) == UNKNOWN for k in before):
            return  # not yet known: checked at a later step
        changed = {k: (v, now.get(k)) for k, v in before.items() if v != UNKNOWN and now.get(k) != v}
        if changed:
            self.alerts.fire(step, "scorer_version_changed", f"reward versions {before} at the checkpoint, now "
                             f"{now}: rewards before and after are not comparable")
        self.expected_versions = None

    def wait_for_reward(self, step: int, stop, bar) -> None:
        """Before step `step`: while a reward service is down (its client's circuit breaker open),
        wait and probe it instead of sampling a batch that cannot be scored; past
        health.reward_patience_s stop with a checkpoint. Under torchrun rank 0 decides."""
        d, patience = self.dist, self.cfg.health.reward_patience_s
        down = d.broadcast_object(getattr(self.reward, "down", list)() if d.main else None)
        if not down:
            return
        self.alerts.fire(step, "reward_service_down", f"reward service down ({', '.join(down)}: circuit breaker "
                         f"open); waiting for it, up to {patience:g} s (health.reward_patience_s)")
        t0, shown = time.monotonic(), time.monotonic()
        while True:
            back = d.broadcast_object(self.reward.probe() if d.main else None)
            if back:
                self.reward.probe()  # every rank's client closes its breaker
                self.alerts.fire(step, "reward_service_back", f"reward service answering again after "
                                 f"{time.monotonic() - t0:.0f} s")
                return
            if d.any_true(stop.requested):
                return  # the step runs (unscored) and the loop stops after it with a checkpoint
            if time.monotonic() - t0 > patience:
                self.save(step - 1)
                raise RunStopped(f"stopped before step {step}: the reward service ({', '.join(down)}) did not come "
                                 f"back in {patience:g} s (health.reward_patience_s); a checkpoint was written: "
                                 "rerun the same command once it is up")
            if time.monotonic() - shown > 30:
                bar.print(f"waiting for the reward service ({', '.join(down)}): {time.monotonic() - t0:.0f} s")
                shown = time.monotonic()
            time.sleep(0.5)

    def end_step(self, step: int, metrics: dict, scored: bool, bar) -> None:
        """Evaluation when due, the metrics row, health (skip / roll back / alert), the periodic
        checkpoint, and the stop after too many steps without a single score."""
        cfg = self.cfg
        evaluated = bool(self.eval_items and cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps)
        if evaluated:
            metrics.update(self.evaluate(step))
        metrics |= self.books  # the checkpoint written after the previous row (or read at the resume)
        self.books = {}
        self.log.log(step, metrics)
        bar.update(step, f"reward {metrics['reward/mean']:.3f}  {metrics['throughput/samples_per_s']:.1f} samples/s")
        fall = self.watch.taken()  # a held-out fall rank 0 saw at this evaluation
        back = None  # health.rollback_on_alert after a held-out fall: to its peak evaluation or before
        if evaluated and cfg.health.hacking_metric and cfg.health.rollback_on_alert:
            back = self.dist.broadcast_object(fall.peak if fall else None)
        rollback = self.health.observe(step, metrics)  # a non-finite streak (or, if asked, an alert)
        self.health.problem |= fall is not None  # not a state to return to
        if rollback or back is not None:
            self.rollback(step, back)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.train.steps:
            self.save(step)
        self.unscored = 0 if scored else self.unscored + 1
        if self.unscored >= cfg.health.stop_after_unscored_steps:
            self.save(step)
            self.alerts.fire(step, "run_stopped", f"no reward came back for {self.unscored} consecutive steps")
            raise RunStopped(
                f"stopped at step {step}: no reward came back for {self.unscored} consecutive steps "
                f"(see {self.run_dir / 'alerts.jsonl'}); a checkpoint was written: fix the scorer and rerun")

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics (eval/*: rewards, eval.metrics, eval.gates), with the first samples
        kept under samples/; a failed gate raises an alert."""
        metrics = self.m.evaluate(self.eval_items, self.reward, self.run_dir, step, self.quality) if not self.tasks \
            else eval_tasks(self.m, self.tasks, self.reward, self.run_dir, step)
        e = self.cfg.eval
        if self.quality.missing_base:
            self.alerts.fire(step, "eval_reference_missing", "eval.reference=base: this run resumed without "
                             "eval/base_reference.npz (the starting model's samples), so drift is not measured")
        metrics |= gates.check(e.gates, metrics)
        failed = gates.failed(e.gates, metrics)
        if failed:
            self.alerts.fire(step, "eval_gate_failed", "evaluation failed its gates: " + "; ".join(failed))
        if self.cfg.health.hacking_metric and self.dist.main:
            self.watch.see(step, metrics, self.alerts)
        return metrics

    # ------------------------------------------------------------------ books

    def save(self, step: int) -> Path | None:
        """Write a checkpoint; a failed write (disk full...) raises an alert and returns None:
        earlier checkpoints are untouched and training goes on. Under torchrun every rank calls
        it (FSDP2 gathers the shards), rank 0 writes."""
        d = self.dist
        t0 = time.perf_counter()
        self.rollout.discard_prefetch()  # a batch sampled ahead is not part of the saved state
        gathered = self.m.gather()
        opt_state = d.full_optim_state(self.m.trained, self.opt, self.run_dir / "checkpoints")

        def write() -> Path | None:
            folder = save_run_checkpoint(self, step, gathered, opt_state)
            if folder is not None and self.mirror is not None:
                self.mirror.submit(folder)  # background upload; failures become alerts
            return folder

        folder = d.broadcast_object(write() if d.main else None)  # none reads a checkpoint before it is complete
        if folder is not None and not d.main:
            self.health.checkpointed()
        if folder is not None:  # gather + write + fsync (outside time/step_s)
            self.books = {"time/checkpoint_s": time.perf_counter() - t0}
        return folder

    def rollback(self, step: int, at_most: int | None = None) -> None:
        """Weights, optimizer and the modality's extra state (critic, EMA copies) back to the
        last healthy checkpoint (or the starting model), the learning rate scaled down; past
        health.max_rollbacks a last checkpoint and the run stops instead. Data and RNG streams
        keep moving forward, so the batches that went wrong are not replayed. at_most: the newest
        healthy checkpoint at or before that step (a held-out fall: its peak evaluation's), when one is kept."""
        if self.health.rollbacks >= self.cfg.health.max_rollbacks:
            self.save(step)
            raise RunStopped(f"stopped at step {step}: still unhealthy after {self.health.rollbacks} rollbacks "
                             f"(see {self.run_dir / 'alerts.jsonl'})")
        folder = ckpt.latest_healthy(self.run_dir, at_most)
        if folder is None and at_most:  # a peak after the start whose checkpoint is not kept: the newest healthy one
            folder = ckpt.latest_healthy(self.run_dir)
        self.watch.rolled_back(ckpt.step_of(folder) if folder is not None else 0)
        self.m.restore(folder)
        if folder is None:
            self.opt.state.clear()  # back to the start: a fresh optimizer
        else:
            self.dist.load_optim_state(self.m.trained, self.opt, ckpt.load_checkpoint(folder)["optimizer"])
        self.rollout.discard_prefetch()  # sampled with the weights being abandoned
        self.rollout.sync(step)  # rollout workers / engines get the restored weights
        self.health.rolled_back()
        self.alerts.fire(step, "rollback", f"rolled back to {folder.name if folder else 'the starting model'}; "
                         f"learning rate x{self.health.lr_scale:g}", lr_scale=self.health.lr_scale)

    def export(self) -> Path:
        """The final model in export/ (rank 0 writes, into a temporary folder renamed when
        complete; FSDP2 shards gathered first)."""
        folder = self.run_dir / "export"
        gathered = self.m.gather()
        if self.dist.main:
            write_folder(folder, lambda tmp: self.m.export(tmp, gathered))
            if self.mirror is not None:
                self.mirror.submit_export(folder)
        self.dist.barrier()
        return folder

    def complete(self) -> list[str]:
        """A run resumed at its last step: what its process did not finish after the final
        checkpoint (killed before the final evaluation or the export), done from that checkpoint.
        Returns what was done."""
        step, done = self.start_step, []
        if self.eval_items and not self.dist.broadcast_object(self._logged_eval(step) if self.dist.main else None):
            self.log.log(step, self.evaluate(step))
            done.append("final evaluation")
        if not self.dist.broadcast_object((self.run_dir / "export").is_dir() if self.dist.main else None):
            self.export()
            done.append("export")
        return done

    def _logged_eval(self, step: int) -> bool:
        from regen.runtime.metrics import read_rows

        path = self.run_dir / "metrics.jsonl"
        rows = read_rows(path)[0] if path.exists() else []
        return any(r["step"] == step and any(k.startswith("eval/") for k in r) for r in rows)

    def close(self) -> None:
        self.log.close()
        if self.mirror is not None:
            self.mirror.close()  # waits for the uploads still in flight
        self.rollout.close()
        if hasattr(self.reward, "close"):
            self.reward.close()
        self.m.close()
        self.alerts.flush()
        if self.dist.main:
            mark_closed(self.run_dir, end_status(self.run_dir, self.cfg.train.steps))
        rdist.stop()


UNKNOWN = "unknown"  # the version of a remote scorer that has not answered yet


def save_run_checkpoint(run: Run, step: int, gathered, opt_state: dict | None) -> Path | None:
    """The checkpoint of an RL run: the modality's weights and extra state, optimizer, RNG
    streams, data position, health, reward versions, config. opt_state: the optimizer's state
    gathered from FSDP2 shards, else its own. A failed write (disk full...) raises an alert and
    returns None: earlier checkpoints are untouched and training goes on."""
    tree = redact(run.cfg.model_dump(mode="json"))
    opt = ckpt.as_saved(run.opt, opt_state)
    try:
        folder = ckpt.save_checkpoint(
            run.run_dir, step, None, opt,
            rng={"sampler": run.gen.get_state(), "torch_cpu": torch.get_rng_state()},
            state={"data": run.data.state(), "trainer": "rl", "healthy": not run.health.problem,
                   "peak": run.watch.peak == step,
                   **({"task_weights": run.data.weights.state()} if run.tasks else {}),
                   "health": run.health.state(), "reward_versions": run.reward.versions(), "config": tree,
                   "versions": versions(model_source(run.cfg), run.reward.versions(), tree)},
            keep_last=run.cfg.checkpoint.keep_last,
            save_extra=lambda f: run.m.save(f, gathered),
        )
    except ckpt.WRITE_ERRORS as e:
        why = getattr(e, "strerror", None) or str(e)
        run.alerts.fire(step, "checkpoint_failed", f"checkpoint at step {step} not written: {why}")
        return None
    run.health.checkpointed()
    return folder


def eval_tasks(m: Modality, tasks: list[Task], reward, run_dir: Path, step: int) -> dict[str, float]:
    """eval/TASK/* for each task's held-out prompts (eval.num_prompts of each), and eval/* the
    mean over the tasks of each metric they all have (every task counts alike)."""
    per: list[dict[str, float]] = []
    for t in tasks:
        if t.eval_items:
            got = m.evaluate(t.eval_items, reward, run_dir, step, None, task=t.name)
            per.append({k.removeprefix("eval/").removeprefix(f"{t.name}/"): v for k, v in got.items()})  # TASK/TERM
    out = {f"eval/{t.name}/{k}": v for t, got in zip([t for t in tasks if t.eval_items], per) for k, v in got.items()}
    common = set.intersection(*(set(p) for p in per)) if per else set()
    return out | {f"eval/{k}": sum(p[k] for p in per) / len(per) for k in sorted(common)}


def model_source(cfg) -> str:
    """Where the trained model came from (a joint run: each model's, by name)."""
    if cfg.models:
        return ", ".join(f"{n}={c.model.path or c.model.init}" for n, c in cfg.members.items())
    return cfg.model.path or cfg.model.init
