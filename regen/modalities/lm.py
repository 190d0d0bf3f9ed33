"""Language models behind the modality protocol (regen/modalities/base.py): GRPO, DAPO, GSPO,
RLOO, REINFORCE++ and PPO over token sequences of any transformers causal LM.

What the loop's stages are here:
  sample     completions from regen's KV-cached sampler (or vLLM), one uniform per (row, token)
             drawn up front so any slice of the batch samples exactly its rows
  fixed      the behaviour policy's and the reference's per-token log-probs
  advantage  group-relative (GRPO / Dr.GRPO), leave-one-out (RLOO), batch-whitened (REINFORCE++),
             or GAE from PPO's critic; per token when the KL is folded into the reward
  update     the clipped token-level (GRPO / PPO) or sequence-level (GSPO) loss, with optional
             dual-clip, entropy bonus and KL to the starting model
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from regen.algorithms import ADVANTAGES, POLICY_LOSSES, advantage_kwargs, overlong_penalty
from regen.algorithms.gae import explained_variance, token_advantages
from regen.algorithms.losses import batch_denominators
from regen.data.images import first_image
from regen.errors import UserError
from regen.modalities.base import Advantages, Modality
from regen.modalities.lm_eval import run_eval
from regen.policies.critic import Critic
from regen.policies.lm import (
    LMPolicy,
    LMRollout,
    apply_lora,
    concat_rollouts,
    configure_prompts,
    load_model_and_tokenizer,
)
from regen.policies.lm_episodes import episode_engine, episode_metrics
from regen.policies.vlm import check_trainable
from regen.rewards import Sample
from regen.runtime import checkpoint as ckpt
from regen.runtime.dist import Dist
from regen.runtime.optim import make_optimizer


@dataclass
class LMPlan:
    """The randomness of one step's sampling: one uniform per (row, token), for the whole batch."""

    u: torch.Tensor  # (B, max_new_tokens); multi-turn episodes: (B, env.max_turns * max_new_tokens)
    seeds: torch.Tensor | None = None  # (B,) each episode's environment seed (env runs only)

    def select(self, rows: torch.Tensor) -> LMPlan:
        return LMPlan(self.u[rows.to(self.u.device)], None if self.seeds is None else self.seeds[rows.to(self.seeds.device)])

    def cpu(self) -> LMPlan:
        """To travel to a rollout actor through the object store."""
        return LMPlan(self.u.cpu(), None if self.seeds is None else self.seeds.cpu())


@dataclass
class LMMinibatch:
    batch: LMRollout
    idx: torch.Tensor  # (M,) rows of the batch
    adv: Advantages
    fixed: dict
    denoms: dict  # the whole minibatch's loss denominators (see aggregate)
    tokens: torch.Tensor  # its response tokens, for the entropy metric


