"""`regen sft` for flow models: rectified-flow pretraining on the built-in shapes (images) or
moving shapes (videos), drawn fresh for every batch. It gives the RL base: a model that
draws the prompted colour, shape and place, imperfectly, in a few CPU minutes."""

from __future__ import annotations

import torch

from regen.config import SFTConfig
from regen.data import EpochSampler, PromptItem
from regen.errors import UserError
from regen.modalities.flow import to_samples
from regen.modalities.flow_media import save_media
from regen.offline.books import Model, OfflineRun
from regen.policies.flow_load import is_flow_model, load_flow_policy  # noqa: F401  (re-exported)
from regen.policies.lm import resolve_device
from regen.quality import Quality, gates
from regen.runtime import checkpoint as ckpt
from regen.runtime.loggers import require as require_loggers
from regen.runtime.rundir import setup_torch


def _task_metas(spec: str, video: bool, where: str) -> list[dict]:
    from regen.tasks import shapes

    kind = "moving-shapes" if video else "shapes"
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "builtin" or parts[1] != kind or parts[2] not in ("train", "test"):
        raise UserError(f"{where}: '{spec}' is not a data set this model draws from (use builtin:{kind}:train "
                        f"or builtin:{kind}:test)")
    train, test = shapes.split("video" if video else "image")
    return train if parts[2] == "train" else test


def sft_flow(cfg: SFTConfig, resume: bool = False, force: bool = False) -> dict:
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
    if cfg.distributed.strategy == "fsdp":
        raise UserError("distributed.strategy=fsdp: regen sft of a flow model is data parallel with ddp only (its "
                        "UNet has no repeated blocks to shard)")
    with OfflineRun.starting(cfg, "flow_sft", device, (cfg.sft.global_batch_size, "sft.global_batch_size"), resume,
                             force) as run:
        setup_torch(cfg.run.threads, cfg.run.seed)
        policy = load_flow_policy(ckpt.resumed_model(cfg.model, run.state), cfg.run.seed, device)
        video = len(policy.sample_shape) == 4  # (F, C, H, W) samples
        train = _task_metas(cfg.data.train, video, "data.train")
        held = _task_metas(cfg.data.eval, video, "data.eval") if cfg.data.eval else []
        trained = torch.nn.ModuleList([policy.unet, policy.encoder])

        def reload(folder):
            source = cfg.model if folder is None else cfg.model.model_copy(update={"path": str(folder), "init": None})
            p = load_flow_policy(source, cfg.run.seed, device)
            return torch.nn.ModuleList([p.unet, p.encoder])

        run.begin(Model(trained, lambda folder, _: policy.save_pretrained(folder), reload,
                        lambda folder, _: policy.export(folder)), cfg.optim,
                  EpochSampler(len(train), cfg.run.seed))
    s = cfg.sft

    def evaluate(step: int) -> dict[str, float]:
        """Samples for the held-out prompts (fixed noise: comparable between steps), saved as media (rank 0:
        its own generator, so the other ranks' random streams stay where rank 0's are)."""
        if not run.dist.main:
            return {}
        gen = torch.Generator().manual_seed(cfg.run.seed + 7919)
        prompts = [shapes.prompt_text(m) for m in held[: cfg.eval.num_prompts]]
        policy.train(False)
        out = policy.sample_ode(prompts, cfg.eval.samples_per_prompt, gen, steps=20, shift=None)  # the model's own grid
        policy.train(True)
        save_media(run.run_dir, step, out, policy=policy)
        if not quality:
            return {}
        items = [PromptItem(p, dict(m)) for p, m in zip(prompts, held)]
        metrics = {f"eval/{k}": v for k, v in quality(to_samples(policy, out, items, cfg.eval.samples_per_prompt),
                                                      step).items()}
        return metrics | gates.check(cfg.eval.gates, metrics)

    def step_fn(step: int):
        metas = [train[i] for i in run.data.take(s.global_batch_size)]
        # the whole batch drawn on every rank (the torch RNG: saved in checkpoints, so resume is exact), each rank's
        # loss its rows' share of the batch's: summed over the ranks, one process's loss and gradient
        x0 = shapes.draw(metas).to(device)
        part, frac = run.mine(torch.arange(len(metas)))
        loss = policy.flow_matching_loss(x0, [shapes.prompt_text(m) for m in metas], None, rows=part)
        return loss * frac, {}, len(metas)

    policy.train(True)
    return run.train("sft", s.steps, s.grad_clip, step_fn, evaluate if held else None, cfg.eval.every)
