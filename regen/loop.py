"""The RL loop: prompts -> sample -> score -> advantage -> update -> sync, top to bottom.

Modality-specific work sits behind the policy (`regen.policies`), the math in pure
functions (`regen.algorithms`); this file only orders them and keeps the books (metrics,
evaluation, checkpoints). Single process; `breakpoint()` works anywhere in it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from regen.algorithms import ADVANTAGES, POLICY_LOSSES, overlong_penalty
from regen.algorithms.gae import explained_variance, token_advantages
from regen.algorithms.losses import batch_denominators
from regen.config import RLConfig
from regen.errors import RunStopped, UserError
from regen.evaluate import fmt_eval, run_eval
from regen.placement import which_loop
from regen.policies.lm import LMPolicy, LMRollout, concat_rollouts
from regen.rewards import Sample
from regen.runtime.dist import Dist
from regen.runtime.metrics import nanmean
from regen.runtime.optim import lr_at, set_lr
from regen.runtime.precision import Precision
from regen.runtime.progress import StepProgress
from regen.runtime.signals import GracefulStop
from regen.session import Session


def _minibatching(cfg: RLConfig, d: Dist | None = None) -> tuple[int, int, int, bool]:
    """(minibatch size, rows kept together in minibatches, rows sharing a prompt's forward,
    single on-policy pass?)"""
    B, mb, n = cfg.rollout.global_batch_size, cfg.train.global_minibatch_size, cfg.rollout.group_size
    d = d or Dist()
    unit = n if mb % n == 0 else 1  # minibatches of whole groups when they fit
    # Whole groups let each group's prompt be computed once (see token_logprobs); under torchrun
    # each rank's share of a minibatch must hold whole groups for that. FSDP2 needs the same
    # number of forwards on every rank, which the prompt sharing (length buckets) does not give.
    share = unit if (mb // d.world) % unit == 0 and not d.sharded else 1
    return mb, unit, share, cfg.train.ppo_epochs == 1 and mb == B


@torch.no_grad()
def fixed_logprobs(policy: LMPolicy, batch: LMRollout, cfg: RLConfig, d: Dist | None = None):
    """Log-probs that stay fixed during the update: the behaviour policy's (old) and the
    reference's. They need no rewards, so the loop computes them while scoring runs. Under
    torchrun each rank computes its own groups' rows and every rank gets all of them."""
    d = d or Dist()
    mb, _, share, single_pass = _minibatching(cfg, d)
    rows = d.my_rows(torch.arange(batch.input_ids.shape[0]), cfg.rollout.group_size)
    temp, chunks = cfg.rollout.temperature, rows.split(mb // d.world)
    # In a single on-policy pass the old log-probs equal the new ones before the step, so
    # the update reuses its own forward (detached) instead of paying for another; a KL folded
    # into the reward needs them before the update, though.
    old_logp = None if single_pass and cfg.algorithm.kl_placement == "loss" else d.gather_rows(torch.cat(
        [policy.token_logprobs(batch.select(i), temp, group_size=share)[0] for i in chunks]
    ))
    need_ref = policy.ref is not None or (policy.is_lora and cfg.algorithm.kl_coef > 0)
    ref_logp = None if not need_ref else d.gather_rows(torch.cat(
        [policy.token_logprobs(batch.select(i), temp, use_ref=True, group_size=share)[0] for i in chunks]
    ))
    return old_logp, ref_logp


def advantages(cfg: RLConfig, rewards, batch: LMRollout, old_logp, ref_logp, old_values):
    """(adv (B,) or (B, T), critic returns (B, T) or None, valid rows (B,), metrics)."""
    a, n = cfg.algorithm, cfg.rollout.group_size
    if a.advantage == "gae" or a.kl_placement == "reward":  # per-token: a critic, or the KL in the reward
        return token_advantages(
            rewards, batch.response_mask, n, a.advantage, values=old_values, logp=old_logp, ref_logp=ref_logp,
            kl_coef=a.kl_coef if a.kl_placement == "reward" else 0.0, gamma=a.gamma, lam=a.lam,
            whiten=a.whiten_advantages, baseline=a.reinforce_baseline)
    adv, valid, m = ADVANTAGES[a.advantage](rewards, n, std_normalize=a.std_normalize, baseline=a.reinforce_baseline)
    return adv, None, valid, m


def update(
    policy: LMPolicy, opt, batch: LMRollout, adv: torch.Tensor, mask: torch.Tensor, old_logp, ref_logp,
    cfg: RLConfig, gen, critic=None, train_policy: bool = True, prec: Precision | None = None, d: Dist | None = None,
) -> dict[str, float]:
    """ppo_epochs passes over the batch in minibatches, one optimizer step per minibatch;
    each minibatch's gradient is accumulated over micro-batches, so memory is bounded by the
    micro-batch while the loss is exactly the minibatch's (same denominators, see aggregate).
    critic: (Critic, its optimizer, old values, returns) for PPO; it steps on the same
    minibatches. train_policy=False (critic warm-up) updates only the critic. prec: train.precision
    (autocast of the policy's forward, loss scaling; the critic trains in fp32). d: under torchrun
    each rank takes its share of every minibatch, with the whole minibatch's denominators, and the
    gradient engine (DDP / FSDP2) sums the shares (see regen/runtime/dist.py)."""
    a, t = cfg.algorithm, cfg.train
    prec, d = prec or Precision("fp32", policy.device), d or Dist()
    temp, B = cfg.rollout.temperature, mask.shape[0]
    mb, unit, share, single_pass = _minibatching(cfg, d)
    micro = t.micro_batch_size or mb
    loss_fn = POLICY_LOSSES[a.name]
    sums: dict[str, float] = {}
    n_steps = skipped = 0
    # the optimizer's own list: FSDP2 swaps a module's parameters for unsharded ones around forwards
    params = [p for g in opt.param_groups for p in g["params"]]
    for _ in range(t.ppo_epochs):
        order = torch.arange(B) if single_pass else _shuffle_groups(B, unit, gen)  # the same order on every rank
        for idx in order.split(mb):
            if critic is not None:
                c_model, c_opt, old_v, returns = critic
                c_m = c_model.train_minibatch(c_opt, batch, idx, micro, old_v, returns, mask, cfg.critic.value_clip,
                                              a.loss_agg, float(cfg.rollout.max_new_tokens), t.grad_clip)
                for k, v in c_m.items():
                    sums[k] = sums.get(k, 0.0) + v
            if not train_policy:
                continue
            denoms = batch_denominators(mask[idx])
            tokens = batch.response_mask[idx].sum().clamp(min=1)
            opt.zero_grad(set_to_none=True)
            step_m: dict[str, float] = {}
            finite = True
            for part in d.my_rows(idx, share).split(micro):
                sub = batch.select(part)
                with prec.autocast():
                    logp, entropy = policy.token_logprobs(sub, temp, with_entropy=True,
                                                          group_size=share if micro % share == 0 else 1,
                                                          entropy_grad=a.entropy_coef > 0)
                loss, m = loss_fn(
                    logp,
                    logp.detach() if old_logp is None else old_logp[part],
                    adv[part],
                    mask[part],
                    ref_logp=None if ref_logp is None else ref_logp[part],
                    clip_low=a.clip_low,
                    clip_high=a.clip_high,
                    kl_coef=a.kl_coef if a.kl_placement == "loss" else 0.0,  # else it is in the reward
                    kl_estimator=a.kl_estimator,
                    agg=a.loss_agg,
                    norm=float(cfg.rollout.max_new_tokens),
                    dual_clip=a.dual_clip,
                    entropy=entropy,
                    entropy_coef=a.entropy_coef,
                    denoms=denoms,
                )
                if not d.all_true(bool(torch.isfinite(loss))):
                    finite = False  # a non-finite loss would poison the weights: skip this step (every rank)
                    break
                prec.backward(loss * d.loss_scale)
                # token mean over the whole minibatch, so shares of it (micro-batches, ranks) add up
                m["entropy"] = (entropy.detach() * sub.response_mask).sum() / tokens
                share_of_rows = len(part) / len(idx)
                for k, v in m.items():  # losses are already scaled to the minibatch: they add up
                    w = 1.0 if k in ("loss", "pg_loss", "kl", "entropy") else share_of_rows
                    step_m[k] = step_m.get(k, 0.0) + w * float(v)
            if not finite:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            step_m = d.sum_floats(step_m)  # each rank's share of the minibatch's metrics
            grad_norm, stepped = prec.step(opt, params, t.grad_clip)
            if not stepped:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            step_m["grad_norm"] = float(grad_norm)
            for k, v in step_m.items():
                sums[k] = sums.get(k, 0.0) + v
            n_steps += 1
    n_mb = t.ppo_epochs * (B // mb)  # critic steps taken (it is not skipped in warm-up)
    out = {k: v / (n_mb if k.startswith("critic/") else max(n_steps, 1)) for k, v in sums.items()}
    out["nonfinite_skipped"] = float(skipped)
    return out


def score_batch(reward, batch: LMRollout, items, cfg: RLConfig) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """Rewards (B,) of a rollout (NaN = missing) and each part, with DAPO's soft overlong
    punishment added when configured."""
    n, finished = cfg.rollout.group_size, batch.finished.tolist()
    samples = [Sample(items[i // n].prompt, batch.completions[i], items[i // n].meta, finished[i])
               for i in range(len(batch.completions))]
    total, parts = reward(samples)
    rewards = torch.tensor(total, dtype=torch.float32)
    if cfg.algorithm.overlong is not None:
        o = cfg.algorithm.overlong
        penalty = overlong_penalty(batch.response_mask.sum(1).cpu(), o.max_len, o.cache_len, o.factor)
        rewards = rewards + penalty  # NaN (missing) stays missing
        parts["overlong_penalty"] = penalty.tolist()
    return rewards, parts


def refill_groups(run: Session, cfg: RLConfig, batch: LMRollout, scored) -> tuple[LMRollout, tuple, dict]:
    """DAPO dynamic sampling (Yu et al. 2025, eq. 11 and Alg. 1): keep only groups whose
    rewards differ (the others have zero advantage: no signal) and sample more prompts until
    the step holds prompts_per_step such groups, at most algorithm.max_sampling_rounds extra
    rounds. Returns the filled rollout, its (rewards, parts), and metrics."""
    n, G = cfg.rollout.group_size, cfg.prompts_per_step
    kept: list[tuple[LMRollout, torch.Tensor, dict]] = []
    have = dropped = rounds = 0
    while True:
        rewards, parts = scored
        grouped = rewards.view(-1, n)
        finite = torch.isfinite(grouped)
        hi = torch.where(finite, grouped, torch.full_like(grouped, -torch.inf)).amax(1)
        lo = torch.where(finite, grouped, torch.full_like(grouped, torch.inf)).amin(1)
        ok = (finite.sum(1) >= 2) & (hi > lo)
        take = ok.nonzero().flatten()[: G - have]
        rows = (take[:, None] * n + torch.arange(n)).flatten()
        if len(rows):
            kept.append((batch.select(rows), rewards[rows], {k: [v[i] for i in rows.tolist()] for k, v in parts.items()}))
        have, dropped = have + len(take), dropped + int((~ok).sum())
        if have >= G or rounds >= cfg.algorithm.max_sampling_rounds:
            break
        rounds += 1
        items, batch = run.rollout.next(run.gen)
        scored = score_batch(run.reward, batch, items, cfg)
    metrics = {"dynamic/extra_rounds": float(rounds), "dynamic/dropped_groups": float(dropped),
               "dynamic/filled_frac": have / G}
    if not kept:  # nothing with signal even after the extra rounds: train on the last batch (zero advantages)
        return batch, scored, metrics
    filled = concat_rollouts([k[0] for k in kept], run.policy.pad_id)
    all_parts = {k: [x for part in kept for x in part[2][k]] for k in kept[0][2]}
    return filled, (torch.cat([k[1] for k in kept]), all_parts), metrics


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _shuffle_groups(B: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A random order of the B rows that keeps each group of n consecutive rows together."""
    groups = torch.randperm(B // n, generator=gen, device=gen.device).cpu()
    return (groups[:, None] * n + torch.arange(n)).flatten()


def train(cfg: RLConfig, resume: bool = False, force: bool = False) -> dict:
    kind = which_loop(cfg)  # refuses a model / algorithm / placement that do not go together
    if kind == "flow":  # images / videos: see regen/flow_loop.py
        from regen.flow_loop import train_flow

        return train_flow(cfg, resume, force)
    if kind == "dpo":  # offline: no sampling, no reward; see regen/dpo.py
        from regen.dpo import train_dpo

        return train_dpo(cfg, resume, force)
    run = Session.start(cfg, resume, force)  # inputs checked, run dir ready, state restored
    policy, opt, gen, reward, alerts, health = run.policy, run.opt, run.gen, run.reward, run.alerts, run.health
    scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-score")
    unscored = 0  # consecutive steps in which no sample got a score
    expected_versions = run.saved_reward_versions
    summary: dict = {"eval_before": {}, "eval_after": {}, "checkpoint": None, "stopped_early": False}
    if run.start_step >= cfg.train.steps:
        print(f"run already at step {run.start_step} of {cfg.train.steps}: nothing to do "
              "(raise train.steps to continue it)")
        run.close()
        return {**summary, "export": str(run.run_dir / "export")}
    if run.eval_items and run.start_step == 0:
        summary["eval_before"] = run_eval(policy, run.eval_items, cfg, reward, run.run_dir, 0)
        run.log.log(0, summary["eval_before"])
    with StepProgress(cfg.train.steps, run.start_step, cfg.log.progress, cfg.log.every, cfg.algorithm.name) as bar, \
            GracefulStop(bar.print) as stop:
        alerts.echo = bar.print  # alerts go above the live bar, not through it
        if summary["eval_before"]:
            bar.print(f"held-out before training: {fmt_eval(summary['eval_before'])}")
        step = run.start_step
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            # 1. sample: a group of n completions for each prompt of this step
            run.hooks.enter("sample")
            with run.precision.autocast():
                items, batch = run.rollout.next(gen)  # here, on each torchrun rank, or on Ray actors
            run.hooks.enter("update")  # reference, critic and optimizer state back for what follows
            t1 = time.perf_counter()

            # 2. score: one reward per completion; NaN = missing (excluded, never zero). Scoring
            # runs in the background while the reference / behaviour log-probs are computed.
            scoring = scorer.submit(score_batch, reward, batch, items, cfg)
            dyn: dict[str, float] = {}
            if cfg.algorithm.dynamic_sampling:  # DAPO: replace groups without signal (waits for scores)
                batch, scored, dyn = refill_groups(run, cfg, batch, scoring.result())
                scoring = _done(scored)
            with run.precision.autocast():  # the same autocast as the update's: on-policy ratio 1
                old_logp, ref_logp = fixed_logprobs(policy, batch, cfg, run.dist)
            old_logp = run.rollout.old_logprobs(batch, old_logp)  # sampled with older weights (Ray): theirs
            t_wait = time.perf_counter()
            rewards, parts = scoring.result()
            t2 = time.perf_counter()

            # 3. advantage: group-relative; missing rewards and degenerate groups get no gradient
            old_values = None if run.critic is None else run.critic.values_in_chunks(batch, _minibatching(cfg)[0])
            adv, returns, valid, adv_m = advantages(cfg, rewards, batch, old_logp, ref_logp, old_values)
            mask = batch.response_mask * valid.to(batch.response_mask.dtype).unsqueeze(1).to(policy.device)
            adv = adv.to(policy.device)
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
            lr = lr_at(step, cfg.optim, cfg.train.steps) * health.lr_scale
            set_lr(opt, lr)
            scored = bool(valid.any())
            unscored = 0 if scored else unscored + 1
            critic = None
            if run.critic is not None:
                set_lr(run.critic_opt, lr * cfg.critic.lr / cfg.optim.lr)
                critic = (run.critic, run.critic_opt, old_values, returns)
            if scored:
                upd = update(policy, opt, batch, adv, mask, old_logp, ref_logp, cfg, gen, critic,
                             train_policy=step > cfg.critic.warmup_steps or run.critic is None, prec=run.precision,
                             d=run.dist)
                if critic is not None:
                    upd["critic/explained_var"] = explained_variance(old_values, returns, mask)
            else:
                upd = {"update_skipped": 1.0}
            t3 = time.perf_counter()

            # 5. sync: new weights to the sampler (nothing to move when the sampler is the trained model)
            sync_m = run.rollout.sync(policy, step)

            metrics = step_metrics(batch, rewards, parts, adv_m, upd, lr, (t0, t1, t_wait, t2, t3))
            metrics.update(reward.stats())
            metrics.update(run.rollout.stats())
            metrics.update(sync_m)
            metrics.update(dyn)
            if run.eval_items and cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                metrics.update(run_eval(policy, run.eval_items, cfg, reward, run.run_dir, step))
            run.log.log(step, metrics)
            bar.update(step, f"reward {metrics['reward/mean']:.3f}  {metrics['throughput/samples_per_s']:.0f} samples/s")

            # health: skip / roll back / alert; then periodic checkpoint, stop conditions
            if health.observe(step, metrics):
                run.rollback(step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != cfg.train.steps:
                run.save(step)
            if unscored >= cfg.health.stop_after_unscored_steps:
                run.save(step)
                alerts.fire(step, "run_stopped", f"no reward came back for {unscored} consecutive steps")
                raise RunStopped(
                    f"stopped at step {step}: no reward came back for {unscored} consecutive steps "
                    f"(see {run.run_dir / 'alerts.jsonl'}); a checkpoint was written: fix the scorer and rerun"
                )
            if run.dist.any_true(stop.requested):  # torchrun: every rank stops at the same step
                summary["stopped_early"] = True
                break

        summary["checkpoint"] = run.save(step)
        if summary["checkpoint"] is None:
            raise UserError(f"the final checkpoint could not be written to {run.run_dir} (see alerts.jsonl)")
        if run.eval_items and not summary["stopped_early"]:
            summary["eval_after"] = run_eval(policy, run.eval_items, cfg, reward, run.run_dir, step)
            run.log.log(step, summary["eval_after"])
    scorer.shutdown()
    summary["export"] = str(run.run_dir / "export")
    if not summary["stopped_early"]:
        run.export()
    run.close()  # waits for mirror uploads still in flight
    if summary["stopped_early"]:
        print(f"stopped at step {step}: checkpoint {summary['checkpoint']}; run the same command to resume")
    return summary


def step_metrics(batch, rewards, parts, adv_m, upd: dict, lr: float, times) -> dict[str, float]:
    """The metrics.jsonl row of one step (see README: The run directory)."""
    t0, t1, t_wait, t2, t3 = times
    lengths = batch.response_mask.sum(1)
    finite = rewards[torch.isfinite(rewards)]
    return {
        "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
        "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
        **{f"reward/{k}": nanmean(v) for k, v in parts.items()},
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
        "time/logprob_s": t_wait - t1,  # reference / behaviour passes, overlapped with scoring
        "time/score_s": t2 - t_wait,  # waiting for scores after that overlap
        "time/update_s": t3 - t2,
        "time/step_s": t3 - t0,
        "throughput/samples_per_s": len(lengths) / (t3 - t0),
    }
