"""The RL loop: prompts -> sample -> score -> advantage -> update -> sync, top to bottom.

Modality-specific work sits behind the policy (`regen.policies`), the math in pure
functions (`regen.algorithms`); this file only orders them and keeps the books (metrics,
evaluation, checkpoints). Single process; `breakpoint()` works anywhere in it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from regen import __version__
from regen.algorithms import ADVANTAGES, POLICY_LOSSES
from regen.config import RLConfig, dump_config
from regen.data import EpochSampler, load_prompts
from regen.errors import RunStopped, UserError
from regen.evaluate import fmt_eval, run_eval
from regen.policies.lm import LMPolicy, LMRollout, load_model_and_tokenizer, resolve_device
from regen.rewards import CombinedReward, Sample
from regen.runtime import checkpoint as ckpt
from regen.runtime.alerts import Alerts
from regen.runtime.metrics import MetricsLogger
from regen.runtime.optim import lr_at, make_optimizer, set_lr
from regen.runtime.progress import StepProgress
from regen.runtime.rundir import prepare, setup_torch


def _minibatching(cfg: RLConfig) -> tuple[int, int, bool]:
    """(minibatch size, rows sharing a prompt inside a minibatch, single on-policy pass?)"""
    B, mb, n = cfg.rollout.global_batch_size, cfg.train.global_minibatch_size, cfg.rollout.group_size
    # Minibatches of whole groups let each group's prompt be computed once (see token_logprobs).
    return mb, (n if mb % n == 0 else 1), cfg.train.ppo_epochs == 1 and mb == B


@torch.no_grad()
def fixed_logprobs(policy: LMPolicy, batch: LMRollout, cfg: RLConfig):
    """Log-probs that stay fixed during the update: the behaviour policy's (old) and the
    reference's. They need no rewards, so the loop computes them while scoring runs."""
    mb, share, single_pass = _minibatching(cfg)
    temp, chunks = cfg.rollout.temperature, torch.arange(batch.input_ids.shape[0]).split(mb)
    # In a single on-policy pass the old log-probs equal the new ones before the step, so
    # the update reuses its own forward (detached) instead of paying for another.
    old_logp = None if single_pass else torch.cat(
        [policy.token_logprobs(batch.select(i), temp, group_size=share)[0] for i in chunks]
    )
    ref_logp = None if policy.ref is None else torch.cat(
        [policy.token_logprobs(batch.select(i), temp, use_ref=True, group_size=share)[0] for i in chunks]
    )
    return old_logp, ref_logp


def update(
    policy: LMPolicy, opt, batch: LMRollout, adv: torch.Tensor, mask: torch.Tensor, old_logp, ref_logp,
    cfg: RLConfig, gen,
) -> dict[str, float]:
    """ppo_epochs passes over the batch in minibatches, one optimizer step per minibatch."""
    a, t = cfg.algorithm, cfg.train
    temp, B = cfg.rollout.temperature, mask.shape[0]
    mb, share, single_pass = _minibatching(cfg)
    loss_fn = POLICY_LOSSES[a.name]
    sums: dict[str, float] = {}
    n_steps = skipped = 0
    params = [p for p in policy.model.parameters() if p.requires_grad]
    for _ in range(t.ppo_epochs):
        order = torch.arange(B) if single_pass else _shuffle_groups(B, share, gen)
        for idx in order.split(mb):
            sub = batch.select(idx)
            logp, entropy = policy.token_logprobs(sub, temp, with_entropy=True, group_size=share)
            loss, m = loss_fn(
                logp,
                logp.detach() if old_logp is None else old_logp[idx],
                adv[idx],
                mask[idx],
                ref_logp=None if ref_logp is None else ref_logp[idx],
                clip_low=a.clip_low,
                clip_high=a.clip_high,
                kl_coef=a.kl_coef,
                kl_estimator=a.kl_estimator,
                agg=a.loss_agg,
                norm=float(cfg.rollout.max_new_tokens),
            )
            opt.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                skipped += 1  # a non-finite loss would poison the weights: skip this step
                continue
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else float("inf"))
            if not torch.isfinite(grad_norm):
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            opt.step()
            m["grad_norm"] = grad_norm
            m["entropy"] = (entropy * sub.response_mask).sum() / sub.response_mask.sum().clamp(min=1)
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n_steps += 1
    out = {k: v / max(n_steps, 1) for k, v in sums.items()}
    out["nonfinite_skipped"] = float(skipped)
    return out


