"""`regen sft` for flow models: rectified-flow pretraining on the built-in shapes (images) or
moving shapes (videos), drawn fresh for every batch. It gives the RL base: a model that
draws the prompted colour, shape and place, imperfectly, in a few CPU minutes."""

from __future__ import annotations

import time

import torch

from regen.config import SFTConfig, dump_config
from regen.data import EpochSampler, PromptItem
from regen.errors import UserError
from regen.modalities.flow import to_samples
from regen.modalities.flow_media import save_media
from regen.offline import close_offline
from regen.policies.flow_load import is_flow_model, load_flow_policy  # noqa: F401  (re-exported)
from regen.policies.lm import resolve_device
from regen.quality import Quality, gates
from regen.runtime import checkpoint as ckpt
from regen.runtime.loggers import require as require_loggers
from regen.runtime.metrics import MetricsLogger
from regen.runtime.optim import lr_at, make_optimizer, sft_step
from regen.runtime.progress import StepProgress
from regen.runtime.rundir import mark_running, prepare, setup_torch
from regen.runtime.signals import GracefulStop


def _task_metas(spec: str, video: bool, where: str) -> list[dict]:
    from regen.tasks import shapes

    kind = "moving-shapes" if video else "shapes"
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "builtin" or parts[1] != kind or parts[2] not in ("train", "test"):
        raise UserError(f"{where}: '{spec}' is not a data set this model draws from (use builtin:{kind}:train "
                        f"or builtin:{kind}:test)")
    train, test = shapes.split("video" if video else "image")
    return train if parts[2] == "train" else test


def sft_flow(cfg: SFTConfig, resume: bool = False) -> dict:
    from regen.tasks import shapes

    device = resolve_device(cfg.run.device)
    require_loggers(cfg.log)
    if cfg.model.lora is not None:
        raise UserError("model.lora: flow-matching pretraining (regen sft) trains every weight; LoRA is for "
                        "`regen train` of a flow model")
    if cfg.eval.reference == "base":
        raise UserError("eval.reference=base measures drift from the starting model during RL; flow pretraining "
                        "starts from noise: use eval.reference=shapes (the true drawings) or a folder of images")
    quality = Quality(cfg.eval, "flow", cfg.run.seed)  # a wrong metric setting stops before the run dir
    run_dir, resume = prepare(cfg.run.dir, cfg.run.overwrite, resume)
    setup_torch(cfg.run.threads, cfg.run.seed)
    state = ckpt.load_latest(run_dir) if resume else None
    policy = load_flow_policy(ckpt.resumed_model(cfg.model, state), cfg.run.seed, device)
    video = len(policy.sample_shape) == 4  # (F, C, H, W) samples
    train = _task_metas(cfg.data.train, video, "data.train")
    held = _task_metas(cfg.data.eval, video, "data.eval") if cfg.data.eval else []
    opt = make_optimizer(torch.nn.ModuleList([policy.unet, policy.encoder]), cfg.optim)
    data = EpochSampler(len(train), cfg.run.seed)
    start_step = ckpt.restore(state, run_dir, opt, data) if state else 0
    dump_config(cfg, run_dir / "config.yaml")
    mark_running(run_dir)
    log = MetricsLogger(run_dir, cfg.log, config=cfg, resume=state is not None)
    s = cfg.sft
    params = policy.parameters()

    def evaluate(step: int) -> dict[str, float]:
        """Samples for the held-out prompts (fixed noise: comparable between steps), saved as media."""
        gen = torch.Generator().manual_seed(cfg.run.seed + 7919)
        prompts = [shapes.prompt_text(m) for m in held[: cfg.eval.num_prompts]]
        policy.train(False)
        out = policy.sample_ode(prompts, cfg.eval.samples_per_prompt, gen, steps=20)
        policy.train(True)
        save_media(run_dir, step, out, policy=policy)
        if not quality:
            return {}
        items = [PromptItem(p, dict(m)) for p, m in zip(prompts, held)]
        metrics = {f"eval/{k}": v for k, v in quality(to_samples(policy, out, items, cfg.eval.samples_per_prompt),
                                                      step).items()}
        return metrics | gates.check(cfg.eval.gates, metrics)

    policy.train(True)
    with StepProgress(s.steps, start_step, cfg.log.progress, cfg.log.every, "sft", cfg.log.every_s) as bar, \
            GracefulStop(bar.print) as stop:
        t_start = time.perf_counter()
        step = start_step
        for step in range(start_step + 1, s.steps + 1):
            t0 = time.perf_counter()
            metas = [train[i] for i in data.take(s.global_batch_size)]
            x0 = shapes.draw(metas).to(device)  # the torch RNG: saved in checkpoints, so resume is exact
            loss = policy.flow_matching_loss(x0, [shapes.prompt_text(m) for m in metas], None)
            lr = lr_at(step, cfg.optim, s.steps)
            gn = sft_step(opt, loss, params, lr, s.grad_clip)
            dt = time.perf_counter() - t0
            metrics = {"loss": loss.item(), "grad_norm": float(gn), "lr": lr, "time/step_s": dt,
                       "throughput/samples_per_s": s.global_batch_size / dt}
            if held and cfg.eval.every and step % cfg.eval.every == 0 and step != s.steps:
                metrics.update(evaluate(step))
            log.log(step, metrics)
            rate = s.global_batch_size * (step - start_step) / (time.perf_counter() - t_start)
            bar.update(step, f"loss {metrics['loss']:.4f}  {rate:.0f} samples/s")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != s.steps:
                ckpt.save_offline(run_dir, step, policy, opt, data, cfg.checkpoint.keep_last)
            if stop.requested:  # SIGINT / SIGTERM: this step is done; checkpoint and exit
                break
        last = ckpt.save_offline(run_dir, step, policy, opt, data, cfg.checkpoint.keep_last)
        after = evaluate(step) if held and step == s.steps else {}
        if after:
            log.log(step, after)
    return close_offline(run_dir, log, step, s.steps, last, policy.export, {"eval_after": after})
