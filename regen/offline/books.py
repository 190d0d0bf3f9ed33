"""The books of every trainer without sampling: `regen sft` (language and flow models), DPO
(`regen train` with algorithm.name=dpo) and `regen rm`. One set, so that each guarantee an RL run
gives is written once for the four of them:

- the run directory locked, and refused when it holds another trainer's run (its checkpoints
  would be resumed, pruned and its export replaced);
- resume refused when a setting that changes the computation differs from the checkpoint's
  (`--force` resumes anyway);
- a non-finite loss or gradient skips the optimizer step with a `nonfinite` alert; after
  health.rollback_after_nonfinite in a row, the weights and optimizer go back to the last healthy
  checkpoint (or the starting model) with the learning rate scaled by health.rollback_lr_factor,
  and past health.max_rollbacks the run stops (the same HealthMonitor as RL runs);
- weights that are not finite are never checkpointed nor exported;
- a checkpoint that cannot be written (disk full) is a `checkpoint_failed` alert and training
  goes on; an export that cannot be written is one error line;
- SIGINT / SIGTERM finish the step, checkpoint and stop; the same command resumes exactly;
- with mirror.url, checkpoints and export/ are uploaded to S3 in the background, and a run directory that
  is gone resumes from the bucket's newest complete checkpoint.

A trainer gives the forward pass of one step (`step_fn`) and how to save, reload and export its
model; `OfflineRun.train` runs the steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from regen.config import incompatible_changes, redact
from regen.errors import RunStopped, UserError
from regen.runtime import checkpoint as ckpt
from regen.runtime import dist as rdist
from regen.runtime.alerts import Alerts
from regen.runtime.health import HealthMonitor
from regen.runtime.metrics import MetricsLogger, SilentLog
from regen.runtime.mirror import open_mirror
from regen.runtime.optim import lr_at, set_lr
from regen.runtime.progress import StepProgress
from regen.runtime.rundir import mark_closed, mark_running, prepare_on_rank0, undone_on_failure, write_folder
from regen.runtime.signals import GracefulStop

# settings an offline run may change on resume besides the RL ones (config/load.py RESUME_FREE): the length of
# the run, held-out data, and the sampling settings of held-out evaluation
OFFLINE_FREE = ("sft.steps", "rm.steps", "data.eval", "rollout.")


def offline_changes(cfg, saved: dict) -> list[str]:
    """Settings that change the computation and differ from a checkpoint's config (DPO: among the keys it reads)."""
    now = redact(cfg.model_dump(mode="json"))
    if hasattr(cfg, "read_tree"):  # DPO: an RLConfig, compared as RL runs are
        from regen.config.methods import migrate

        saved, now = cfg.read_tree(migrate(saved)), cfg.read_tree(now)
    return [c for c in incompatible_changes(saved, now) if not c.startswith(OFFLINE_FREE)]


@dataclass
class Model:
    """What the books need of a trainer's model: its trained parameters, how to write it into a folder (checkpoints
    and export/; the second argument: the gathered weights under FSDP2, else None), and how to reload its weights
    from a checkpoint's model/ folder (None: the starting model) as a module whose state_dict is the trained
    module's (a rollback)."""

    module: torch.nn.Module
    save: Callable[[Path, dict | None], None]
    reload: Callable[[Path | None], torch.nn.Module]
    export: Callable[[Path, dict | None], None] | None = None  # default: save

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]