class LMModality(Modality):
    kind = "lm"
    METRICS = {"kl": 0.0, "clip_frac": 0.0, "entropy": float("nan")}

    def __init__(self, cfg, device: torch.device, dist: Dist, state: dict | None = None, alerts=None,
                 sampler_only: bool = False):
        """The policy (resumed from `state`'s checkpoint when given), its KL reference, PPO's
        critic; sampler_only: just the policy, for a rollout actor (weights arrive by sync)."""
        self.cfg, self.device, self.dist, self.alerts = cfg, device, dist, alerts
        self.gen_device = device  # the uniforms are drawn where the model samples
        if sampler_only:
            model, tok = load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)
            if cfg.model.lora is not None:
                model = apply_lora(model, cfg.model.lora)  # the trainer sends the adapter
            vllm = cfg.rollout.engine == "vllm"  # the actor's GPU is vLLM's; the transformers copy stays on the CPU
            self.policy = LMPolicy(model, tok, torch.device("cpu") if vllm else device)
            self.critic, self.critic_opt = None, None
            configure_prompts(self.policy, cfg)
            self.policy.model.eval()
            self.engine = episode_engine(cfg, self.policy) or self.policy
            if vllm:
                from regen.policies.lm_vllm import VLLMEngine

                self.engine = VLLMEngine(cfg, self.policy)
            self.vllm = vllm
            return
        model, tok, reference = load_policy_model(cfg, state)
        self.policy = LMPolicy(model, tok, device, reference=reference)
        if self.policy.processor is not None:
            refuse_for_images(cfg, self.policy.model.config.model_type)
        configure_prompts(self.policy, cfg)
        self.policy.model.eval()  # dropout off: sampling and training see the same function (ratio 1 on-policy)
        if dist.on:  # DDP's wrapper, or the model (and reference) sharded in place by FSDP2
            self.policy.forward_model = dist.wrap(self.policy.model)
            if dist.sharded:
                if self.policy.ref is not None:
                    dist.wrap(self.policy.ref, trainable=False)
                self.policy.all_done = lambda done: dist.all_true(bool(done.all()))  # same forwards on every rank
        if cfg.env is not None and dist.sharded:
            raise UserError("env with distributed.strategy=fsdp: multi-turn episodes need the same number of forward "
                            "calls on every rank, which FSDP2 requires and episodes do not give yet; use strategy=ddp")
        self.critic, self.critic_opt = load_critic(cfg, device, state, alerts, dist)
        B, mb, n = cfg.rollout.global_batch_size, cfg.train.global_minibatch_size, cfg.rollout.group_size
        self.unit = n if mb % n == 0 else 1  # minibatches of whole groups when they fit
        # Whole groups let each group's prompt be computed once (see token_logprobs); under torchrun
        # each rank's share of a minibatch must hold whole groups for that. FSDP2 needs the same
        # number of forwards on every rank, which the prompt sharing (length buckets) does not give.
        self.share = self.unit if (mb // dist.world) % self.unit == 0 and not dist.sharded else 1
        self.single_pass = cfg.train.ppo_epochs == 1 and mb == B
        self.engine = episode_engine(cfg, self.policy) or self.policy
        if cfg.rollout.engine == "vllm" and cfg.distributed.mode != "ray":
            from regen.policies.lm_vllm import VLLMEngine

            self.engine = VLLMEngine(cfg, self.policy)
        self.vllm = self.engine is not self.policy and cfg.env is None  # this process samples with vLLM

    @property
    def trained(self) -> torch.nn.Module:
        return self.policy.model

    def frozen(self) -> tuple[list, list]:
        return [self.critic_opt], [self.policy.ref, None if self.critic is None else self.critic.model]

    # ------------------------------------------------------------------ 1. sample

    def plan(self, gen: torch.Generator, step: int, again: bool = False) -> LMPlan:
        c = self.cfg
        B, T = c.rollout.global_batch_size, c.rollout.max_new_tokens
        if c.env is None:
            return LMPlan(torch.rand(B, T, generator=gen, device=gen.device))
        return LMPlan(torch.rand(B, c.env.max_turns * T, generator=gen, device=gen.device),
                      torch.randint(0, 2**31 - 1, (B,), generator=gen, device=gen.device))

    def inputs(self, items) -> list:
        return self.engine.inputs(items) if self.cfg.env is not None else self.policy.inputs(items)

    def sample(self, prompts: list, n: int, plan: LMPlan, behaviour: bool = False) -> LMRollout:
        """behaviour: also keep each token's log-prob under the sampling weights (rollout actors,
        for batches the trainer gets after its weights moved on)."""
        r = self.cfg.rollout
        # vLLM's log-probs come from its own kernels, not the trained model's: no behaviour terms from
        # it (checks.py keeps max_staleness at 0 there, so the trainer's old log-probs are exact)
        extra = {"with_logp": True} if behaviour and not self.vllm else {}
        if plan.seeds is not None:
            extra["seeds"] = plan.seeds
        with self.dist.unsharded(self.policy.model):  # FSDP2: gathered once, not at every token
            return self.engine.sample(prompts, n, r.temperature, r.top_p, r.max_new_tokens, None, uniforms=plan.u,
                                      **extra)

    def concat(self, parts: list[LMRollout]) -> LMRollout:
        return concat_rollouts(parts, self.policy.pad_id).to(self.device)

    def sync_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu") for k, v in self.policy.model.state_dict().items()
                if not self.policy.is_lora or "lora_" in k}  # LoRA: only the adapter changes

    def sampler_sleep(self) -> None:
        if self.vllm:
            self.engine.sleep()

    def sampler_wake(self) -> None:
        if self.vllm:
            self.engine.wake()

    def sync_local(self, step: int) -> dict[str, float]:
        """A vLLM engine in this process takes the new weights; the policy itself needs nothing."""
        return self.engine.load_weights(self.policy, step) if self.vllm else {}

    def take_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A rollout actor with vLLM: full weights go straight into the engine, bucket by bucket; a
        LoRA adapter goes into the transformers copy, merged and pushed once every bucket is in."""
        if not self.vllm or self.policy.is_lora:
            super().take_weights(state)
        else:
            self.engine.load_tensors(state)

    def weights_taken(self) -> None:
        if not self.vllm:
            return
        if self.policy.is_lora:
            self.engine.load_weights(self.policy, 0)  # merged copy, every tensor (it resets the prefix cache)
        else:
            self.engine.llm.reset_prefix_cache()  # cached prompt states were computed with the old weights

    # ------------------------------------------------------------------ 2. score

    def reward_samples(self, items, batch: LMRollout) -> list[Sample]:
        n, finished = self.cfg.rollout.group_size, batch.finished.tolist()
        # a VLM's prompt image reaches the rewards as the sample's media (and its 'image' value as meta)
        return [Sample(items[i // n].prompt, batch.completions[i], {**items[i // n].meta, **batch.row_meta(i)},
                       finished[i], first_image(items[i // n].image)) for i in range(len(batch.completions))]

    def shape_rewards(self, rewards: torch.Tensor, parts: dict, batch: LMRollout) -> tuple[torch.Tensor, dict]:
        """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) added to the reward."""
        o = self.cfg.algorithm.overlong
        if o is None:
            return rewards, parts
        penalty = overlong_penalty(batch.response_mask.sum(1).cpu(), o.max_len, o.cache_len, o.factor)
        return rewards + penalty, {**parts, "overlong_penalty": penalty.tolist()}  # NaN (missing) stays missing

    @torch.no_grad()
    def fixed_terms(self, batch: LMRollout) -> dict:
        """The behaviour policy's (old) and the reference's log-probs; under torchrun each rank
        computes its own groups' rows and every rank gets all of them. In a single on-policy pass
        the old log-probs equal the new ones before the step, so the update reuses its own forward
        (detached) instead of paying for another; a KL folded into the reward needs them first."""
        c, d, p = self.cfg, self.dist, self.policy
        rows = d.my_rows(torch.arange(batch.input_ids.shape[0]), c.rollout.group_size)
        temp, chunks = c.rollout.temperature, rows.split(c.train.global_minibatch_size // d.world)

        def logprobs(use_ref: bool) -> torch.Tensor:
            return d.gather_rows(torch.cat([p.token_logprobs(batch.select(i), temp, use_ref=use_ref,
                                                             group_size=self.share)[0] for i in chunks]))

        a = c.algorithm
        old = None if self.single_pass and a.kl_placement == "loss" else logprobs(False)
        need_ref = p.ref is not None or (p.is_lora and a.kl_coef > 0)
        return {"old_logp": old, "ref_logp": logprobs(True) if need_ref else None}

    def behaviour_terms(self, batch: LMRollout, fixed: dict) -> dict:
        """A batch sampled with older weights (Ray, max_staleness >= 1): PPO's ratio is taken
        against the behaviour policy's log-probs, returned by the actors, so the clip bounds the
        update relative to the weights that actually sampled (Schulman et al. 2017, eq. 7)."""
        return {**fixed, "old_logp": batch.behaviour_logp.to(batch.response_mask.device)}

    # ------------------------------------------------------------------ 3. advantage

    def advantages(self, rewards: torch.Tensor, batch: LMRollout, fixed: dict) -> Advantages:
        a, n = self.cfg.algorithm, self.cfg.rollout.group_size
        values = None if self.critic is None else \
            self.critic.values_in_chunks(batch, self.cfg.train.global_minibatch_size)
        returns = None
        if a.advantage == "gae" or a.kl_placement == "reward":  # per-token: a critic, or the KL in the reward
            adv, returns, valid, m = token_advantages(
                rewards, batch.response_mask, n, a.advantage, values=values, logp=fixed["old_logp"],
                ref_logp=fixed["ref_logp"], kl_coef=a.kl_coef if a.kl_placement == "reward" else 0.0, gamma=a.gamma,
                lam=a.lam, whiten=a.whiten_advantages, baseline=a.reinforce_baseline)
        else:
            fn = ADVANTAGES[a.advantage]
            adv, valid, m = fn(rewards, n, **advantage_kwargs(fn, a))
        dev = self.device
        mask = batch.response_mask * valid.to(batch.response_mask.dtype).unsqueeze(1).to(dev)
        return Advantages(adv.to(dev), valid.to(dev), mask, m, returns, values)

    # ------------------------------------------------------------------ 4. update

    def minibatch(self, batch: LMRollout, idx, adv: Advantages, fixed: dict, gen) -> LMMinibatch:
        return LMMinibatch(batch, idx, adv, fixed, batch_denominators(adv.mask[idx]),
                           batch.response_mask[idx].sum().clamp(min=1))

    def micro_loss(self, mini: LMMinibatch, pos: torch.Tensor) -> tuple[torch.Tensor, dict]:
        a, c = self.cfg.algorithm, self.cfg
        part = mini.idx[pos]
        sub = mini.batch.select(part)
        micro = c.train.micro_batch_size or c.train.global_minibatch_size
        logp, entropy = self.policy.token_logprobs(sub, c.rollout.temperature, with_entropy=True,
                                                   group_size=self.share if micro % self.share == 0 else 1,
                                                   entropy_grad=a.entropy_coef > 0)
        old, ref = mini.fixed["old_logp"], mini.fixed["ref_logp"]
        loss, m = POLICY_LOSSES[a.name](
            logp, logp.detach() if old is None else old[part], mini.adv.adv[part], mini.adv.mask[part],
            ref_logp=None if ref is None else ref[part], clip_low=a.clip_low, clip_high=a.clip_high,
            kl_coef=a.kl_coef if a.kl_placement == "loss" else 0.0,  # else it is in the reward
            kl_estimator=a.kl_estimator, agg=a.loss_agg, norm=float(c.rollout.max_new_tokens),
            dual_clip=a.dual_clip, entropy=entropy, entropy_coef=a.entropy_coef, denoms=mini.denoms)
        # token mean over the whole minibatch, so shares of it (micro-batches, ranks) add up
        m["entropy"] = (entropy.detach() * sub.response_mask).sum() / mini.tokens
        return loss, m

    def aux_step(self, batch: LMRollout, idx, adv: Advantages) -> dict[str, float]:
        """PPO's critic: one optimizer step on the same minibatch as the policy."""
        if self.critic is None:
            return {}
        c = self.cfg
        micro = c.train.micro_batch_size or c.train.global_minibatch_size
        return self.critic.train_minibatch(self.critic_opt, batch, idx, micro, adv.values, adv.returns, adv.mask,
                                           c.critic.value_clip, c.algorithm.loss_agg, float(c.rollout.max_new_tokens),
                                           c.train.grad_clip)

    def trains_policy(self, step: int) -> bool:
        return self.critic is None or step > self.cfg.critic.warmup_steps  # critic warm-up holds the policy

    def set_lr(self, lr: float) -> None:
        if self.critic_opt is not None:
            for g in self.critic_opt.param_groups:
                g["lr"] = lr * self.cfg.critic.lr / self.cfg.optim.lr

    def update_metrics(self, adv: Advantages) -> dict[str, float]:
        if self.critic is None:
            return {}
        return {"critic/explained_var": explained_variance(adv.values, adv.returns, adv.mask)}

    def batch_metrics(self, batch: LMRollout) -> dict[str, float]:
        lengths = batch.response_mask.sum(1)
        out = {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
               "response/truncated_frac": float((~batch.finished).float().mean())}
        return out if batch.episodes is None else out | episode_metrics(batch)

    # ------------------------------------------------------------------ books

    def gather(self):
        d = self.dist
        critic = None if self.critic is None else \
            (d.full_model_state(self.critic.model), d.full_optim_state(self.critic.model, self.critic_opt))
        return d.full_model_state(self.policy.model), critic

    def save(self, folder: Path, gathered) -> None:
        weights, critic = gathered or (None, None)
        self.policy.save_pretrained(folder / "model", weights)
        if self.critic is not None:
            c_weights, c_opt = critic or (None, None)
            self.critic.save_pretrained(folder / "critic", c_weights)
            ckpt.save_optimizer(self.critic_opt if c_opt is None else ckpt.Gathered(c_opt), folder, "critic_optimizer")

    def restore(self, folder: Path | None) -> None:
        d = self.dist
        weights, _, _ = load_policy_model(self.cfg, None if folder is None else {"model_dir": folder / "model"})
        d.load_model_state(self.policy.model, weights.state_dict())
        if self.critic is not None:  # the critic goes back to the same point as the policy
            state = None if folder is None else {"folder": folder}
            critic, critic_opt = load_critic(self.cfg, self.critic.device, state, self.alerts)
            d.load_model_state(self.critic.model, critic.model.state_dict())
            self.critic_opt.state.clear()
            if folder is not None:
                d.load_optim_state(self.critic.model, self.critic_opt, critic_opt.state_dict())

    def export(self, folder: Path, gathered) -> None:
        self.policy.export(folder, None if gathered is None else gathered[0])

    def evaluate(self, items, reward, run_dir: Path, step: int, quality=None, task: str | None = None
                 ) -> dict[str, float]:
        sampler = self.policy if self.cfg.env is None else self.engine
        return run_eval(sampler, items, self.cfg, reward, run_dir, step, quality, task)