def _shuffle_groups(B: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A random order of the B rows that keeps each group of n consecutive rows together."""
    groups = torch.randperm(B // n, generator=gen, device=gen.device).cpu()
    return (groups[:, None] * n + torch.arange(n)).flatten()


def train(cfg: RLConfig, resume: bool = False) -> dict:
    # Check everything the user gave before touching the run directory.
    device = resolve_device(cfg.run.device)
    reward = CombinedReward.from_config(cfg.reward)
    prompts = load_prompts(cfg.data.train, cfg.task, "data.train")
    eval_items = load_prompts(cfg.data.eval, cfg.task, "data.eval") if cfg.data.eval else []
    if len(prompts) < cfg.prompts_per_step:
        raise UserError(f"data.train: {len(prompts)} prompts, fewer than the {cfg.prompts_per_step} needed per step")
    run_dir = prepare(cfg.run.dir, cfg.run.overwrite, resume)
    setup_torch(cfg.run.threads, cfg.run.seed)

    state = ckpt.load_latest(run_dir) if resume else None
    model, tok = load_model_and_tokenizer(ckpt.resumed_model(cfg.model, state), cfg.task, cfg.run.seed)
    reference = None
    if cfg.algorithm.kl_coef > 0:  # the KL reference is the run's starting model, also after a resume
        reference = "copy" if state is None else load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)[0]
    policy = LMPolicy(model, tok, device, reference=reference)
    policy.model.eval()  # dropout off: sampling and training must see the same function (ratio 1 on-policy)
    opt = make_optimizer(policy.model, cfg.optim)
    data = EpochSampler(len(prompts), cfg.run.seed)
    gen = torch.Generator(device=device).manual_seed(cfg.run.seed)
    start_step = ckpt.restore(state, run_dir, opt, data, gen) if state else 0
    dump_config(cfg, run_dir / "config.yaml")
    log = MetricsLogger(run_dir, cfg.log.tensorboard)

    def save(step: int) -> Path:
        return ckpt.save_checkpoint(
            run_dir, step, policy.save_pretrained, opt,
            rng={"sampler": gen.get_state(), "torch_cpu": torch.get_rng_state()},
            state={"data": data.state(), "regen_version": __version__, "reward_versions": reward.versions()},
            keep_last=cfg.checkpoint.keep_last,
        )

    n = cfg.rollout.group_size
    r = cfg.rollout
    alerts = Alerts(run_dir)
    scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-score")
    unscored = 0  # consecutive steps in which no sample got a score
    expected_versions = state["state"].get("reward_versions") if state else None
    before = run_eval(policy, eval_items, cfg, reward) if eval_items and start_step == 0 else {}
    if before:
        log.log(0, before)
    summary = {"eval_before": before}
    with StepProgress(cfg.train.steps, start_step, cfg.log.progress, cfg.log.every, "grpo") as bar:
        alerts.echo = bar.print  # alerts go above the live bar, not through it
        if before:
            bar.print(f"held-out before training: {fmt_eval(before)}")
        for step in range(start_step + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            # 1. sample: a group of n completions for each prompt of this step
            items = [prompts[i] for i in data.take(cfg.prompts_per_step)]
            batch = policy.sample([it.prompt for it in items], n, r.temperature, r.top_p, r.max_new_tokens, gen)
            t1 = time.perf_counter()

            # 2. score: one reward per completion; NaN = missing (excluded, never zero). Scoring
            # runs in the background while the reference / behaviour log-probs are computed.
            finished = batch.finished.tolist()
            samples = [
                Sample(items[i // n].prompt, batch.completions[i], items[i // n].meta, finished[i])
                for i in range(len(batch.completions))
            ]
            scoring = scorer.submit(reward, samples)
            old_logp, ref_logp = fixed_logprobs(policy, batch, cfg)
            t_wait = time.perf_counter()
            total, parts = scoring.result()
            rewards = torch.tensor(total, dtype=torch.float32)
            t2 = time.perf_counter()

            # 3. advantage: group-relative; missing rewards and degenerate groups get no gradient
            adv, valid, adv_m = ADVANTAGES[cfg.algorithm.advantage](rewards, n, cfg.algorithm.std_normalize)
            mask = batch.response_mask * valid.to(batch.response_mask.dtype).unsqueeze(1).to(device)
            adv = adv.to(device)
            missing = float(adv_m["missing_frac"])
            if missing > cfg.health.missing_alert_frac:
                alerts.fire(step, "reward_missing", f"{missing:.0%} of rewards missing", missing_frac=missing)
            if expected_versions and reward.versions() != expected_versions:
                alerts.fire(step, "scorer_version_changed", f"reward versions {expected_versions} at the checkpoint, "
                            f"now {reward.versions()}: rewards before and after are not comparable")
                expected_versions = None

            # 4. update: clipped policy loss over minibatches, several epochs. Skipped when no
            # sample got a score: an optimizer step on zero gradients would still move the
            # weights through Adam's momentum.
            lr = lr_at(step, cfg.optim, cfg.train.steps)
            set_lr(opt, lr)
            scored = bool(valid.any())
            unscored = 0 if scored else unscored + 1
            if scored:
                upd = update(policy, opt, batch, adv, mask, old_logp, ref_logp, cfg, gen)
            else:
                upd = {"update_skipped": 1.0}
            t3 = time.perf_counter()

            # 5. sync: the sampler is the trained model itself in a single process: nothing to move.

            lengths = batch.response_mask.sum(1)
            finite = rewards[torch.isfinite(rewards)]
            metrics = {
                "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
                "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
                **{f"reward/{k}": _nanmean(v) for k, v in parts.items()},
                "reward/missing_frac": float(adv_m["missing_frac"]),
                "reward/zero_std_frac": float(adv_m["zero_std_frac"]),
                "loss": upd.pop("loss", float("nan")),
                "kl": upd.pop("kl", 0.0),
                "clip_frac": upd.pop("clip_frac", 0.0),
                "entropy": upd.pop("entropy", float("nan")),
                **upd,
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                "response/truncated_frac": float((~batch.finished).float().mean()),
                "lr": lr,
                "time/sample_s": t1 - t0,
                "time/score_s": t2 - t_wait,  # waiting for scores after the overlapped log-prob passes
                "time/logprob_s": t_wait - t1,
                "time/update_s": t3 - t2,
                "time/step_s": t3 - t0,
                "throughput/samples_per_s": len(samples) / (t3 - t0),
                **reward.stats(),
            }
            if eval_items and cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                metrics.update(run_eval(policy, eval_items, cfg, reward))
            log.log(step, metrics)
            bar.update(step, f"reward {metrics['reward/mean']:.3f}  {metrics['throughput/samples_per_s']:.0f} samples/s")
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.train.steps:
                save(step)
            if unscored >= cfg.health.stop_after_unscored_steps:
                save(step)
                alerts.fire(step, "run_stopped", f"no reward came back for {unscored} consecutive steps")
                raise RunStopped(
                    f"stopped at step {step}: no reward came back for {unscored} consecutive steps "
                    f"(see {run_dir / 'alerts.jsonl'}); a checkpoint was written: fix the scorer and rerun with --resume"
                )

        last = save(cfg.train.steps)
        after = run_eval(policy, eval_items, cfg, reward) if eval_items else {}
        if after:
            log.log(cfg.train.steps, after)
    log.close()
    scorer.shutdown()
    export_dir = run_dir / "export"
    policy.save_pretrained(export_dir)
    summary.update(eval_after=after, checkpoint=str(last), export=str(export_dir))
    return summary


def _nanmean(xs: list[float]) -> float:
    ok = [x for x in xs if x == x]
    return sum(ok) / len(ok) if ok else float("nan")

