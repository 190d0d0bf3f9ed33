"""The RL loop for flow-matching image/video models: prompts -> sample -> score -> advantage
-> update -> sync, the same five stages as `regen.loop` for language models.

Why a second file: what a flow method trains on differs in kind from a token sequence —
re-scored SDE transitions (Flow-GRPO, Flow-DPPO: the LM's clipped ratio over denoising steps
instead of tokens) or clean ODE samples pushed back through the forward process (DiffusionNFT,
AWM: no likelihood at all). The math is in `regen.algorithms.flow`, the model behind
`regen.policies.flow`; this file orders them and keeps the books.
"""

from __future__ import annotations

import time

import torch

from regen.algorithms.flow import (
    awm_loss,
    flow_dppo_loss,
    flow_group_advantages,
    flow_grpo_loss,
    gaussian_mean_kl,
    nft_loss,
    nft_optimality,
)
from regen.algorithms.losses import batch_denominators
from regen.config import RLConfig
from regen.policies.flow import FlowPolicy, FlowSample
from regen.rewards import Sample
from regen.rollout import group_rows
from regen.runtime.dist import Dist
from regen.runtime.metrics import nanmean
from regen.runtime.precision import Precision
from regen.samplers.flow import sde_steps, window_start

PER_STEP = ("flow_grpo", "flow_dppo")  # trained on re-scored SDE transitions


def trained_steps(cfg: RLConfig, step: int, gen: torch.Generator) -> torch.Tensor:
    """(S,) bool: the SDE steps of this step's rollouts (none for the ODE methods)."""
    f = cfg.flow
    if cfg.algorithm.name not in PER_STEP:
        return torch.zeros(f.steps, dtype=torch.bool)
    if f.sde_window is None:
        return sde_steps(f.steps, "all")
    start = window_start(step - 1, f.steps, f.sde_window, f.window_policy, generator=gen,
                         shift_every=f.window_shift_every, start=f.window_start)
    return sde_steps(f.steps, "window", f.sde_window, start)