def load_policy_model(cfg, state: dict | None):
    """(model, tokenizer, reference) to train: from the checkpoint when resuming, else from
    model.path / model.init; with model.lora, the base plus a new or saved adapter."""
    if cfg.model.lora is not None:
        base, tok = load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)
        check_trainable(base, cfg.model)
        adapter = None if state is None else state["model_dir"]
        # the reference is the base with the adapter disabled: no second copy (see LMPolicy)
        return apply_lora(base, cfg.model.lora, adapter), tok, None
    model, tok = load_model_and_tokenizer(ckpt.resumed_model(cfg.model, state), cfg.task, cfg.run.seed)
    check_trainable(model, cfg.model)  # model.freeze_vision
    reference = None
    if cfg.algorithm.kl_coef > 0:  # the KL reference is the run's starting model, also after a resume
        reference = "copy" if state is None else load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)[0]
    return model, tok, reference


def refuse_for_images(cfg, family: str) -> None:
    """What the vision-language path does not do yet: one clear error, before any work."""
    if cfg.rollout.engine == "vllm":
        raise UserError(f"rollout.engine=vllm with a {family} vision-language model: regen does not pass images to "
                        "vLLM yet; use rollout.engine=hf")


def load_critic(cfg, device, state: dict | None, alerts, d: Dist | None = None):
    """PPO's critic and its optimizer: from the checkpoint being resumed, else fresh; under
    torchrun (d) data parallel like the policy (DDP, or sharded by FSDP2 before its optimizer
    is made)."""
    if cfg.algorithm.advantage != "gae":
        return None, None
    folder = None if state is None else state["folder"] / "critic"
    if folder is not None and not folder.is_dir():
        if alerts is not None:
            alerts.fire(-1, "critic_missing", f"checkpoint {state['folder'].name} holds no critic: starting a new one")
        folder = None
    critic, d = Critic.load(cfg, device, folder), d or Dist()
    if d.on:
        critic.dist, critic.forward_model = d, d.wrap(critic.model)  # DDP wrapper, or sharded in place
    opt = make_optimizer(critic.model, cfg.optim.model_copy(update={"lr": cfg.critic.lr}))
    saved = None if folder is None else ckpt.load_optimizer(state["folder"], "critic_optimizer")
    if saved is not None:
        d.load_optim_state(critic.model, opt, saved)
    return critic, opt