@dataclass
class OfflineRun:
    cfg: object  # SFTConfig, RMConfig or (DPO) RLConfig
    trainer: str  # a key of TRAINERS
    run_dir: Path
    state: dict | None  # the checkpoint resumed from
    alerts: Alerts
    health: HealthMonitor
    model: Model | None = None
    opt: torch.optim.Optimizer | None = None
    data: object = None  # EpochSampler
    log: MetricsLogger | SilentLog | None = None
    start_step: int = 0
    dist: rdist.Dist = field(default_factory=rdist.Dist)  # torchrun: this rank (single: rank 0 of 1)
    mirror: object | None = None  # S3Mirror when mirror.url is set (rank 0)

    @classmethod
    @contextmanager
    def starting(cls, cfg, trainer: str, device, batch: tuple[int, str], resume: bool = False,
                 force: bool = False) -> Iterator[OfflineRun]:
        """The process group joined (torchrun), the run directory prepared and locked by rank 0, the checkpoint to
        resume checked; inside the block the trainer builds its model and calls `begin`. Anything failing before
        that leaves the directory as it was (a new one is removed). batch: (examples per step, its key), which
        the ranks split evenly."""
        d = cfg.distributed
        dist = rdist.start(d.mode, d.strategy, d.backend, device, d.timeout_s)
        if batch[0] % dist.world:
            rdist.stop()
            raise UserError(f"{batch[1]}={batch[0]} cannot be split evenly over {dist.world} processes")
        fresh = not Path(cfg.run.dir).exists()
        run_dir, resume = prepare_on_rank0(cfg, resume, dist)
        try:
            with undone_on_failure(run_dir, fresh, dist.main):
                alerts = Alerts(run_dir, webhook_url=cfg.health.webhook_url)
                mirror = open_mirror(cfg, alerts) if dist.main else None
                if mirror is not None and not resume and mirror.list_complete():
                    # nothing here but checkpoints in the bucket: continue from the newest valid one
                    resume = mirror.download_latest(run_dir / "checkpoints") is not None
                resume, state = dist.broadcast_object(resume), None
                if resume:
                    state = ckpt.load_latest(run_dir, warn=lambda m: alerts.fire(-1, "checkpoint_skipped", m))
                    ckpt.check_trainer(state, trainer, run_dir)
                    saved = state["state"].get("config")
                    diff = offline_changes(cfg, saved) if saved else []
                    if diff and not force:
                        raise UserError("cannot resume: the config differs from the checkpoint's in "
                                        + "; ".join(diff) + " (pass --force to resume anyway, or use another run.dir)")
                    if dist.main:
                        print(f"resuming from {state['folder']}")
                yield cls(cfg, trainer, run_dir, state, alerts, HealthMonitor(cfg.health, alerts), dist=dist,
                          mirror=mirror)
        except BaseException:
            rdist.stop()
            raise

    def begin(self, model: Model, optim, data) -> None:
        """The model (sharded in place under FSDP2), its optimizer (optim: the config's optim section) and the data
        order, restored from the checkpoint when resuming; config.yaml, run.json and the metrics log opened
        (rank 0)."""
        from regen.config import dump_config
        from regen.runtime.optim import make_optimizer

        if self.dist.sharded:
            config = getattr(model.module, "config", None)
            if hasattr(model.module, "peft_config") or getattr(config, "vision_config", None) is not None:
                raise UserError("distributed.strategy=fsdp: a LoRA adapter or a vision-language model trains data "
                                "parallel with distributed.strategy=ddp in `regen sft`, DPO and `regen rm`")
            self.dist.wrap(model.module)
        opt = make_optimizer(model.module, optim)
        self.model, self.opt, self.data = model, opt, data
        if self.state is not None:
            self.start_step = ckpt.restore(self.state, self.run_dir, opt, data,
                                           load_optimizer=lambda sd: self.dist.load_optim_state(model.module, opt, sd))
            if "health" in self.state["state"]:
                self.health.load_state(self.state["state"]["health"])
        if not self.dist.main:
            self.log = SilentLog()  # one metrics file and one progress bar: rank 0's
            return
        dump_config(self.cfg, self.run_dir / "config.yaml")
        mark_running(self.run_dir)  # run.json, for `regen status`
        self.log = MetricsLogger(self.run_dir, self.cfg.log, config=self.cfg, resume=self.state is not None,
                                 warn=lambda step, msg: self.alerts.fire(step, "logger_failed", msg))

    def mine(self, idx):
        """This rank's share of a batch's examples `idx` (all of them in one process) and its fraction of the
        batch: a trainer whose loss is a mean over examples multiplies its share's mean by that fraction, so the
        ranks' losses (and their gradients, summed) add up to the whole batch's."""
        part = self.dist.my_rows(idx)
        return part, len(part) / len(idx)

    # ------------------------------------------------------------------ the steps

    def train(self, name: str, steps: int, grad_clip: float, step_fn, evaluate=None, eval_every: int = 0,
              eval_before: bool = False, show=None, unit: str = "samples", said=None) -> dict:
        """Steps start_step+1 .. steps. step_fn(step) -> (loss, metrics, items): the step's forward pass (the loss
        to minimise, its metrics, how many samples or pairs it took). evaluate(step) -> eval/* metrics, before the
        first step when eval_before, every eval_every steps and after the last. show(metrics): the progress text;
        said(before, after): a line printed at the start (after=None) and at the end."""
        cfg, show = self.cfg, show or (lambda m: f"loss {m['loss']:.4f}")
        before = evaluate(0) if evaluate is not None and eval_before and self.start_step == 0 else {}
        if before:
            self.log.log(0, before)
        try:
            progress = cfg.log.progress if self.dist.main else "none"
            with StepProgress(steps, self.start_step, progress, cfg.log.every, name, cfg.log.every_s) as bar, \
                    GracefulStop(bar.print) as stop:
                if before and said is not None and said(before, None):
                    bar.print(said(before, None))
                t_start, step = time.perf_counter(), self.start_step
                for step in range(self.start_step + 1, steps + 1):
                    t0 = time.perf_counter()
                    lr = lr_at(step, cfg.optim, steps) * self.health.lr_scale
                    loss, metrics, items = step_fn(step)
                    grad_norm, stepped = self.optimizer_step(loss, lr, grad_clip)
                    dt = time.perf_counter() - t0
                    # each rank's share of the loss and metrics: summed, the whole batch's
                    metrics = self.dist.sum_floats({"loss": float(loss.detach()),
                                                    **{k: float(v) for k, v in metrics.items()}})
                    metrics = {**metrics, "grad_norm": grad_norm, "lr": lr, "nonfinite_skipped": float(not stepped),
                               "time/step_s": dt, f"throughput/{unit}_per_s": items / dt}
                    if evaluate is not None and eval_every and step % eval_every == 0 and step != steps:
                        metrics.update(evaluate(step))
                    self.log.log(step, metrics)
                    rate = items * (step - self.start_step) / (time.perf_counter() - t_start)
                    bar.update(step, f"{show(metrics)}  {rate:.0f} {unit}/s")
                    if self.health.observe(step, metrics):  # a non-finite streak: back to the last healthy state
                        self.rollback(step)
                    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != steps:
                        self.save(step)
                    if self.dist.any_true(stop.requested):  # SIGINT / SIGTERM: step done; checkpoint and exit
                        break
                last = self.save(step)
                if last is None:
                    raise RunStopped(f"the final checkpoint could not be written to {self.run_dir} (see alerts.jsonl)")
                after = evaluate(step) if evaluate is not None and step == steps else {}
                if after:
                    self.log.log(step, after)
                    if said is not None and said(before, after):
                        bar.print(said(before, after))
        except RunStopped:
            self.log.close()
            if self.mirror is not None:
                self.mirror.close()  # the checkpoints written so far reach the bucket
            if self.dist.main:
                mark_closed(self.run_dir, "stopped")
            rdist.stop()
            raise
        return self.close(step, steps, last, {"eval_before": before, "eval_after": after} if eval_before
                          else {"eval_after": after})

    def optimizer_step(self, loss: torch.Tensor, lr: float, grad_clip: float) -> tuple[float, bool]:
        """Backward, the gradients summed over ranks (torchrun), clipped to grad_clip (0 = no clipping), and a step;
        a loss or gradient that is not finite (on any rank) skips the step: the weights stay as they were. Returns
        the gradient norm before clipping and whether it stepped."""
        set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=True)
        if not self.dist.all_true(bool(torch.isfinite(loss))):
            return float("nan"), False
        if self.dist.sharded:  # FSDP2 averages the ranks' gradients; the ranks' losses are shares of the batch's
            (loss * self.dist.loss_scale).backward()
        else:
            loss.backward()
            self.dist.sum_grads(self.model.params)
        norm = torch.nn.utils.clip_grad_norm_(self.model.params, grad_clip if grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a DTensor
            norm = norm.full_tensor()
        if not torch.isfinite(norm):  # the same summed gradients, so the same verdict, on every rank
            self.opt.zero_grad(set_to_none=True)
            return float(norm), False
        self.opt.step()
        return float(norm), True

    def rollback(self, step: int) -> None:
        """Weights and optimizer back to the last healthy checkpoint (or the starting model, with a fresh
        optimizer), the learning rate scaled down; past health.max_rollbacks the run stops. The data order goes on,
        so the batches that went wrong are not replayed."""
        folder = self.dist.broadcast_object(ckpt.latest_healthy(self.run_dir) if self.dist.main else None)
        if self.health.rollbacks >= self.cfg.health.max_rollbacks:
            then = (f"rerun with --force to resume from {folder.name}" if folder is not None
                    else "rerun (no checkpoint was written before: the run starts again)")
            raise RunStopped(f"stopped at step {step}: the loss or gradient is still not finite after "
                             f"{self.health.rollbacks} rollbacks (see {self.run_dir / 'alerts.jsonl'}); nothing was "
                             f"exported: lower optim.lr or check the data, then {then}")
        with torch.no_grad():
            self.dist.load_model_state(self.model.module, self.model.reload(None if folder is None else folder / "model")
                                       .state_dict())
        if folder is None:
            self.opt.state.clear()
        else:
            self.dist.load_optim_state(self.model.module, self.opt, ckpt.load_checkpoint(folder)["optimizer"])
        self.health.rolled_back()
        self.alerts.fire(step, "rollback", f"rolled back to {folder.name if folder else 'the starting model'}; "
                         f"learning rate x{self.health.lr_scale:g}", lr_scale=self.health.lr_scale)

    # ------------------------------------------------------------------ checkpoints and the end

    def finite(self) -> bool:
        """Every weight finite (on every rank: under FSDP2 each checks its shards)."""
        local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                    for p in self.model.module.parameters())
        return self.dist.all_true(local)

    def save(self, step: int) -> Path | None:
        """A checkpoint (rank 0 writes; the others wait for it): weights, optimizer, data position, torch RNG,
        health, trainer and config. Not written when the weights are not finite (an alert); a failed write (disk
        full) is an alert, earlier checkpoints stay."""
        if not self.finite():
            self.alerts.fire(step, "nonfinite_weights", f"weights not finite at step {step}: no checkpoint written")
            return None
        # FSDP2: the whole weights and optimizer state gathered from the shards (collectives, every rank)
        weights, opt_state = self.dist.full_model_state(self.model.module), \
            self.dist.full_optim_state(self.model.module, self.opt, self.run_dir / "checkpoints")
        folder = self.dist.broadcast_object(self._write(step, weights, opt_state) if self.dist.main else None)
        if folder is not None:
            self.health.checkpointed()
            if self.mirror is not None:
                self.mirror.submit(folder)  # background upload; failures become alerts
        return folder

    def _write(self, step: int, weights: dict | None, opt_state: dict | None) -> Path | None:
        from regen import __version__

        try:
            return ckpt.save_checkpoint(
                self.run_dir, step, lambda folder: self.model.save(folder, weights),
                ckpt.as_saved(self.opt, opt_state), rng={"torch_cpu": torch.get_rng_state()},
                state={"data": self.data.state(), "trainer": self.trainer, "healthy": not self.health.problem,
                       "health": self.health.state(), "config": redact(self.cfg.model_dump(mode="json")),
                       "regen_version": __version__},
                keep_last=self.cfg.checkpoint.keep_last)
        except ckpt.WRITE_ERRORS as e:
            why = getattr(e, "strerror", None) or str(e)
            self.alerts.fire(step, "checkpoint_failed", f"checkpoint at step {step} not written: {why}")
            return None

    def close(self, step: int, steps: int, last: Path, summary: dict) -> dict:
        """Stopped early by a signal (the checkpoint at `step` resumes), or finished: export/ written by rank 0
        (into a temporary folder renamed when complete) unless the weights are not finite, then run.json closed and
        the process group left."""
        d = self.dist
        self.log.close()
        self.alerts.flush()
        try:
            if step < steps:
                if d.main:
                    mark_closed(self.run_dir, "stopped")
                    print(f"stopped at step {step}: checkpoint {last}; run the same command to resume")
                return {**summary, "checkpoint": str(last), "stopped_early": True}
            if not self.finite():
                self.alerts.fire(step, "nonfinite_weights", "weights not finite at the end: nothing exported")
                if d.main:
                    mark_closed(self.run_dir, "stopped")
                raise RunStopped(f"stopped at step {step}: the weights are not finite; nothing was exported (see "
                                 f"{self.run_dir / 'alerts.jsonl'})")
            weights = d.full_model_state(self.model.module)  # FSDP2: gathered from the shards (every rank)
            error = d.broadcast_object(self._export(weights) if d.main else None)
            if error is not None:
                raise UserError(error)
            return {**summary, "checkpoint": str(last), "export": str(self.run_dir / "export")}
        finally:
            if self.mirror is not None:
                self.mirror.close()  # waits for the uploads still in flight
            rdist.stop()

    def _export(self, weights: dict | None) -> str | None:
        """export/ and run.json's end (rank 0); the error line when export/ cannot be written."""
        try:
            write_folder(self.run_dir / "export", lambda folder: (self.model.export or self.model.save)(folder, weights))
        except OSError as e:
            mark_closed(self.run_dir, "stopped")
            return (f"export: cannot write {self.run_dir / 'export'}: {e.strerror or e}; the final checkpoint is in "
                    f"{self.run_dir / 'checkpoints'}: free space and run `regen export` on it")
        if self.mirror is not None:
            self.mirror.submit_export(self.run_dir / "export")
        mark_closed(self.run_dir, "finished")
        return None