def to_samples(policy: FlowPolicy, batch: FlowSample, items, n: int) -> list[Sample]:
    """What a reward sees: the prompt, its row's attributes, and the pixels as uint8 (the
    policy decodes latents; (H, W, 3) images, (F, H, W, 3) videos)."""
    from regen.tasks.shapes import to_uint8

    with torch.no_grad():
        pix = to_uint8(policy.decode(batch.x0).cpu()).numpy()
    return [Sample(items[i // n].prompt, "", items[i // n].meta, True, pix[i]) for i in range(len(pix))]


def sample(policy: FlowPolicy, items, cfg: RLConfig, gen: torch.Generator, sde: torch.Tensor, d: Dist) -> FlowSample:
    """n samples per prompt of `items`; under torchrun each rank draws its groups (with the
    noise of the whole batch, sliced) and every rank gets the whole batch."""
    f, n = cfg.flow, cfg.rollout.group_size
    groups = d.my_rows(torch.arange(len(items)))
    part = policy.rollout([items[g].prompt for g in groups.tolist()], n, gen, f.steps, sde, f.noise_level, f.sampler,
                          f.shift, f.guidance, keep_states=bool(sde.any()), rows=group_rows(groups, n),
                          total=len(items) * n)
    if not d.on:
        return part
    return FlowSample.concat(d.gather_objects(part.to("cpu"))).to(policy.device)


@torch.no_grad()
def fixed_terms(policy: FlowPolicy, batch: FlowSample, cfg: RLConfig, ref, d: Dist | None = None) -> dict:
    """What stays fixed during the update of a per-step method: the behaviour policy's
    log-probs and means (only needed after the first pass over the batch) and the reference's
    means for the KL term. Under torchrun each rank computes its rows; all ranks get all."""
    f, t, d = cfg.flow, cfg.train, d or Dist()
    out: dict = {}
    if cfg.algorithm.name not in PER_STEP:
        return out
    mine = batch.select(d.my_rows(torch.arange(len(batch.prompts))))
    single_pass = t.ppo_epochs == 1 and t.global_minibatch_size == cfg.rollout.global_batch_size
    if not single_pass:
        logp, means, _ = policy.step_logprobs(mine, f.noise_level, f.sampler, f.guidance)
        out["logp"], out["means"] = d.gather_rows(logp), _gather_means(means, d)
    if f.kl_coef > 0:
        out["ref_means"] = _gather_means(policy.step_logprobs(mine, f.noise_level, f.sampler, f.guidance, unet=ref)[1], d)
    return out


def _gather_means(means: list, d: Dist) -> list:
    return [None if m is None else d.gather_rows(m) for m in means]


def _step_kl(means: list, other: list, stds: list[float], B: int) -> torch.Tensor:
    """(B, S) exact KL between the Gaussians of each SDE step (0 on ODE steps); `means` and
    `other` hold (B, *x) per SDE step and None on ODE steps."""
    kl = torch.zeros(B, len(means), device=next(m for m in means if m is not None).device)
    for i, (m, o) in enumerate(zip(means, other)):
        if m is not None:
            kl[:, i] = gaussian_mean_kl(m, o, stds[i], batch_dims=1)
    return kl


def _rows(means: list, rows) -> list:
    return [None if m is None else m[rows] for m in means]


def minibatch_loss(policy: FlowPolicy, sub: FlowSample, rows, adv, valid, mask, fixed, denoms, cfg: RLConfig,
                   noise, ema):
    """(loss, metrics) of one micro-batch for the configured method. noise: the ODE methods'
    (t (B,), eps (B, *x)) for these rows, drawn for the whole minibatch (see update)."""
    a, f = cfg.algorithm.name, cfg.flow
    B = len(rows)
    if a in PER_STEP:
        logp, means, stds = policy.step_logprobs(sub, f.noise_level, f.sampler, f.guidance)
        # first pass over a batch: the behaviour policy is the current one (ratio 1, KL 0)
        old = logp.detach() if "logp" not in fixed else fixed["logp"][rows]
        if a == "flow_grpo":
            kl = _step_kl(means, _rows(fixed["ref_means"], rows), stds, B) if f.kl_coef > 0 else None
            return flow_grpo_loss(logp, old, adv, mask, f.clip_range, kl, f.kl_coef, denoms)
        now = [None if m is None else m.detach() for m in means]
        old_means = _rows(fixed["means"], rows) if "means" in fixed else now
        return flow_dppo_loss(logp, old, adv, mask, _step_kl(now, old_means, stds, B), f.dppo_tau, denoms)
    # ODE methods: a random point of the forward process for each clean sample
    x0 = sub.x0
    t, eps = (z.to(policy.device) for z in noise)
    tt = t.view(B, *[1] * (x0.dim() - 1))
    xt = (1 - tt) * x0 + tt * eps
    cond = policy.encoder(sub.prompts)
    v = policy.velocity(xt, t, cond)
    if a == "nft":
        with torch.no_grad():
            v_old = policy.velocity(xt, t, cond, unet=ema)
        r = nft_optimality(adv, f.adv_clip, valid)
        return nft_loss(v, v_old, x0, xt, t, r, f.nft_beta, denoms=denoms)
    weight = None if f.awm_weight == "uniform" else f.awm_weight
    anchor = None
    if ema is not None:  # awm_kl_coef > 0: the EMA anchor's velocity at the same point
        with torch.no_grad():
            anchor = policy.velocity(xt, t, cond, unet=ema)
    return awm_loss(v, x0, eps, t, adv, weight=weight, valid=valid, denoms=denoms, v_anchor=anchor,
                    anchor_coef=f.awm_kl_coef)


def update(policy: FlowPolicy, opt, batch: FlowSample, adv, valid, cfg: RLConfig, gen, fixed, ema,
           prec: Precision | None = None, d: Dist | None = None) -> dict:
    """ppo_epochs passes in minibatches, each one optimizer step accumulated over micro-batches
    with the minibatch's own denominators and the ODE methods' noise drawn for the whole
    minibatch (so micro-batching never changes the loss). prec: train.precision (autocast of
    the forward passes, loss scaling). d: under torchrun each rank takes its share of every
    minibatch and DDP averages the gradients (the loss is scaled by the world size to sum)."""
    prec, d = prec or Precision("fp32", policy.device), d or Dist()
    t, a = cfg.train, cfg.algorithm.name
    B = len(adv)
    mb, micro = t.global_minibatch_size, t.micro_batch_size or t.global_minibatch_size
    per_step = a in PER_STEP
    mask = (batch.sde[None, :] & valid[:, None]).float() if per_step else valid[:, None].float()
    params = [p for p in policy.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    n_steps = 0
    for _ in range(t.ppo_epochs):
        order = torch.arange(B) if t.ppo_epochs == 1 and mb == B else torch.randperm(B, generator=gen)
        for idx in order.split(mb):
            denoms = batch_denominators(mask[idx])
            noise = None if per_step else (torch.rand(len(idx), generator=gen),
                                           torch.randn((len(idx), *batch.x0.shape[1:]), generator=gen))
            opt.zero_grad(set_to_none=True)
            step_m: dict[str, float] = {}
            for pos in d.my_rows(torch.arange(len(idx))).split(micro):  # positions in the minibatch
                part = idx[pos]
                with prec.autocast():
                    loss, m = minibatch_loss(policy, batch.select(part), part, adv[part], valid[part], mask[part],
                                             fixed, denoms, cfg, None if noise is None else (noise[0][pos], noise[1][pos]),
                                             ema)
                prec.backward(loss * d.loss_scale)
                for k, v in m.items():
                    step_m[k] = step_m.get(k, 0.0) + float(v) * (1.0 if k in ("loss", "pg_loss") else len(part) / len(idx))
            step_m = d.sum_floats(step_m)
            gn, stepped = prec.step(opt, params, t.grad_clip)
            if not stepped:
                opt.zero_grad(set_to_none=True)
                sums["nonfinite_skipped"] = sums.get("nonfinite_skipped", 0.0) + 1
                continue
            step_m["grad_norm"] = float(gn)
            for k, v in step_m.items():
                sums[k] = sums.get(k, 0.0) + v
            n_steps += 1
    return {k: v / (1 if k == "nonfinite_skipped" else max(n_steps, 1)) for k, v in sums.items()}


def train_flow(cfg: RLConfig, resume: bool = False, force: bool = False) -> dict:
    from regen.flow_session import FlowRun
    from regen.runtime.optim import lr_at, set_lr
    from regen.runtime.progress import StepProgress
    from regen.runtime.signals import GracefulStop

    run = FlowRun.start(cfg, resume, force)
    policy, opt, gen, n = run.policy, run.opt, run.gen, cfg.rollout.group_size
    f = cfg.flow
    summary: dict = {"eval_before": {}, "eval_after": {}, "checkpoint": None, "stopped_early": False}
    if run.eval_items and run.start_step == 0:
        summary["eval_before"] = run.evaluate(0)
        run.log.log(0, summary["eval_before"])
    with StepProgress(cfg.train.steps, run.start_step, cfg.log.progress, cfg.log.every, cfg.algorithm.name) as bar, \
            GracefulStop(bar.print) as stop:
        step = run.start_step
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            # 1. sample: n images (videos) per prompt; SDE steps where the method trains on them
            run.hooks.enter("sample")  # train.offload: optimizer state and idle copies leave the GPU
            items = [run.prompts[i] for i in run.data.take(cfg.prompts_per_step)]
            sde = trained_steps(cfg, step, gen)
            with run.precision.autocast():  # here (torchrun: each rank its groups), or on Ray actors
                batch = run.rollout.sample(items, gen, sde)
            t1 = time.perf_counter()
            # 2. score: black-box rewards on the pixels; NaN = missing
            total, parts = run.reward(to_samples(policy, batch, items, n))
            rewards = torch.tensor(total, dtype=torch.float32)
            t2 = time.perf_counter()
            # 3. advantage: group-relative, clipped; missing rewards and degenerate groups excluded
            adv, valid, adv_m = flow_group_advantages(rewards, n, f.global_std, f.adv_clip)
            adv, valid = adv.to(policy.device), valid.to(policy.device)
            # 4. update
            lr = lr_at(step, cfg.optim, cfg.train.steps) * run.health.lr_scale
            set_lr(opt, lr)
            run.hooks.enter("update")
            with run.precision.autocast():  # the same autocast as the update's: on-policy ratio 1
                fixed = fixed_terms(policy, batch, cfg, run.ref, run.dist)
            upd = update(policy, opt, batch, adv, valid, cfg, gen, fixed, run.ema, run.precision, run.dist) \
                if valid.any() else {}
            run.follow(step)  # NFT's old policy and the weight EMA
            t3 = time.perf_counter()
            # 5. sync: new weights to the rollout actors (nothing to move when the trained model samples)
            metrics_sync = run.rollout.sync(step)
            finite = rewards[torch.isfinite(rewards)]
            metrics = {
                "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
                "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
                **{f"reward/{k}": nanmean(v) for k, v in parts.items()},
                **{f"reward/{k}": float(v) for k, v in adv_m.items() if k in ("zero_std_frac", "missing_frac")},
                "loss": upd.pop("loss", float("nan")), **upd, "lr": lr, "sde_steps": float(sde.sum()),
                "time/sample_s": t1 - t0, "time/score_s": t2 - t1, "time/update_s": t3 - t2, "time/step_s": t3 - t0,
                "throughput/samples_per_s": len(rewards) / (t3 - t0), **metrics_sync, **run.rollout.stats(),
            }
            if run.eval_items and cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                metrics.update(run.evaluate(step))
            run.log.log(step, metrics)
            bar.update(step, f"reward {metrics['reward/mean']:.3f}  {metrics['throughput/samples_per_s']:.1f} samples/s")
            if run.health.observe(step, metrics):  # a non-finite streak or a collapse: back to a healthy checkpoint
                run.rollback(step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.train.steps:
                run.save(step)
            if run.dist.any_true(stop.requested):  # torchrun: every rank stops at the same step
                summary["stopped_early"] = True
                break
        summary["checkpoint"] = run.save(step)
        if run.eval_items and not summary["stopped_early"]:
            summary["eval_after"] = run.evaluate(step)
            run.log.log(step, summary["eval_after"])
    summary["export"] = str(run.run_dir / "export")
    if not summary["stopped_early"]:
        run.export(run.run_dir / "export")  # rank 0 writes
    run.close()
    return summary
