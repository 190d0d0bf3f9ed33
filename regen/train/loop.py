"""The RL loop, once for every online method and modality:

    prompts -> 1 sample -> 2 score -> 3 advantage -> 4 update -> 5 sync -> (next step)

What a stage does to a language model or to a flow-matching image / video model is behind the
modality adapter (regen/modalities/: `run.m`), the math in pure functions (regen/algorithms/),
where sampling happens behind the placement (regen/placement/: `run.rollout`), and the books
(checkpoints, health, alerts, evaluation) in regen/train/run.py. This file only orders them.
Single process by default; `breakpoint()` works anywhere in it.

The objectives of the method families, as losses to minimise (details and equations in the
docstrings of regen/algorithms/):
  clipped ratio   grpo, ppo, flow_grpo:  agg( max(-A rho, -A clip(rho, 1-eps_lo, 1+eps_hi)) ) + beta KL
                  rho = pi_theta / pi_old per token (LM) or per SDE denoising step (flow_grpo)
  sequence ratio  gspo:   mean_i max(-A_i s_i, -A_i clip(s_i, ...)), s_i the length-normalised ratio
  trust region    flow_dppo: mean -A rho, a step dropped where KL(new || old) >= tau pushes further
  forward process nft:  r ||x0_hat+ - x0||^2 + (1 - r) ||x0_hat- - x0||^2, r = optimality of A
                  awm:  mean_i A_i w(t) ||v_theta(x_t, t) - (eps - x0)||^2 (+ KL to an EMA anchor)
with group-relative advantages A (GRPO, RLOO, REINFORCE++, Flow-GRPO's) or GAE from PPO's critic.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from regen.errors import UserError
from regen.placement import released_on_error
from regen.placement.checks import which_loop
from regen.runtime import dist as rdist
from regen.runtime.metrics import nanmean
from regen.runtime.progress import StepProgress, run_label
from regen.runtime.signals import GracefulStop
from regen.train.dynamic_sampling import refill_groups
from regen.train.run import Run


def train(cfg, resume: bool = False, force: bool = False) -> dict:
    if which_loop(cfg) == "dpo":  # offline: no sampling, no reward; see regen/offline/dpo.py
        from regen.offline.dpo import train_dpo

        return train_dpo(cfg, resume, force)
    if cfg.distributed.mode == "ray" and cfg.distributed.trainer_workers > 1 and not rdist.in_trainer_group():
        from regen.train.ray_trainers import train_group

        return train_group(cfg, resume, force)  # N trainer actors run this function as one process group
    run = Run.start(cfg, resume, force)  # inputs checked, run dir ready, models built, state restored
    m, gen = run.m, run.gen
    summary: dict = {"eval_before": {}, "eval_after": {}, "checkpoint": None, "stopped_early": False}
    if run.start_step >= cfg.train.steps:  # finished, or killed after its final checkpoint
        done = run.complete()
        print(f"run already at step {run.start_step} of {cfg.train.steps}: "
              + (f"completed its {' and '.join(done)}" if done else "nothing to do (raise train.steps to continue it)"))
        run.close()
        return {**summary, "export": str(run.run_dir / "export")}
    scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-score")
    if run.eval_items and run.start_step == 0:
        summary["eval_before"] = run.evaluate(0)
        run.log.log(0, summary["eval_before"])
    with StepProgress(cfg.train.steps, run.start_step, cfg.log.progress, cfg.log.every, run_label(cfg),
                      cfg.log.every_s) as bar, \
            GracefulStop(bar.print) as stop, released_on_error(run.rollout, run.reward):
        run.alerts.echo = bar.print  # alerts go above the live bar, not through it
        if summary["eval_before"]:
            bar.print("held-out before training: " + "  ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in summary["eval_before"].items()))
        step = run.start_step
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            run.wait_for_reward(step, stop, bar)  # a reward service that is down: wait, do not spend steps
            t0 = time.perf_counter()
            # 1. sample: a group of n samples for each prompt of this step (token sequences, or
            # images / videos with SDE steps where the method trains on them)
            run.hooks.enter("sample")  # train.offload: optimizer state and idle frozen copies leave the GPU
            with run.precision.autocast():
                items, batch = run.rollout.next(step, gen)  # here, on each torchrun rank, or on Ray actors
            t1 = time.perf_counter()

            # 2. score: one reward per sample; NaN = missing (excluded, never zero). Scoring runs in
            # the background while the terms that stay fixed during the update are computed.
            scoring = scorer.submit(score, run, items, batch)
            dyn: dict[str, float] = {}
            if cfg.algorithm.dynamic_sampling:  # DAPO: replace groups without signal (waits for scores)
                items, batch, scored, dyn = refill_groups(run, step, items, batch, scoring.result(), score)
                scoring = _done(scored)
            run.hooks.enter("update")  # parked state back; colocate: the sampling engine sleeps
            with run.precision.autocast():  # the same autocast as the update's: on-policy ratio 1
                fixed = m.fixed_terms(batch)  # behaviour / reference log-probs, SDE means
            if run.rollout.stale(batch):  # sampled with older weights (Ray): the sampling weights' terms
                fixed = m.behaviour_terms(batch, fixed)
            t_wait = time.perf_counter()
            rewards, parts = scoring.result()
            t2 = time.perf_counter()

            # 3. advantage: group-relative (or GAE); missing rewards and degenerate groups get none
            adv = m.advantages(rewards, batch, fixed)
            run.check_rewards(step, adv.metrics)

            # 4. update: the method's loss over minibatches, several epochs. Skipped when no sample
            # got a score: an optimizer step on zero gradients would still move the weights
            # through Adam's momentum.
            lr = run.set_lr(step)
            scored = bool(adv.valid.any())
            upd = m.update(run.opt, batch, adv, fixed, gen, step, run.precision, run.dist) if scored \
                else {"update_skipped": 1.0}
            m.after_update(step)  # NFT's old policy, the weight EMA
            t3 = time.perf_counter()

            # 5. sync: new weights to the samplers (nothing to move when the sampler is the trained model)
            run.hooks.enter("sync")  # distributed.colocate: a sleeping vLLM engine wakes to take them
            sync_m = run.rollout.sync(step)

            metrics = step_metrics(rewards, parts, adv.metrics, upd, None if m.PER_MODEL_LR else lr,
                                   (t0, t1, t_wait, t2, t3), m.METRICS)
            metrics.update({**m.batch_metrics(batch), **run.reward.stats(), **run.rollout.stats(), **sync_m, **dyn,
                            **run.observe_tasks(items, rewards),  # multi-task: per-task metrics, dynamic weights
                            **(run.memory.pop() if run.memory else {})})  # colocate: each phase's peak memory
            run.end_step(step, metrics, scored, bar)  # eval, log, health / rollback, checkpoint, stop if unscored
            if run.dist.any_true(stop.requested):  # torchrun: every rank stops at the same step
                summary["stopped_early"] = True
                break

        summary["checkpoint"] = run.save(step)
        if summary["checkpoint"] is None:
            raise UserError(f"the final checkpoint could not be written to {run.run_dir} (see alerts.jsonl)")
        if run.eval_items and not summary["stopped_early"]:
            summary["eval_after"] = run.evaluate(step)
            run.log.log(step, summary["eval_after"])
    scorer.shutdown()
    summary["export"] = str(run.run_dir / "export")
    if not summary["stopped_early"]:
        run.export()
    run.close()  # waits for mirror uploads still in flight
    if summary["stopped_early"]:
        print(f"stopped at step {step}: checkpoint {summary['checkpoint']}; run the same command to resume")
    return summary


def score(run: Run, items, batch) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """Rewards (B,) of a batch (NaN = missing) and each part, with the method's own terms."""
    total, parts = run.reward(run.m.reward_samples(items, batch))
    return run.m.shape_rewards(torch.tensor(total, dtype=torch.float32), parts, batch)


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def step_metrics(rewards, parts, adv_m, upd: dict, lr: float | None, times, defaults: dict) -> dict[str, float]:
    """The metrics.jsonl row of one step (docs/run-directory.md lists its keys)."""
    t0, t1, t_wait, t2, t3 = times
    finite = rewards[torch.isfinite(rewards)]
    return {
        "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
        "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
        **{f"reward/{k}": nanmean(v) for k, v in parts.items()},
        "reward/missing_frac": float(adv_m["missing_frac"]),
        "reward/zero_std_frac": float(adv_m["zero_std_frac"]),
        **({"reward/adv_clip_frac": float(adv_m["adv_clip_frac"])} if "adv_clip_frac" in adv_m else {}),
        "loss": upd.pop("loss", float("nan")),
        **defaults,  # the modality's algorithm metrics when the update did not report them
        **upd,
        **({} if lr is None else {"lr": lr}),
        "time/sample_s": t1 - t0,
        "time/logprob_s": t_wait - t1,  # fixed terms (reference / behaviour passes), overlapped with scoring
        "time/score_s": t2 - t_wait,  # waiting for scores after that overlap
        "time/update_s": t3 - t2,
        "time/step_s": t3 - t0,
        "throughput/samples_per_s": len(rewards) / (t3 - t0),
    }
